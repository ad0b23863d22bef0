"""Suffix decoding (``--speculative-method suffix``): draft a *tree* from what followed the current
context elsewhere — earlier in the request's own prompt and output, and in a bounded store of the
outputs of finished requests.

Both sources are kept as next-token counts of every context of 1 .. ``order`` tokens
(:class:`ContextCounts`, the counting face of a suffix tree cut at depth ``order``). To draft, the
longest suffix of the sequence that either source has seen is its *match*; the tree grows best-first
by the empirical probability of each path (counts of a continuation over counts of its context, the
context moving along the path), under the step's node budget, no deeper than twice the match length
(a long match predicts far, a short one barely), and never through a continuation less likely than
``min_prob``. No model runs, so the proposer declares no cost.

The store (:class:`SuffixStore`) holds at most ``--suffix-cache-tokens`` tokens of finished outputs;
it forgets whole outputs, least recently produced first (an output produced again is refreshed, not
stored twice). Aborted and failed requests are not stored. There is one store per draft namespace
(:attr:`Sequence.draft_namespace`: a LoRA adapter and an API key): a request drafts only from the
outputs of requests of its own adapter and key, never another tenant's text or another adapter's
style. The ``--suffix-cache-tokens`` bound holds for all stores together: past it, whole stores are
forgotten, the least recently used first (and at most ``MAX_STORES`` are kept).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from engine.request.sequence import FinishReason, Sequence
from engine.sampling.tree import DraftTree
from engine.speculative.proposer import CostShape, ProposeContext, Proposer


class ContextCounts:
    """``table[context][token]``: how often ``token`` followed ``context`` (1 .. order tokens)."""

    def __init__(self, order: int) -> None:
        self.order = order
        self.table: dict[tuple[int, ...], dict[int, int]] = {}

    def add(self, tokens: list[int], start: int = 1, sign: int = 1) -> None:
        """Count the continuation at every position ``start ..`` of ``tokens`` (``sign`` -1 uncounts)."""
        for i in range(max(start, 1), len(tokens)):
            nxt = tokens[i]
            for n in range(1, min(self.order, i) + 1):
                ctx = tuple(tokens[i - n : i])
                counts = self.table.setdefault(ctx, {})
                c = counts.get(nxt, 0) + sign
                if c > 0:
                    counts[nxt] = c
                else:
                    counts.pop(nxt, None)
                    if not counts:
                        del self.table[ctx]

    def get(self, ctx: tuple[int, ...]) -> dict[int, int] | None:
        return self.table.get(ctx)


class SuffixStore:
    """Finished outputs, at most ``capacity`` tokens in all, with their context counts."""

    def __init__(self, capacity: int, order: int) -> None:
        self.capacity = capacity
        self.counts = ContextCounts(order)
        self.outputs: OrderedDict[tuple[int, ...], None] = OrderedDict()  # oldest first
        self.num_tokens = 0

    def add(self, tokens: list[int]) -> None:
        key = tuple(tokens[-self.capacity :]) if self.capacity else ()
        if len(key) < 2:
            return
        if key in self.outputs:  # produced again: fresh, not stored twice
            self.outputs.move_to_end(key)
            return
        while self.outputs and self.num_tokens + len(key) > self.capacity:
            old, _ = self.outputs.popitem(last=False)
            self.counts.add(list(old), sign=-1)
            self.num_tokens -= len(old)
        self.outputs[key] = None
        self.counts.add(list(key))
        self.num_tokens += len(key)


class _Request:
    """One sequence's own counts, extended as its tokens come."""

    def __init__(self, order: int) -> None:
        self.counts = ContextCounts(order)
        self.seen = 0

    def sync(self, tokens: list[int]) -> None:
        self.counts.add(tokens, start=self.seen)
        self.seen = len(tokens)


MAX_STORES = 64  # draft namespaces (adapter, API key) with a store of their own, least recently used out


