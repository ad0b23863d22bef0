"""Lookahead decoding (``--speculative-method lookahead``; Fu et al., 2024): no draft model. Every
verify forward of a sequence also runs a *lookahead branch*, a Jacobi window of guesses at the tokens
ahead of it, and the trajectories the target's outputs trace through that window fill an n-gram pool;
the n-grams of the pool that start with the sequence's last token are verified in the same forward.

The window has ``N - 1`` levels of ``W`` columns. Column ``i`` of level ``l`` is a guess at the token
``l + i`` positions past the root (level 0's column 0 is the root itself, so level 0 feeds ``W - 1``
rows), and it attends to the context, the root, level 0's columns ``1 .. i`` and column ``i`` of the
levels ``1 .. l``: a run of consecutive positions, one Jacobi trajectory. The target's argmax at the
top level's column ``i`` guesses the next position of that trajectory, so each column yields an
``N``-gram: level 0's token (the root for column 0), the column's tokens upwards, and that output.
Then the levels shift down one (the oldest is dropped) and the outputs become the new top level,
whatever verification accepted; positions are always counted from the current root.

The window's rows ride in the verify forward as the proposer's :class:`ExtraRows` (after the tree's
rows; their KV slots are released after the step, so acceptance, preemption, prefix caching, forks
and beams are untouched). The tree is the trie of up to ``G`` pooled n-grams under the root token,
newest first, cut to the step's depth; its nodes are deterministic, so greedy verification keeps the
target's argmax path and sampled verification rejects against a one-hot draft (lossless).

The controller budgets the window like draft nodes: a depth ``d`` of ``D = min(N - 1, depth limit)``
asks for ``G * d`` tree slots and a window ``ceil(W * d / D)`` columns wide, so under load the window
narrows with the depth and at depth 0 there is none. The pool also takes every n-gram of the
sequence's own text (prompt and output) as it becomes final. It is bounded (``G`` n-grams a key,
``max_keys`` keys, least recently touched out) and freed with the sequence; ``--lookahead-shared``
keeps one pool per prompt family (requests whose prompts share their first 16 tokens), so a
second request with the same system prompt starts from what the first one found.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict

import numpy as np
import torch

from engine.attention.staging import take_rows
from engine.request.sequence import Sequence
from engine.sampling.tree import DraftTree
from engine.speculative.ngram_pool import NgramPool
from engine.speculative.proposer import CostShape, ExtraRows, ProposeContext, Proposer, VerifyRows

PROMPT_SEED_TOKENS = 1024  # the pool takes the n-grams of at most the prompt's last this many tokens


def window_rows(levels: int, width: int) -> int:
    """Rows a window of ``levels`` levels fed ``width`` columns wide adds to a forward."""
    return levels * width - 1 if width > 0 else 0


def window_layout(levels: int, width: int) -> tuple[list[tuple[int, int]], list[int], torch.Tensor]:
    """The fed cells ``(level, column)`` in row order (level 0 from column 1, then each level from
    column 0; the top level last), their offsets past the root, and the mask among them."""
    cells = [(0, i) for i in range(1, width)] + [(lv, i) for lv in range(1, levels) for i in range(width)]
    index = {cell: r for r, cell in enumerate(cells)}
    mask = torch.zeros(len(cells), len(cells), dtype=torch.bool)
    for r, (lv, i) in enumerate(cells):
        for j in range(1, i + 1):  # level 0 up to its own column: the trajectory's start
            mask[r, index[(0, j)]] = True
        for up in range(1, lv + 1):  # its own column, level 1 up to itself
            mask[r, index[(up, i)]] = True
    return cells, [lv + i for lv, i in cells], mask


class _Window:
    """One sequence's Jacobi window: ``levels[l, i]`` guesses the token ``l + i`` past the root."""

    def __init__(self, levels: np.ndarray) -> None:
        self.levels = levels  # [N - 1, W] int64 (level 0's column 0 is never fed: it is the root)
        # consecutive forwards each column was fed in: its column holds a trajectory from N - 2 on
        self.fed = np.zeros(levels.shape[1], dtype=np.int64)
        self.depth = 0  # the depth the controller planned for its last draft
        self.pos = 0  # text of the sequence already in the pool (its own n-grams)
        self.root = -1  # the token its last rows were fed after (column 0's key)


