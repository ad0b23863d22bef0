"""What the attention backends share (kept apart from the package's interface, which imports them)."""

from __future__ import annotations

import numpy as np
import torch

from engine.platform import triton_interpreted  # noqa: F401  (the attention backends' callers read it here)


def optional_inputs(sinks: torch.Tensor | None, kv_scales: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The attention ops' optional tensors, named only where given (a call without them stays the call
    every compiled forward of a model without sinks or FP8 scales was traced with)."""
    given = {"sinks": sinks, "kv_scales": kv_scales}
    return {name: t for name, t in given.items() if t is not None}


def padded_block_tables(block_tables: list[list[int]], kv_lens: list[int], block_size: int) -> list[list[int]]:
    """Every sequence's block table cut or padded (with block 0, never read) to the blocks the longest
    ``kv_lens`` needs: the rows of one ``[B, max_blocks]`` tensor."""
    n = -(-max(kv_lens) // block_size)
    return [bt[:n] + [0] * (n - min(len(bt), n)) for bt in block_tables]


class PersistentBlockTables:
    """:func:`padded_block_tables` as a numpy ``[B, max_blocks]`` int32 array, from rows kept between
    forwards: each block table seen gets a row of one persistent array, rewritten only from the
    lowest index that changed since (a table that says where it changed: ``BlockTable``), so a step
    copies the rows it needs instead of converting every table from a Python list. Plain lists (a
    captured graph's padding sequences, tables built by hand) are converted each time.

    A row holds its table (so its ``id`` stays its own) until the table goes unused for ``ttl``
    forwards; entries past a table's length are zero, as padding is."""

    def __init__(self, ttl: int = 256) -> None:
        self.ttl = ttl
        self.array = np.zeros((16, 16), dtype=np.int32)
        self.entries: dict[int, list] = {}  # id(table) → [table, row, version seen, length written, last use]
        self.free_rows = list(range(15, -1, -1))
        self.uses = 0

    def rows(self, block_tables: list[list[int]], kv_lens: list[int], block_size: int) -> np.ndarray:
        n = -(-max(kv_lens) // block_size)
        self.uses += 1
        if self.uses % self.ttl == 0:
            self._sweep()
        rows, plain = [], []
        for j, bt in enumerate(block_tables):
            if not hasattr(bt, "changed_since"):
                plain.append(j)
                rows.append(0)
                continue
            rows.append(self._row(bt))
        if n > self.array.shape[1]:
            self._grow(self.array.shape[0], n)
        out = self.array[rows, :n]
        if plain:
            out[plain] = padded_block_tables([block_tables[j] for j in plain], [n * block_size], block_size)
        return out

    def _row(self, bt) -> int:
        entry = self.entries.get(id(bt))
        if entry is None or entry[0] is not bt:
            if not self.free_rows:
                self._grow(2 * self.array.shape[0], self.array.shape[1])
            row = self.free_rows.pop()
            entry = self.entries[id(bt)] = [bt, row, bt.version, 0, self.uses]
            low = 0
        else:
            entry[4] = self.uses
            low = bt.changed_since(entry[2])
            if low is None:
                return entry[1]
            entry[2] = bt.version
        row, written, length = entry[1], entry[3], len(bt)
        if length > self.array.shape[1]:
            self._grow(self.array.shape[0], 2 * length)
        if low < length:
            self.array[row, low:length] = bt[low:length]
        if written > length:
            self.array[row, length:written] = 0
        entry[3] = length
        return row

    def _grow(self, num_rows: int, num_cols: int) -> None:
        old = self.array
        self.array = np.zeros((max(num_rows, old.shape[0]), max(num_cols, old.shape[1])), dtype=np.int32)
        self.array[: old.shape[0], : old.shape[1]] = old
        self.free_rows.extend(range(self.array.shape[0] - 1, old.shape[0] - 1, -1))

    def _sweep(self) -> None:
        """Drop the rows of tables unused for ``ttl`` forwards (finished sequences') and zero them."""
        for key, (_, row, _, written, last) in list(self.entries.items()):
            if self.uses - last >= self.ttl:
                del self.entries[key]
                self.array[row, :written] = 0
                self.free_rows.append(row)
