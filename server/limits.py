"""What one client may cost the HTTP front, bounded before any handler runs.

- :class:`BodyLimits` (ASGI middleware): a request body larger than ``max_bytes`` gets 413 (from its
  ``Content-Length`` at once, or as soon as a chunked body passes the bound), and one that does not
  arrive within ``timeout_s`` gets 408. The body is read here, then replayed to the app; what the
  client sends afterwards (its disconnect) still reaches the app.
- :class:`HeaderTimeoutH11` (uvicorn protocol): a connection that opens, or starts a new request,
  and does not finish sending the request's headers within ``header_timeout_s`` is closed (a client
  dribbling headers byte by byte would otherwise hold a connection forever).
- :func:`uvicorn_config`: uvicorn's own limits (keep-alive, concurrent connections) with those.
"""

from __future__ import annotations

import asyncio

import uvicorn
from fastapi.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from server.protocol import error_body


class BodyLimits:
    def __init__(self, app, max_bytes: int, timeout_s: float) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        chunks, size, more = [], 0, True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                body = error_body(f"the request body did not arrive within {self.timeout_s:g} s", "timeout_error")
                await JSONResponse(body, 408, headers={"Connection": "close"})(scope, receive, send)
                return
            if message["type"] == "http.disconnect":
                return  # gone before it finished sending: nothing to answer
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            more = message.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send) -> None:
        message = f"the request body exceeds the server's limit of {self.max_bytes} bytes (--max-request-bytes)"
        body = error_body(message, "invalid_request_error", code="request_too_large")
        await JSONResponse(body, 413, headers={"Connection": "close"})(scope, receive, send)


class HeaderTimeoutH11(H11Protocol):
    header_timeout_s: float = 10.0
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._between_requests():
            self._arm()  # bytes of a new request: its headers must all arrive in time
        super().data_received(data)
        if not self._between_requests():
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expired(self) -> None:
        self._header_timer = None
        if self._between_requests() and not self.transport.is_closing():
            self.transport.close()


def uvicorn_config(
    app,
    host: str,
    port: int,
    log_level: str = "info",
    header_timeout_s: float = 10.0,
    timeout_keep_alive_s: float = 5.0,
    limit_concurrency: int | None = 1024,
) -> uvicorn.Config:
    protocol = type("HeaderTimeoutH11", (HeaderTimeoutH11,), {"header_timeout_s": header_timeout_s})
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=protocol,
        timeout_keep_alive=timeout_keep_alive_s,
        limit_concurrency=limit_concurrency,
    )
