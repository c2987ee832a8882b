"""The server side of trainfit's HTTP environment protocol (envs/http.py is the client), for a service
object with reset(row) / step(body) / close(body) / expert(body) / health() / close_idle() / authorised();
a method raises Refused(code, message) to answer an HTTP error.

    server = EnvServer(service, host="127.0.0.1", port=8080, key="s3cret")
    server.start()            # a thread; or server.serve_forever() in the foreground
    server.url                # http://127.0.0.1:8080
    server.stop()

Every POST needs `Authorization: Bearer <key>` when a key is set (401 otherwise); GET /health does not.
A body that is not a JSON object is answered 400 saying so; one over MAX_BODY_BYTES 413 naming the limit.
Requests are served on threads (the service serialises what must be); idle episodes are closed by a
background sweep every few seconds.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

MAX_BODY_BYTES = 1 << 20   # actions are short texts; a larger body is a client bug


class Refused(Exception):
    """A request the service answers with an HTTP error code and a message."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


def _handler(service, key: Optional[str]):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"   # keep-alive: httpx reuses connections

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
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                # The client left (timed out, or the trainer stopped): the step is recorded and a retry
                # is answered from it (idempotent steps); nothing to print.
                self.close_connection = True

        def do_GET(self):
            if self.path.rstrip("/") == "/health":
                return self.reply(200, service.health())
            self.reply(404, {"error": f"no route GET {self.path}; POST /reset, /step, /close, /expert; GET /health"})

        def do_POST(self):
            n = int(self.headers.get("Content-Length") or 0)
            if n > MAX_BODY_BYTES:
                self.close_connection = True
                return self.reply(413, {"error": f"request body of {n} bytes is over the limit of {MAX_BODY_BYTES}."})
            raw = self.rfile.read(n)
            if not service.authorised(self.headers.get("Authorization"), key):
                return self.reply(401, {"error": "missing or wrong `Authorization: Bearer <key>`."})
            try:
                body = json.loads(raw or b"{}")
            except ValueError as e:
                return self.reply(400, {"error": f"the request body is not JSON ({e})."})
            if not isinstance(body, dict):
                return self.reply(400, {"error": f"the request body must be a JSON object, got {type(body).__name__}."})
            route = self.path.rstrip("/")
            try:
                if route == "/reset":
                    return self.reply(200, service.reset(body.get("task") or {}))
                if route == "/step":
                    return self.reply(*service.step(body))
                if route == "/close":
                    return self.reply(200, service.close(body))
                if route == "/expert":
                    return self.reply(200, service.expert(body))
            except Refused as e:
                return self.reply(e.code, {"error": str(e)})
            self.reply(404, {"error": f"no route POST {self.path}; POST /reset, /step, /close, /expert"})

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256   # the listen backlog: a trainer opens dozens of connections at once (default 5)


class EnvServer:
    def __init__(self, service, host: str = "127.0.0.1", port: int = 0, key: Optional[str] = None,
                 sweep_s: float = 5.0):
        self.service = service
        self.httpd = _Server((host, port), _handler(service, key))
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
