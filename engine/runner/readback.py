"""Device tokens read on the host later, waiting for the work that made them and nothing after; and
several device tensors read at once (:func:`to_host`).

A blocking ``tensor.tolist()`` on a GPU is a copy in stream order: issued after the next forward
was launched, it waits for that forward too. :meth:`Readback.start` instead copies the tokens at
once, without blocking, into a pinned host buffer and records an event behind the copy;
:meth:`Ticket.tolist` waits for that event alone. Two buffers alternate, so the tickets of two
forwards in flight (run-ahead decoding, engine/core/ahead.py) never share bytes. On a CPU the
tokens are final when the call returns and a ticket holds them as they are.
"""

from __future__ import annotations

import numpy as np
import torch


class Ticket:
    """One readback in flight: :meth:`tolist` once, after as much other work as the host has."""

    __slots__ = ("_host", "_event", "_tokens")

    def __init__(self, host: torch.Tensor | None, event, tokens: torch.Tensor | None) -> None:
        self._host, self._event, self._tokens = host, event, tokens

    def tolist(self) -> list[int]:
        if self._event is None:
            return self._tokens.tolist()
        self._event.synchronize()
        return self._host.tolist()


class Readback:
    def __init__(self, device: torch.device, capacity: int) -> None:
        self._buffers: list[torch.Tensor] = []
        if device.type == "cuda":
            self._buffers = [torch.empty(capacity, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self._next = 0

    def start(self, tokens: torch.Tensor) -> Ticket:  # tokens: [N] int64, on the device
        if not self._buffers:
            return Ticket(None, None, tokens)
        n = tokens.numel()
        if n > self._buffers[0].numel():  # more rows than sized for: a buffer of its own
            host = torch.empty(n, dtype=torch.int64, pin_memory=True)
        else:
            host = self._buffers[self._next][:n]
            self._next ^= 1
        host.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(tokens.device))  # the copy's stream (cuda:N is not current)
        return Ticket(host, event, None)


def to_host(*tensors: torch.Tensor) -> list:
    """Several device tensors read in one transfer, each as its own ``tensor.tolist()`` would give it:
    one wait for the device where a ``tolist()`` apiece waits once each. On a CPU nothing moves, and
    each tensor's own ``tolist()`` costs least."""
    if not tensors:
        return []
    if tensors[0].device.type == "cpu":
        return list(map(torch.Tensor.tolist, tensors))
    return in_one_copy(tensors)


def in_one_copy(tensors: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> list:
    """:func:`to_host`'s transfer: the values flattened into one float64 tensor (exact for every
    float32, bfloat16 and float16 value and for integers up to 2**53), copied once, then split and
    shaped on the host."""
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]).cpu().numpy()
    out, at = [], 0
    for t in tensors:
        piece = flat[at : at + t.numel()].reshape(tuple(t.shape))
        at += t.numel()
        if t.dtype == torch.bool:
            piece = piece != 0
        elif not t.dtype.is_floating_point:
            piece = piece.astype(np.int64)
        out.append(piece.tolist())
    return out
