"""Prompt lookup (``--speculative-method ngram``): draft by copying what followed an earlier
occurrence of the sequence's last n tokens, in its own prompt and output.

For n from ``--ngram-max`` down to ``--ngram-min``, the last n tokens are searched for in the
sequence's earlier tokens; the most recent match wins, and up to ``depth`` tokens that followed it
become a chain. No model runs, so the proposer declares no cost and the controller tunes its depth
from acceptance alone. Drafts are deterministic (no ``q``): sampling requests verify them by
rejection against a one-hot draft, seeded ones by the drafter-invariant rule.

The search is vectorized over a per-sequence numpy copy of its tokens, appended to as tokens come,
so a step costs a few array operations per drafting sequence, never a Python loop over the context.
"""

from __future__ import annotations

import numpy as np

from engine.request.sequence import Sequence
from engine.sampling.tree import DraftTree
from engine.speculative.proposer import CostShape, ProposeContext, Proposer


def find_continuation(tokens: np.ndarray, n_min: int, n_max: int, depth: int) -> list[int]:
    """Up to ``depth`` tokens that followed the most recent earlier occurrence of the longest
    suffix of ``tokens`` (n_max down to n_min long) that occurs earlier; [] if none does."""
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        pattern = tokens[L - n :]
        # Windows starting at 0 .. L - n - 1: every occurrence that ends before the suffix itself.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: L - 1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start : start + depth].tolist()
    return []


class _Tokens:
    """A growing int32 copy of one sequence's tokens."""

    def __init__(self) -> None:
        self.buf = np.empty(256, dtype=np.int32)
        self.n = 0

    def sync(self, ids: list[int]) -> np.ndarray:
        if len(ids) < self.n:  # the sequence was rolled back (never happens today): start over
            self.n = 0
        if len(ids) > len(self.buf):
            grown = np.empty(max(len(ids), 2 * len(self.buf)), dtype=np.int32)
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown
        self.buf[self.n : len(ids)] = ids[self.n :]
        self.n = len(ids)
        return self.buf[: self.n]


class NgramProposer(Proposer):
    method = "ngram"
    cost = CostShape(kind=None)

    def __init__(self, n_min: int, n_max: int) -> None:
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {n_min} and {n_max}")
        self.n_min, self.n_max = n_min, n_max
        self._tokens: dict[int, _Tokens] = {}

    @classmethod
    def build(cls, config, target, *, tokenizer, eos_token_ids) -> NgramProposer:
        return cls(config.ngram_min, config.ngram_max)

    def slots_needed(self, depth: int, greedy: bool = True) -> int:
        return max(depth, 0)

    def propose(self, seqs: list[Sequence], depths: list[int], ctx: ProposeContext) -> list[DraftTree]:
        trees = []
        for seq, depth in zip(seqs, depths):
            tokens = self._tokens.setdefault(seq.seq_id, _Tokens()).sync(seq.token_ids)
            trees.append(DraftTree.chain(find_continuation(tokens, self.n_min, self.n_max, depth)))
        return trees

    def on_free(self, seq: Sequence) -> None:
        self._tokens.pop(seq.seq_id, None)
