"""Contrastive search (Su et al., 2022): confident tokens that do not repeat what was already said.

Each step of a request with ``penalty_alpha`` (alpha) and ``top_k`` (k):

1. its *candidates* are the k most likely next tokens, ``p`` being the softmax of its next-token
   logits after the logits processors (penalties, bias, no-repeat n-grams; no temperature);
2. every candidate is fed at once, as k siblings at the same position (a one-level tree: each sees
   the context and itself), which gives each its final-normed hidden state ``h`` and the logits of
   the token after it;
3. the chosen candidate maximises ``(1 - alpha) * p(v) - alpha * max_j cos(h_v, h_j)`` over the
   hidden states ``h_j`` of every token before it (prompt and output): the *degeneration penalty*;
4. its K/V moves to the sequence's next slot and its logits row drives the next step.

So a step costs one target forward of k tokens and no other, and the chosen token's logits come
from that same forward. The context's hidden states are kept on the device, unit-normed, one row
per token (computed by the prefill, so a request's prompt is never taken from the prefix cache).
Contrastive search is deterministic and never speculated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request.sequence import Sequence
from engine.request.state import SearchState
from engine.runner.model_runner import ForwardChunk
from engine.sampling.batch import Sample
from engine.sampling.sampler import processed
from engine.sampling.tree import DraftTree


@dataclass
class Fed:
    """Candidates of one sequence in this step's forward."""

    seq: Sequence
    row: int  # logits row of candidate 0 (candidate i: row + i)
    tok: int  # flat token index of candidate 0
    tokens: list[int]
    chosen: int = 0


class ContrastiveSearch:
    def record(self, seq: Sequence, start: int, final: torch.Tensor) -> None:
        """The final hidden states ``[n, H]`` of tokens ``start .. start + n`` (a prefill chunk, a
        recompute) join the context; a prefill from 0 starts it afresh."""
        st = seq.search
        if start == 0:
            st.length = 0
        _append(st, torch.nn.functional.normalize(final.float(), dim=-1))
        st.next_logits = None

    def candidates(self, seqs: list[Sequence], rows_md) -> dict[int, list[int]]:
        """Each ready sequence's k candidates, best first (one transfer for all)."""
        if not seqs:
            return {}
        _, md = rows_md([Sample(s, DraftTree(), i, 0) for i, s in enumerate(seqs)])
        logits = torch.stack([s.search.next_logits for s in seqs])  # [B, V]
        probs = torch.softmax(processed(logits, md), dim=-1)
        k = max(s.params.top_k for s in seqs)
        top, ids = probs.topk(k, dim=-1)  # [B, k]
        out = {}
        for s, p, t in zip(seqs, top, ids.tolist()):
            s.search.probs = p[: s.params.top_k]
            out[s.seq_id] = t[: s.params.top_k]
        return out

    @staticmethod
    def chunk(seq: Sequence, tokens: list[int]) -> ForwardChunk:
        """The candidates side by side at the next position, each seeing the context and itself."""
        k, start = len(tokens), seq.num_computed_tokens
        mask = torch.eye(k, dtype=torch.bool)
        return ForwardChunk(tokens, start, seq.block_table, k, [start] * k, mask)

    def choose(self, fed: list[Fed], logits: torch.Tensor, final: torch.Tensor) -> None:
        """Pick each sequence's candidate (``Fed.chosen``) and move its state on to the next step."""
        if not fed:
            return
        picks = []
        for f in fed:
            st, alpha = f.seq.search, f.seq.params.penalty_alpha
            k = len(f.tokens)
            h = torch.nn.functional.normalize(final[f.tok : f.tok + k].float(), dim=-1)  # [k, H]
            penalty = (h @ st.context[: st.length].T).amax(dim=-1)  # [k] closest earlier token, by cosine
            score = (1.0 - alpha) * st.probs - alpha * penalty
            # A candidate of probability 0 (fewer allowed tokens than top_k: a grammar, a ban) is never picked.
            picks.append(score.masked_fill(st.probs <= 0, float("-inf")).argmax())
        for f, best in zip(fed, torch.stack(picks).tolist()):
            st = f.seq.search
            f.chosen = best
            _append(st, torch.nn.functional.normalize(final[f.tok + best : f.tok + best + 1].float(), dim=-1))
            st.next_logits, st.probs = logits[f.row + best], None


def _append(st: SearchState, rows: torch.Tensor) -> None:
    """Add ``[n, H]`` rows to the context, doubling its storage when full (amortised O(n) a step, not a
    copy of the whole context)."""
    end = st.length + rows.shape[0]
    if st.context is None or end > st.context.shape[0]:
        grown = rows.new_empty((max(end, 2 * st.length, 64), rows.shape[1]))
        if st.length:
            grown[: st.length] = st.context[: st.length]
        st.context = grown
    st.context[st.length : end] = rows
    st.length = end
