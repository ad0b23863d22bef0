"""A sequence's block table: a list of KV block ids that remembers where it last changed.

The model runner keeps every running sequence's table as a row of one array from forward to forward
(``engine.attention.common.PersistentBlockTables``) and rewrites only what changed in it. The table
tells it what that is: ``version`` counts its changes, and ``changes`` holds the lowest index each of
the latest ``HISTORY`` touched. Changes are almost always at the tail (blocks appended as a sequence
grows, released after rejected drafts, a copy-on-write of the block being written), so a mirror that
is a few versions behind rewrites a few entries; one further behind rewrites its whole row.

Every way a list can change goes through the overrides below, so nothing needs to remember to mark it.
"""

from __future__ import annotations

from collections import deque

HISTORY = 16


class BlockTable(list):
    __slots__ = ("version", "changes")

    def __init__(self, blocks=()) -> None:
        super().__init__(blocks)
        self.version = 0
        self.changes: deque[int] = deque(maxlen=HISTORY)

    def changed_since(self, version: int) -> int | None:
        """The lowest index changed after ``version`` (None: nothing changed); 0 when that is too far back
        to know."""
        behind = self.version - version
        if behind <= 0:
            return None
        if behind > len(self.changes):
            return 0
        return min(self.changes[i] for i in range(len(self.changes) - behind, len(self.changes)))

    def _changed(self, index: int) -> None:
        self.version += 1
        self.changes.append(max(index, 0))

    def _index(self, key) -> int:
        """The lowest index an item or slice key reaches (before the change)."""
        if isinstance(key, slice):
            return min(range(len(self))[key], default=len(self))
        return key + len(self) if key < 0 else key

    def append(self, block) -> None:
        super().append(block)
        self._changed(len(self) - 1)

    def extend(self, blocks) -> None:
        start = len(self)
        super().extend(blocks)
        if len(self) > start:
            self._changed(start)

    def __iadd__(self, blocks):
        self.extend(blocks)
        return self

    def insert(self, index, block) -> None:
        low = min(self._index(index), len(self))
        super().insert(index, block)
        self._changed(low)

    def __setitem__(self, key, value) -> None:
        low = self._index(key)
        super().__setitem__(key, value)
        self._changed(low)

    def __delitem__(self, key) -> None:
        low = self._index(key)
        super().__delitem__(key)
        self._changed(low)

    def pop(self, index=-1):
        low = self._index(index)
        block = super().pop(index)
        self._changed(low)
        return block

    def remove(self, block) -> None:
        low = self.index(block)
        super().remove(block)
        self._changed(low)

    def clear(self) -> None:
        super().clear()
        self._changed(0)

    def __imul__(self, n):
        super().__imul__(n)
        self._changed(0)
        return self

    def sort(self, *args, **kwargs) -> None:
        super().sort(*args, **kwargs)
        self._changed(0)

    def reverse(self) -> None:
        super().reverse()
        self._changed(0)

    def __reduce__(self):  # pickled (a copy crossing a process): a fresh table with the same blocks
        return (BlockTable, (list(self),))