class SuffixProposer(Proposer):
    method = "suffix"
    cost = CostShape(kind=None)

    def __init__(self, order: int, cache_tokens: int, budget: int, width: int, min_prob: float = 0.1) -> None:
        self.order, self.budget, self.width, self.min_prob = order, budget, width, min_prob
        self.cache_tokens = cache_tokens
        self.stores: OrderedDict[tuple, SuffixStore] = OrderedDict()  # by draft namespace
        self._requests: dict[int, _Request] = {}

    def store(self, seq: Sequence) -> SuffixStore:
        """The store of ``seq``'s draft namespace (made empty on first use)."""
        key = seq.draft_namespace
        store = self.stores.get(key)
        if store is None:
            if len(self.stores) >= MAX_STORES:
                self.stores.popitem(last=False)
            store = self.stores[key] = SuffixStore(self.cache_tokens, self.order)
        self.stores.move_to_end(key)
        return store

    @classmethod
    def build(cls, config, target, *, tokenizer, eos_token_ids) -> SuffixProposer:
        width = max(config.spec_tree_topk, 2)
        return cls(config.suffix_order, config.suffix_cache_tokens, config.spec_tree_budget, width)

    def slots_needed(self, depth: int, greedy: bool = True) -> int:
        return min(self.budget, max(depth, 0) * self.width)

    def propose(self, seqs: list[Sequence], depths: list[int], ctx: ProposeContext) -> list[DraftTree]:
        trees = []
        for seq, depth in zip(seqs, depths):
            req = self._requests.setdefault(seq.seq_id, _Request(self.order))
            req.sync(seq.token_ids)
            trees.append(self.draft(seq.token_ids, req.counts, depth, self.slots_needed(depth), self.store(seq)))
        return trees

    def _continuations(
        self, context: list[int], own: ContextCounts, store: SuffixStore
    ) -> tuple[dict[int, float], int]:
        """The next-token distribution after the longest suffix of ``context`` seen anywhere (the
        sequence itself, its namespace's ``store``), and that suffix's length (0: none seen)."""
        for n in range(min(self.order, len(context)), 0, -1):
            key = tuple(context[-n:])
            a, b = own.get(key), store.counts.get(key)
            if a or b:
                merged = dict(a or {})
                for t, c in (b or {}).items():
                    merged[t] = merged.get(t, 0) + c
                total = sum(merged.values())
                return {t: c / total for t, c in merged.items()}, n
        return {}, 0

    def draft(self, tokens: list[int], own: ContextCounts, depth: int, max_nodes: int, store: SuffixStore) -> DraftTree:
        """Best-first tree over the empirical continuation probabilities (see the module doc)."""
        tail = tokens[-self.order :]  # all a lookup ever reads
        dist, match = self._continuations(tail, own, store)
        depth = min(depth, 2 * match)
        out_tokens: list[int] = []
        parents: list[int] = []
        heap: list[tuple[float, int, int, int, int, list[int]]] = []  # (-score, tie, token, parent, depth, path)
        tie = 0

        def push(dist: dict[int, float], score: float, parent: int, level: int, path: list[int]) -> None:
            nonlocal tie
            for tok, p in sorted(dist.items(), key=lambda kv: -kv[1])[: self.width]:
                if p >= self.min_prob:
                    heapq.heappush(heap, (-score * p, tie, tok, parent, level, path))
                    tie += 1

        if depth > 0:
            push(dist, 1.0, -1, 1, [])
        while heap and len(out_tokens) < max_nodes:
            neg, _, tok, parent, level, path = heapq.heappop(heap)
            node = len(out_tokens)
            out_tokens.append(tok)
            parents.append(parent)
            if level < depth:
                nxt, _ = self._continuations(tail + path + [tok], own, store)
                push(nxt, -neg, node, level + 1, path + [tok])
        return DraftTree(out_tokens, parents)

    def forget_adapter(self, name: str) -> None:
        for key in [k for k in self.stores if k[0] == name]:  # (adapter, API key)
            del self.stores[key]

    def on_free(self, seq: Sequence) -> None:
        self._requests.pop(seq.seq_id, None)
        # A finished output has its reason set by now; an aborted or failed one has none yet (or ERROR).
        if seq.finish_reason not in (FinishReason.ABORT, FinishReason.ERROR, None):
            self.store(seq).add(seq.output_ids)  # (now the most recently used)
            while len(self.stores) > 1 and sum(st.num_tokens for st in self.stores.values()) > self.cache_tokens:
                self.stores.popitem(last=False)
