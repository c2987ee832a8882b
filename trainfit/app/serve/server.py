"""uvicorn set up for `trainfit serve`: the guarded protocol (guard.py) and its limits, in the foreground
for the command, or on a thread for tests and `bench/serve_load.py` (port 0: a free one)."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator

import uvicorn

from trainfit.app.serve.guard import guarded_protocol
from trainfit.app.serve.limits import ServeLimits

KEEP_ALIVE_S = 5     # an idle kept-alive connection is closed after this (uvicorn's default)


def server_config(app, host: str, port: int, limits: ServeLimits) -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_level="warning", http=guarded_protocol(limits),
                          timeout_keep_alive=KEEP_ALIVE_S)


@contextlib.contextmanager
def serving_in_thread(app, limits: ServeLimits, host: str = "127.0.0.1") -> Iterator[str]:
    """Serve `app` on a free port of `host` from a thread; yields the base URL (no /v1), stops on exit."""
    server = uvicorn.Server(server_config(app, host, 0, limits))
    thread = threading.Thread(target=server.run, name="trainfit-serve", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server thread stopped before it started serving")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
