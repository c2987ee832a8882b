"""The server side of trainfit's HTTP environment protocol (envs/http.py is the client), for a service
object with reset(row) / step(body) / close(body) / expert(body) / health() / close_idle() / authorised();
a method raises Refused(code, message) to answer an HTTP error.

    server = EnvServer(service, host="127.0.0.1", port=8080, key="s3cret")
    server.start()            # a thread; or server.serve_forever() in the foreground
    server.url                # http://127.0.0.1:8080
    server.stop()

Every POST needs `Authorization: Bearer <key>` when a key is set (401 otherwise); GET /health does not.
A body that is not a JSON object is answered 400 saying so; one over MAX_BODY_BYTES 413 naming the limit
(before any `100 Continue`); a Content-Length that is not a non-negative integer, or two that differ, 400;
a chunked body (Transfer-Encoding) 411: the protocol's bodies are small JSON objects whose length the
client knows; and a body slower than `read_timeout_s` 408. These close the connection (where the next
request starts is unknown); a body left unread is first drained, bounded in bytes and time, so the
client reads the answer instead of a reset. Every request gets an HTTP answer in JSON, the server's own
refusals included (a junk request line 400, an over-long header 431, another method 405 with `Allow`);
routes ignore a query string; an unexpected error in the service is answered 500 with its type and
logged as one line, never a traceback. Requests are served on threads (the service serialises what
must be); idle episodes are closed by a background sweep every few seconds.
"""

from __future__ import annotations

import json
import logging
import socket
import sys
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional
from urllib.parse import urlsplit

MAX_BODY_BYTES = 1 << 20   # actions are short texts; a larger body is a client bug
# What a refused request may still send after its answer, read and dropped before the socket closes:
# closing with unread bytes makes the kernel send a reset, which can destroy the answer before the
# client reads it (nginx's lingering close). Bounded: a client that keeps sending past these is cut off.
DRAIN_BYTES = 64 << 20
DRAIN_S = 2.0
ROUTES = {"/health": "GET", "/reset": "POST", "/step": "POST", "/close": "POST", "/expert": "POST"}
log = logging.getLogger(__name__)


class Refused(Exception):
    """A request the service answers with an HTTP error code and a message."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def _content_length(header: Optional[str]) -> Optional[int]:
    """The body's length, or None when the header is not a non-negative integer (`abc`, `-1`, `1e3`)."""
    text = (header or "0").strip()
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 12 else None


def _declared_length(headers) -> tuple[Optional[int], Optional[tuple[int, dict]]]:
    """(the body's length, None) or (None, the refusal) from a request's length headers."""
    if headers.get("Transfer-Encoding") is not None:
        return None, (411, {"error": "a body with Transfer-Encoding (chunked) is not read here; send it with a "
                                     "Content-Length (its size in bytes)."})
    values = {v.strip() for h in headers.get_all("Content-Length") or [] for v in h.split(",")}
    if len(values) > 1:   # which one frames the body is unknown: HTTP says 400 (RFC 9112 6.3)
        return None, (400, {"error": f"the request has {len(values)} different Content-Length values "
                                     f"({', '.join(sorted(values))[:60]}); send one."})
    header = values.pop() if values else None
    n = _content_length(header)
    if n is None:
        return None, (400, {"error": f"Content-Length must be a non-negative integer, got {header!r:.40}."})
    if n > MAX_BODY_BYTES:
        return None, (413, {"error": f"request body of {n} bytes is over the limit of {MAX_BODY_BYTES}."})
    return n, None


