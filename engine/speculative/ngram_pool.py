"""A bounded pool of n-grams by their first token, newest first: lookahead decoding's n-grams and
Ouroboros's phrases (``engine/speculative/methods/``)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from itertools import islice

from engine.sampling.tree import DraftTree


class NgramPool:
    """N-grams by their first token: for each key the ``per_key`` most recently seen continuations
    (the ``n - 1`` tokens after it), for at most ``max_keys`` keys (the least recently touched go first)."""

    def __init__(self, n: int, per_key: int, max_keys: int) -> None:
        self.n, self.per_key, self.max_keys = n, per_key, max_keys
        # key (a token, or any hashable context) → its continuations, oldest first
        self.grams: OrderedDict[Hashable, OrderedDict[tuple[int, ...], None]] = OrderedDict()

    def add(self, key: Hashable, gram: tuple[int, ...]) -> None:
        known = self.grams.get(key)
        if known is None:
            if len(self.grams) >= self.max_keys:
                self.grams.popitem(last=False)
            known = self.grams[key] = OrderedDict()
        else:
            self.grams.move_to_end(key)
        if gram in known:
            known.move_to_end(gram)  # seen again: the newest
            return
        if len(known) >= self.per_key:
            known.popitem(last=False)
        known[gram] = None

    def add_text(self, tokens: list[int], start: int) -> int:
        """Every n-gram of ``tokens`` whose first token is at ``start`` or later; returns the first
        start not taken yet (its n-gram needs tokens still to come)."""
        end = len(tokens) - self.n + 1
        for i in range(start, end):
            self.add(tokens[i], tuple(tokens[i + 1 : i + self.n]))
        return max(start, end)

    def newest(self, key: Hashable) -> tuple[int, ...] | None:
        """The continuation of ``key`` seen last (None: none)."""
        known = self.grams.get(key)
        return next(reversed(known)) if known else None

    def tree(self, key: Hashable, depth: int, limit: int) -> DraftTree:
        """The trie of the ``limit`` newest n-grams under ``key``, cut to ``depth`` levels; siblings
        newest first (the order verification tries them in)."""
        known = self.grams.get(key)
        if not known or depth <= 0:
            return DraftTree()
        tokens, parents, nodes = [], [], {}
        for gram in islice(reversed(known), limit):
            parent = -1
            for t in gram[:depth]:
                node = nodes.get((parent, t))
                if node is None:
                    node = nodes[(parent, t)] = len(tokens)
                    tokens.append(t)
                    parents.append(parent)
                parent = node
        return DraftTree(tokens, parents)

    def copy(self) -> NgramPool:
        other = NgramPool(self.n, self.per_key, self.max_keys)
        other.grams = OrderedDict((k, OrderedDict(v)) for k, v in self.grams.items())
        return other
