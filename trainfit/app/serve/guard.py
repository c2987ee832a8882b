"""`trainfit serve`'s guards against slow, oversized, malformed and too many clients (limits.py says what).

Two places, because the ASGI app only sees a request once its head has arrived:

- `guarded_protocol(limits)`: uvicorn's HTTP protocol class, subclassed. It refuses a connection over
  --max-connections, and times each request's head from its first byte (a slowloris client sending
  its headers a byte at a time is answered 408 and closed), refuses a head over 64 KiB (431) and answers a
  request line or header the parser rejects with a JSON 400 instead of uvicorn's text.
- `BodyGuard`: ASGI middleware that reads the whole body before the app runs, within --read-timeout-s
  (408) and --max-body-mb (413, from Content-Length before reading when it is declared), refusing a
  Content-Length that is not one number (400). The app then sees the body at once.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Optional

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from trainfit.app.serve.limits import ServeLimits, error_body, raw_response, retry_after

DRAIN_LIMIT_BYTES = 64 * 1024 * 1024   # an oversized body up to this is read and dropped so the 413 arrives


def guarded_protocol(limits: ServeLimits) -> type:
    """uvicorn's HTTP protocol (httptools or h11, whichever uvicorn picks) with the head guards."""

    class Guarded(AutoHTTPProtocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head, self._tail, self._timer = 0, b"", None
            if len(self.connections) > limits.max_connections:
                self._refuse(503, f"the server has {limits.max_connections} connections open, its limit "
                                  "(--max-connections); retry later.", "server_overloaded",
                             {"Retry-After": str(retry_after(1))}, retry_after=retry_after(1))
                return
            self._reading_head()

        def _reading_head(self) -> None:
            self._head, self._tail = 0, b""
            self._timer = self.loop.call_later(limits.read_timeout_s, self._head_timed_out)

        def _head_timed_out(self) -> None:
            self._timer = None
            self._refuse(408, f"the request's head did not arrive within {limits.read_timeout_s:g} s "
                              "(--read-timeout-s).", "timeout")

        def data_received(self, data: bytes) -> None:
            if self._timer is None and self._head < 0:     # the next request on a kept-alive connection
                self._reading_head()
            if self._timer is not None:
                end = (self._tail + data).find(b"\r\n\r\n")
                self._head += len(data) if end < 0 else end - len(self._tail)
                if self._head > limits.max_head_bytes:
                    self._refuse(431, f"the request's head is over {limits.max_head_bytes} bytes.")
                    return
                if end < 0:
                    self._tail = (self._tail + data)[-3:]
                else:                                       # the head is in: the body is BodyGuard's
                    self._timer.cancel()
                    self._timer, self._head = None, 0
            super().data_received(data)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._head = -1    # the next byte starts a new head

        def connection_lost(self, exc) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            self._refuse(400, f"malformed HTTP request: {msg}")

        def _refuse(self, status: int, message: str, type_: str = "invalid_request_error",
                    headers: Optional[dict] = None, **extra) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            if not self.transport.is_closing():
                self.transport.write(raw_response(status, error_body(status, message, type_, **extra), headers))
                self.transport.close()

    return Guarded


class BodyGuard:
    """ASGI middleware: the whole body read within the limits before the app runs (see the module docstring)."""

    def __init__(self, app, limits: ServeLimits):
        self.app, self.limits = app, limits

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        lengths = {v.strip() for k, v in scope["headers"] if k == b"content-length"}
        chunked = any(k == b"transfer-encoding" for k, _ in scope["headers"])
        waits = any(k == b"expect" for k, _ in scope["headers"])   # 100-continue: the body comes only if asked
        if len(lengths) > 1 or (lengths and not next(iter(lengths)).isdigit()):
            return await _answer(send, 400, "Content-Length must be one number.")
        declared = int(next(iter(lengths))) if lengths else None
        if declared is None and not chunked:
            return await self.app(scope, receive, send)
        limit = self.limits.max_body_bytes
        too_big = f"the body is over {limit} bytes (--max-body-mb)."
        if declared is not None and declared > limit:
            if declared <= DRAIN_LIMIT_BYTES and not waits:   # read and drop it, so the client reads the 413
                await self._read(receive, DRAIN_LIMIT_BYTES, keep=False)
            return await _answer(send, 413, too_big)
        body = await self._read(receive, limit)
        if body is None:
            return await _answer(send, 408, f"the request's body did not arrive within {self.limits.read_timeout_s:g} "
                                            "s (--read-timeout-s).", "timeout")
        if body is False:
            return await _answer(send, 413, too_big)
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()          # then the client's disconnect, as the app expects
        await self.app(scope, replay, send)

    async def _read(self, receive, limit: int, keep: bool = True):
        """The body (bytes); None when it does not arrive in time; False when it passes `limit`."""
        chunks, size = [], 0
        deadline = time.monotonic() + self.limits.read_timeout_s
        while True:
            try:
                msg = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                return None
            if msg["type"] == "http.disconnect":
                return None
            size += len(msg.get("body", b""))
            if size > limit:
                return False
            if keep:
                chunks.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                return b"".join(chunks)


async def _answer(send, status: int, message: str, type_: str = "invalid_request_error") -> None:
    data = json.dumps(error_body(status, message, type_)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": data})