def _handler(service, key: Optional[str], read_timeout_s: float):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"   # keep-alive: httpx reuses connections
        # The socket timeout (StreamRequestHandler): a client that declares more body than it sends, or
        # idles on a kept-alive connection, frees its thread after this long.
        timeout = read_timeout_s

        def log_message(self, *args):   # the service logs nothing per request
            pass

        unread = False   # a refused request's body (or headers) may still be coming: drain before closing

        def handle(self):
            try:
                super().handle()
                if self.unread:
                    self.drain()
            except (BrokenPipeError, ConnectionResetError):
                # A client reset a kept-alive connection between requests (httpx closing its pool when an
                # environment closes): a normal end of a connection, not an error to print.
                pass

        def drain(self) -> None:
            """Half-close, then read and drop what the client still sends until it closes, DRAIN_BYTES or
            DRAIN_S: the answer is already on its way, and the socket's close resets nothing unread."""
            end, got = time.monotonic() + DRAIN_S, 0
            try:
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_WR)
                while got < DRAIN_BYTES and (left := end - time.monotonic()) > 0:
                    self.connection.settimeout(left)
                    chunk = self.rfile.read1(65536)
                    if not chunk:
                        return
                    got += len(chunk)
            except OSError:   # a timeout, or the client is gone: either way, done
                pass

        def refuse(self, code: int, body: dict, headers: tuple = ()) -> tuple:
            """An answer given without reading the request's body: the connection ends after it."""
            self.close_connection = self.unread = True
            return code, body, headers

        def send_error(self, code, message=None, explain=None):
            # The server's own refusals (a junk request line, an over-long header, a method it lacks) in
            # JSON like every other answer, not BaseHTTPRequestHandler's HTML page.
            if self.request_version == "HTTP/0.9":   # a junk line parses as 0.9, which has no status line
                self.request_version = "HTTP/1.0"
            try:
                phrase = HTTPStatus(code).phrase
            except ValueError:
                phrase = "Error"
            said = "; ".join(str(m) for m in (message, explain) if m)[:300]
            self.reply(*self.refuse(code, {"error": f"{phrase}: {said or 'refused'}."}))

        def reply(self, code: int, body: dict, headers: tuple = ()) -> None:
            data = json.dumps(body).encode()
            try:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in headers:
                    self.send_header(name, value)
                if self.close_connection:   # say so: the client opens a new connection for its next request
                    self.send_header("Connection", "close")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                # The client left (timed out, or the trainer stopped): the step is recorded and a retry
                # is answered from it (idempotent steps); nothing to print.
                self.close_connection = True
                self.unread = False

        def handle_expect_100(self):
            # `Expect: 100-continue`: a body that would be refused is refused before the client sends it.
            n, refusal = _declared_length(self.headers)
            if refusal is None:
                return super().handle_expect_100()
            self.reply(*self.refuse(*refusal))
            return False

        def do_GET(self):
            self.answer(self.get)

        def do_POST(self):
            self.answer(self.post)

        def not_allowed(self):
            self.answer(lambda: self.refuse(404, {"error": f"no route {self.command} {self.path:.200}; POST /reset, "
                                                           "/step, /close, /expert; GET /health"}))

        do_PUT = do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = not_allowed

        def route(self) -> str:
            return urlsplit(self.path).path.rstrip("/") or "/"

        def answer(self, route) -> None:
            allowed = ROUTES.get(self.route())
            try:
                if allowed is not None and self.command != allowed:
                    said = (405, {"error": f"{self.route()} takes {allowed}, not {self.command}."},
                            (("Allow", allowed),))
                    body = self.headers.get("Transfer-Encoding") or self.headers.get("Content-Length", "0") != "0"
                    self.reply(*(self.refuse(*said) if body else said))   # no body: the connection goes on
                    return
                self.reply(*route())
            except Refused as e:
                self.reply(e.code, {"error": str(e)})
            except Exception as e:  # noqa: BLE001 - any bug still gets an answer, and one log line
                log.error("%s %s failed: %s: %s", self.command, self.path, type(e).__name__, str(e)[:200])
                self.close_connection = True
                self.reply(500, {"error": f"the service failed on this request ({type(e).__name__}); see its log."})

        def get(self) -> tuple[int, dict]:
            if self.route() == "/health":
                return 200, service.health()
            return 404, {"error": f"no route GET {self.path:.200}; POST /reset, /step, /close, /expert; GET /health"}

        def post(self) -> tuple:
            n, refusal = _declared_length(self.headers)
            if refusal is not None:   # the body's end is unknown or unread: no next request here
                return self.refuse(*refusal)
            raw = b""
            try:
                while len(raw) < n:   # read1: what has come so far survives a timeout
                    chunk = self.rfile.read1(n - len(raw))
                    if not chunk:
                        break
                    raw += chunk
            except TimeoutError:
                pass
            if len(raw) < n:
                self.close_connection = True
                return 408, {"error": f"the body ended after {len(raw)} of its {n} bytes (Content-Length), or took "
                                      f"over {read_timeout_s:g}s."}
            if not service.authorised(self.headers.get("Authorization"), key):
                return 401, {"error": "missing or wrong `Authorization: Bearer <key>`."}
            try:
                body = json.loads(raw or b"{}")
            except (ValueError, RecursionError) as e:   # RecursionError: brackets nested thousands deep
                return 400, {"error": f"the request body is not JSON ({str(e)[:200]})."}
            if not isinstance(body, dict):
                return 400, {"error": f"the request body must be a JSON object, got {type(body).__name__}."}
            route = self.route()
            if route == "/reset":
                return 200, service.reset(body.get("task"))
            if route == "/step":
                return service.step(body)
            if route == "/close":
                return 200, service.close(body)
            if route == "/expert":
                return 200, service.expert(body)
            return 404, {"error": f"no route POST {self.path:.200}; POST /reset, /step, /close, /expert"}

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256   # the listen backlog: a trainer opens dozens of connections at once (default 5)

    def handle_error(self, request, client_address):
        # What escapes a handler (a connection error mid-request): one line, not socketserver's traceback.
        e = sys.exc_info()[1]
        log.warning("connection from %s ended: %s: %s", client_address[0], type(e).__name__, str(e)[:200])


class EnvServer:
    def __init__(self, service, host: str = "127.0.0.1", port: int = 0, key: Optional[str] = None,
                 sweep_s: float = 5.0, read_timeout_s: float = 60.0):
        self.service = service
        self.httpd = _Server((host, port), _handler(service, key, read_timeout_s))
        self.url = f"http://{host}:{self.httpd.server_address[1]}"
        self.sweep_s = sweep_s
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _sweep(self) -> None:
        while not self._stop.wait(self.sweep_s):
            self.service.close_idle()

    def start(self) -> "EnvServer":
        for target in (self.httpd.serve_forever, self._sweep):
            t = threading.Thread(target=target, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def serve_forever(self) -> None:
        t = threading.Thread(target=self._sweep, daemon=True)
        t.start()
        try:
            self.httpd.serve_forever()
        finally:
            self._stop.set()

    def stop(self) -> None:
        self._stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()
