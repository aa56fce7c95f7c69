"""Limits on what one HTTP client can make the server hold: body size, and how long it may
take to send its headers and its body (a slow-loris client must not keep a connection, a
task and a buffer forever).

- `BodyGuard` (ASGI middleware) reads the whole request body before the app sees it:
  a Content-Length above --max-payload-size is refused with 413 before one byte of the body
  is read, a chunked body as soon as it passes the limit; a body not complete within
  --http-body-timeout seconds gets 408. Both close the connection. The app then receives
  the buffered body, and later receive() calls go to the server (disconnect detection).
- `header_timeout_protocol()` is uvicorn's h11 protocol with a deadline for the request line
  and headers (uvicorn has none): from the connection's start or the first byte of the next
  request, --http-header-timeout seconds; past it the connection is closed. Header size is
  bounded by h11 itself (uvicorn's h11_max_incomplete_event_size, 16 KiB by default).
"""
from __future__ import annotations

import asyncio
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixlm.srt.http_utils import error_response


class BodyGuard:
    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(scope, receive, send, 413)
            return
        chunks: list[bytes] = []
        size = 0
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                await self._refuse(scope, receive, send, 408)
                return
            if message["type"] == "http.disconnect":
                return  # the client is gone before its request was complete: nothing to do
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(scope, receive, send, 413)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, status: int) -> None:
        if status == 413:
            message = (f"the request body is larger than {self.max_bytes} bytes "
                       "(server flag --max-payload-size)")
        else:
            message = f"the request body was not received within {self.timeout_s:g} s"
        response = error_response(message, status)
        response.headers["connection"] = "close"  # the rest of the body is never read
        await response(scope, receive, send)


def header_timeout_protocol(timeout_s: float):
    """uvicorn's H11Protocol with a deadline on receiving each request's headers."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and self.conn.their_state is h11.IDLE:
                self._arm()  # first byte of a new request on a kept-alive connection
            super().data_received(data)
            if self.conn.their_state is not h11.IDLE:
                self._disarm()  # the headers are in

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(timeout_s, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.logger.info("closing a connection that did not send its headers within %g s", timeout_s)
                self.transport.close()

    return HeaderTimeoutH11Protocol