class LookaheadProposer(Proposer):
    method = "lookahead"
    cost = CostShape(kind=None)  # its rows are target rows: the controller prices them through slots_needed

    def __init__(
        self,
        window: int,
        ngram: int,
        guesses: int,
        max_depth: int,
        shared: bool = False,
        max_keys: int = 1024,
        family_tokens: int = 16,
    ) -> None:
        if window < 1 or ngram < 3 or guesses < 1:
            raise ValueError(f"lookahead needs W >= 1, N >= 3 and G >= 1, got {window}, {ngram}, {guesses}")
        self.W, self.N, self.G = window, ngram, guesses
        self.D = max(min(max_depth, ngram - 1), 1)  # the deepest draft: an n-gram after its key
        self.max_keys, self.family_tokens = max_keys, family_tokens
        self.shared = shared
        self._windows: dict[int, _Window] = {}
        self._pools: dict[int, NgramPool] = {}  # seq_id → its pool (shared: the family's pool object)
        self._families: OrderedDict[tuple, NgramPool] = OrderedDict()  # shared pools by namespace and family, LRU
        self._layouts: dict[int, tuple[list[tuple[int, int]], list[int], torch.Tensor]] = {}
        self._rng = random.Random(0)
        self.num_window_grams = 0  # n-grams the window's trajectories gave the pools

    @classmethod
    def build(cls, config, target, *, tokenizer, eos_token_ids) -> LookaheadProposer:
        # On a CPU every row of the forward costs matmul time: the narrowest window measured fastest.
        wide = 4 if target.device.type == "cuda" else 2
        return cls(
            config.lookahead_window or wide,
            config.lookahead_ngram,
            config.lookahead_guesses or wide,
            config.num_speculative_tokens,
            shared=config.lookahead_shared,
        )

    # -- shape ----------------------------------------------------------------------------------
    def width(self, depth: int) -> int:
        """Window columns at draft depth ``depth``: the full window at the deepest draft."""
        return 0 if depth <= 0 else math.ceil(self.W * min(depth, self.D) / self.D)

    def slots_needed(self, depth: int, greedy: bool = True) -> int:
        if depth <= 0:
            return 0
        depth = min(depth, self.D)
        return self.G * depth + window_rows(self.N - 1, self.width(depth))

    def deepest(self, configured: int) -> int:
        return min(configured, self.D)

    def depth_for_slots(self, slots: int, depth: int, greedy: bool, route: str | None = None) -> int:
        return super().depth_for_slots(slots, min(depth, self.D), greedy, route)

    def _layout(self, width: int):
        if width not in self._layouts:
            self._layouts[width] = window_layout(self.N - 1, width)
        return self._layouts[width]

    # -- drafting -------------------------------------------------------------------------------
    def _pool(self, seq: Sequence) -> NgramPool:
        pool = self._pools.get(seq.seq_id)
        if pool is None:
            if self.shared:
                # (one adapter's or API key's text never reaches another's requests)
                family = (seq.draft_namespace, tuple(seq.token_ids[: min(self.family_tokens, seq.num_prompt_tokens)]))
                pool = self._families.get(family)
                if pool is None:
                    if len(self._families) >= 64:
                        self._families.popitem(last=False)
                    pool = self._families[family] = NgramPool(self.N, self.G, self.max_keys)
                self._families.move_to_end(family)
            else:
                pool = NgramPool(self.N, self.G, self.max_keys)
            self._pools[seq.seq_id] = pool
        return pool

    def forget_adapter(self, name: str) -> None:
        # (a running request keeps its pool object until it ends; no new request joins it)
        for key in [k for k in self._families if k[0][0] == name]:  # ((adapter, API key), prompt head)
            del self._families[key]

    def _window(self, seq: Sequence) -> _Window:
        win = self._windows.get(seq.seq_id)
        if win is None:  # guesses drawn from the prompt: tokens of the text are likelier than noise
            prompt = seq.prompt_ids
            levels = np.array([self._rng.choice(prompt) for _ in range((self.N - 1) * self.W)], dtype=np.int64)
            win = self._windows[seq.seq_id] = _Window(levels.reshape(self.N - 1, self.W))
            win.pos = max(len(seq.token_ids) - PROMPT_SEED_TOKENS, 0)
        return win

    def _learn_text(self, seq: Sequence) -> None:
        win = self._window(seq)
        win.pos = self._pool(seq).add_text(seq.token_ids, win.pos)

    def propose(self, seqs: list[Sequence], depths: list[int], ctx: ProposeContext) -> list[DraftTree]:
        trees = []
        for seq, depth in zip(seqs, depths):
            self._learn_text(seq)
            self._windows[seq.seq_id].depth = depth
            trees.append(self._pool(seq).tree(seq.token_ids[-1], min(depth, self.D), self.G))
        return trees

    def extra_rows(self, seq: Sequence, tree: DraftTree, slots: int) -> ExtraRows | None:
        win = self._window(seq)
        # What the controller priced, in the slots the tree left ((N - 1) * width - 1 rows).
        width = min(self.width(win.depth), (slots + 1) // (self.N - 1))
        if width <= 0:
            return None
        win.root = seq.token_ids[-1]
        cells, offsets, mask = self._layout(width)
        tokens = [int(win.levels[lv, i]) for lv, i in cells]
        return ExtraRows(tokens, offsets, mask)

    def on_verify_logits(self, rows: list[VerifyRows], logits: torch.Tensor) -> None:
        # The top level is each window's last ``width`` rows: one gather and one transfer for all.
        widths = [(len(r.extra) + 1) // (self.N - 1) for r in rows]
        ends = [r.extra_row + len(r.extra) for r in rows]
        top = [r for end, w in zip(ends, widths) for r in range(end - w, end)]
        guesses = take_rows(logits, top).argmax(-1).tolist()
        at = 0
        for r, width in zip(rows, widths):
            seq = r.seq
            win = self._windows.get(seq.seq_id)
            new = guesses[at : at + width]
            at += width
            if win is None:
                continue
            lv, fed = win.levels, win.fed
            pool = self._pool(seq)
            for i in range(width):
                if fed[i] >= self.N - 2:  # the column traced a trajectory through every level: its n-gram
                    pool.add(win.root if i == 0 else int(lv[0, i]), tuple(int(t) for t in lv[1:, i]) + (new[i],))
                    self.num_window_grams += 1
            lv[:-1] = lv[1:].copy()  # the levels move down one; the outputs are the new top level
            lv[-1, :width] = new
            fed[:width] += 1
            fed[width:] = 0  # a column left out has lost its trajectory

    # -- lifecycle ------------------------------------------------------------------------------
    def on_fork(self, parent: Sequence, child: Sequence) -> None:
        win = self._windows.get(parent.seq_id)
        if win is not None:
            twin = self._windows[child.seq_id] = _Window(win.levels.copy())
            twin.fed, twin.pos = win.fed.copy(), win.pos
        pool = self._pools.get(parent.seq_id)
        if pool is not None:
            self._pools[child.seq_id] = pool if self.shared else pool.copy()

    def on_free(self, seq: Sequence) -> None:
        self._windows.pop(seq.seq_id, None)
        self._pools.pop(seq.seq_id, None)
