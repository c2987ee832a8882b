"""The server side of trainfit's HTTP environment protocol (envs/http.py is the client), for a service
object with reset(row) / step(body) / close(body) / expert(body) / health() / close_idle() / authorised();
a method raises Refused(code, message) to answer an HTTP error.

    server = EnvServer(service, host="127.0.0.1", port=8080, key="s3cret")
    server.start()            # a thread; or server.serve_forever() in the foreground
    server.url                # http://127.0.0.1:8080
    server.stop()

Every POST needs `Authorization: Bearer <key>` when a key is set (401 otherwise); GET /health does not.
A body that is not a JSON object is answered 400 saying so; one over MAX_BODY_BYTES 413 naming the limit;
a Content-Length that is not a non-negative integer 400, and a body slower than `read_timeout_s` 408
(both close the connection: where the next request starts is unknown). Every request gets an HTTP
answer: an unexpected error in the service is answered 500 with its type and logged as one line, never
a traceback. Requests are served on threads (the service serialises what must be); idle episodes are
closed by a background sweep every few seconds.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

MAX_BODY_BYTES = 1 << 20   # actions are short texts; a larger body is a client bug
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


def _handler(service, key: Optional[str], read_timeout_s: float):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"   # keep-alive: httpx reuses connections
        # The socket timeout (StreamRequestHandler): a client that declares more body than it sends, or
        # idles on a kept-alive connection, frees its thread after this long.
        timeout = read_timeout_s

        def log_message(self, *args):   # the service logs nothing per request
            pass

        def handle(self):
            try:
                super().handle()
            except (BrokenPipeError, ConnectionResetError):
                # A client reset a kept-alive connection between requests (httpx closing its pool when an
                # environment closes): a normal end of a connection, not an error to print.
                pass

        def reply(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            try:
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if self.close_connection:   # say so: the client opens a new connection for its next request
                    self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                # The client left (timed out, or the trainer stopped): the step is recorded and a retry
                # is answered from it (idempotent steps); nothing to print.
                self.close_connection = True

        def do_GET(self):
            self.answer(self.get)

        def do_POST(self):
            self.answer(self.post)

        def answer(self, route) -> None:
            try:
                self.reply(*route())
            except Refused as e:
                self.reply(e.code, {"error": str(e)})
            except Exception as e:  # noqa: BLE001 - any bug still gets an answer, and one log line
                log.error("%s %s failed: %s: %s", self.command, self.path, type(e).__name__, str(e)[:200])
                self.close_connection = True
                self.reply(500, {"error": f"the service failed on this request ({type(e).__name__}); see its log."})

        def get(self) -> tuple[int, dict]:
            if self.path.rstrip("/") == "/health":
                return 200, service.health()
            return 404, {"error": f"no route GET {self.path}; POST /reset, /step, /close, /expert; GET /health"}

        def post(self) -> tuple[int, dict]:
            n = _content_length(self.headers.get("Content-Length"))
            if n is None or n > MAX_BODY_BYTES:
                self.close_connection = True   # the body's end is unknown or unread: no next request here
                if n is None:
                    return 400, {"error": f"Content-Length must be a non-negative integer, got "
                                          f"{self.headers.get('Content-Length')!r:.40}."}
                return 413, {"error": f"request body of {n} bytes is over the limit of {MAX_BODY_BYTES}."}
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
            route = self.path.rstrip("/")
            if route == "/reset":
                return 200, service.reset(body.get("task"))
            if route == "/step":
                return service.step(body)
            if route == "/close":
                return 200, service.close(body)
            if route == "/expert":
                return 200, service.expert(body)
            return 404, {"error": f"no route POST {self.path}; POST /reset, /step, /close, /expert"}

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
