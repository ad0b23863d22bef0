"""The target's hidden features a drafter has not consumed yet: an EAGLE head's and a DFlash drafter's
catch-up input.

Each target forward hands a drafter the features of the tokens it made final (``Proposer.on_computed``:
per sequence, rows ``start .. start + n``); they wait here, on the device, until the drafter's next
catch-up feeds them into its own cache. At most ``max_rows`` wait per sequence: one that does not
draft for a long time (under load) keeps its newest rows only, and its drafter's older rows stay as
they were (acceptance may drop a little; the output cannot change).
"""

from __future__ import annotations

import torch


class PendingFeatures:
    def __init__(self, max_rows: int = 1024) -> None:
        self.max_rows = max_rows
        self._rows: dict[int, tuple[int, list[torch.Tensor]]] = {}  # seq_id → (first row, [n, F] parts)

    def add(self, seq_id: int, start: int, rows: torch.Tensor) -> None:
        """Rows ``start ..`` of ``seq_id`` (``[n, F]``), after the ones waiting."""
        first, parts = self._rows.get(seq_id, (start, []))
        parts.append(rows)
        total = sum(len(p) for p in parts)
        if total > self.max_rows:
            parts = [torch.cat(parts)[total - self.max_rows :]]
            first += total - self.max_rows
        self._rows[seq_id] = (first, parts)

    def first(self, seq_id: int, default: int) -> int:
        """The first row still waiting (``default`` when none is)."""
        return self._rows.get(seq_id, (default, []))[0]

    def take(self, seq_id: int, start: int, n: int, who: str) -> torch.Tensor:
        """Rows ``start .. start + n`` ``[n, F]``; those before them are dropped, those after keep waiting.
        A RuntimeError naming ``who`` if any of them is missing."""
        first, parts = self._rows.get(seq_id, (start, []))
        rows = parts[0] if len(parts) == 1 else torch.cat(parts) if parts else None
        if rows is None or first > start or first + len(rows) < start + n:
            raise RuntimeError(f"{who}: target features of rows {start}..{start + n} of {seq_id} are missing")
        taken, rest = rows[start - first : start - first + n], rows[start - first + n :]
        self._rows[seq_id] = (start + n, [rest] if len(rest) else [])
        return taken

    def fork(self, parent: int, child: int) -> None:
        if parent in self._rows:
            first, parts = self._rows[parent]
            self._rows[child] = (first, list(parts))

    def drop(self, seq_id: int) -> None:
        self._rows.pop(seq_id, None)
