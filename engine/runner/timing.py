"""Timing device work without waiting for it: what the speculative controller's cost model learns from.

A step's forwards are timed for the cost model (engine/speculative/controller.py). Waiting for the
device after each one to read a clock would add a host sync per forward; on a GPU, a :class:`Lap`
records CUDA events around the work instead and is read once the host has waited for the device
anyway (the accepted tokens' transfer, a draft's tokens going to the host), so that reading it waits
for nothing. Events measure from the moment the device reaches the first to the moment it finishes
the work before the second: launch time while the device idles counts, as a wall clock would count
it. On a CPU the work is done when the call returns, and a lap is a wall clock.
"""

from __future__ import annotations

import time

import torch


class Lap:
    """One stretch of device work: :meth:`stop` after launching it, :attr:`seconds` after a sync."""

    __slots__ = ("_start", "_end", "_t0", "_seconds")

    def __init__(self, device: torch.device) -> None:
        self._end = None
        self._seconds: float | None = None
        if device.type == "cuda":
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = None
            self._t0 = time.perf_counter()

    def stop(self) -> Lap:
        if self._start is None:
            self._seconds = time.perf_counter() - self._t0
        else:
            self._end = torch.cuda.Event(enable_timing=True)
            self._end.record()
        return self

    @property
    def seconds(self) -> float:
        if self._seconds is None:
            if self._end is None:
                raise RuntimeError("a lap is read after stop()")
            self._end.synchronize()  # done already where the host has waited since: no wait then
            self._seconds = self._start.elapsed_time(self._end) / 1e3
        return self._seconds
