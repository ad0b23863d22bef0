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
    one wait for the device where a ``tolist()`` apiece waits once each. The values travel as float64,
    exact for every float32, bfloat16 and float16 value and for integers up to 2**53."""
    if not tensors:
        return []
    flat = torch.cat([t.reshape(-1).to(torch.float64) for t in tensors]).tolist()
    out, at = [], 0
    for t in tensors:
        values = flat[at : at + t.numel()]
        at += t.numel()
        if t.dtype == torch.bool:
            values = [v != 0.0 for v in values]
        elif not t.dtype.is_floating_point:
            values = [int(v) for v in values]
        out.append(_nest(values, tuple(t.shape)))
    return out


def _nest(values: list, shape: tuple[int, ...]):
    if not shape:
        return values[0]
    if len(shape) == 1:
        return values
    step = len(values) // shape[0] if shape[0] else 0
    return [_nest(values[i * step : (i + 1) * step], shape[1:]) for i in range(shape[0])]
