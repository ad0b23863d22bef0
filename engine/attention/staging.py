"""A forward's host-built inputs sent to the device in one copy, from pinned memory.

Each forward's inputs besides the weights are small arrays the host builds every step: token ids,
positions, the rows needing logits, and the attention metadata (slots, block tables, per-sequence
fields, masks). Sent one by one, each is a copy of its own from pageable memory: a driver call and a
staging copy apiece, seven or eight a forward. A :class:`Pack` collects a forward's arrays instead;
:meth:`Pack.send` writes them back to back into a pinned host ring (:class:`Staging`) and sends them
in one non-blocking copy into one device tensor, whose slices are the inputs.

Two hazards, both closed:

- *The ring's bytes are rewritten only after the copy that read them ran.* Each send records a CUDA
  event after its copy; a send that comes round to bytes still in flight waits for their event
  (normally long done: the ring holds many steps, and every step waits for the device once).
- *A batch prepared ahead of another keeps its inputs.* Each send copies into a tensor of its own from
  the device's caching allocator (stream-ordered, so a freed one is reused only after the work that
  read it), never into a shared buffer: drafting levels prepared together stay apart.

On a CPU the forward reads host memory: arrays are handed over as they are (``torch.from_numpy``, no
copy at all). ``Staging(device, copy=True)`` runs the ring on a CPU anyway: how the tests check it.
"""

from __future__ import annotations

import functools
import threading
from collections import deque

import numpy as np
import torch

_ALIGN = 16  # every array starts at a multiple of this many bytes (any dtype's view is aligned)
_TORCH_DTYPES = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.uint8): torch.uint8,
    np.dtype(np.bool_): torch.bool,
    np.dtype(np.float32): torch.float32,
}
_NP_DTYPES = {t: n for n, t in _TORCH_DTYPES.items()}


class Pack:
    """One forward's arrays: :meth:`add` each (its index back), :meth:`send` once, then ``pack[i]``."""

    __slots__ = ("staging", "arrays", "tensors")

    def __init__(self, staging: Staging) -> None:
        self.staging = staging
        self.arrays: list[np.ndarray] = []
        self.tensors: list[torch.Tensor] | None = None

    def add(self, array: np.ndarray) -> int:
        if self.tensors is not None:
            raise RuntimeError("this pack was sent already")
        a = np.ascontiguousarray(array)
        if a.dtype not in _TORCH_DTYPES:
            raise TypeError(f"no staging for arrays of {a.dtype}")
        self.arrays.append(a)
        return len(self.arrays) - 1

    def send(self) -> Pack:
        """Send every array added (again: nothing more; a later :meth:`add` is an error)."""
        if self.tensors is None:
            self.tensors = self.staging.send(self.arrays)
        return self

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.tensors is None:
            raise RuntimeError("a pack's tensors are read after send()")
        return self.tensors[i]


class Staging:
    """The pinned host ring a runner's forwards send their inputs through (see the module's text)."""

    def __init__(
        self, device: torch.device | str, capacity: int = 1 << 20, copy: bool | None = None, pin: bool = True
    ) -> None:
        self.device = torch.device(device)
        self.copy = self.device.type != "cpu" if copy is None else copy
        self.pinned = pin and self.copy and self.device.type == "cuda"
        self.host = torch.empty(0, dtype=torch.uint8)
        self._bytes = np.empty(0, dtype=np.uint8)
        self.cursor = 0
        self.in_flight: deque[tuple[int, int, torch.cuda.Event | None]] = deque()  # (start, end, copy done)
        self.num_copies = 0  # sends that copied: one a forward
        self._lock = threading.Lock()  # a compile view's thread may send beside the step's
        if self.copy:
            self._grow(capacity)

    def pack(self) -> Pack:
        return Pack(self)

    def send(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        if not self.copy:  # (an empty array's strides are 0 in numpy: a compiled forward guards on strides)
            empty = lambda a: torch.empty(a.shape, dtype=_TORCH_DTYPES[a.dtype])  # noqa: E731
            return [torch.from_numpy(a) if a.size else empty(a) for a in arrays]
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total)
            total += -(-a.nbytes // _ALIGN) * _ALIGN
        with self._lock:
            start = self._reserve(max(total, _ALIGN))
            for a, off in zip(arrays, offsets):
                if a.nbytes:
                    self._bytes[start + off : start + off + a.nbytes] = a.reshape(-1).view(np.uint8)
            dev = torch.empty(max(total, _ALIGN), dtype=torch.uint8, device=self.device)
            dev.copy_(self.host[start : start + dev.numel()], non_blocking=True)
            done = None
            if self.pinned:
                done = torch.cuda.Event()
                done.record()
                self.in_flight.append((start, start + dev.numel(), done))
            self.num_copies += 1
        typed: dict[np.dtype, torch.Tensor] = {}  # the copy seen as each dtype (one view a dtype, not an array)
        out = []
        for a, off in zip(arrays, offsets):
            whole = typed.get(a.dtype)
            if whole is None:
                whole = typed[a.dtype] = dev.view(_TORCH_DTYPES[a.dtype])
            k = off // a.itemsize
            t = whole[k : k + a.size]
            out.append(t if a.ndim == 1 else t.view(a.shape))
        return out

    def _reserve(self, n: int) -> int:
        """The ring's start for ``n`` bytes, once no copy in flight still reads them."""
        if n > self._bytes.size:
            self._drain()
            self._grow(max(n, 2 * self._bytes.size))
        if self.cursor + n > self._bytes.size:
            self.cursor = 0
        start, end = self.cursor, self.cursor + n
        live: deque = deque()
        for a, b, done in self.in_flight:
            if a < end and start < b:
                done.synchronize()
            elif not done.query():
                live.append((a, b, done))
        self.in_flight = live
        self.cursor = end
        return start

    def _drain(self) -> None:
        for *_, done in self.in_flight:
            done.synchronize()
        self.in_flight.clear()

    def _grow(self, n: int) -> None:
        self.host = torch.empty(n, dtype=torch.uint8, pin_memory=self.pinned)
        self._bytes = self.host.numpy()
        self.cursor = 0


def direct_pack(device: torch.device | str) -> Pack:
    """A pack for a caller without a runner's ring (tests, tools): one copy from pageable memory
    where the device is not the host (no pinned ring to allocate for one forward)."""
    return Staging(device, capacity=4096, pin=False).pack()


@functools.cache
def ring(device: torch.device) -> Staging:
    """The ring for the small lists the engine's loop sends between forwards (sampling metadata, rows
    to keep, drafting indices): one a device. A runner's forward inputs go through its own."""
    return Staging(device, capacity=1 << 16)


def to_device(values, device: torch.device | str, dtype: torch.dtype) -> torch.Tensor:
    """A host list (nested lists: rows of equal length) as a ``dtype`` tensor on ``device``, sent through
    :func:`ring`: ``torch.tensor(values, device=...)`` on a GPU is a copy from pageable memory that
    waits for the device, and indexing a device tensor with a list is the same copy."""
    (t,) = ring(torch.device(device)).send([np.asarray(values, dtype=_NP_DTYPES[dtype])])
    return t


def take_rows(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """``t[rows]`` without waiting for the device: all rows in order (a batch of decodes) are the tensor
    itself, others are gathered by an index sent through :func:`ring`."""
    if len(rows) == len(t) and all(r == i for i, r in enumerate(rows)):
        return t
    return t.index_select(0, to_device(rows, t.device, torch.int64))
