"""Start `trainfit serve` as a real subprocess on a free loopback port (shared by the engine tests)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_subprocess(model_dir: Path, log_path: Path, *args: str, env: dict | None = None):
    """Yields (base_url, process); the server is terminated (killed if it must be) on exit."""
    port = free_port()
    log = open(log_path, "w")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "trainfit.app.cli", "serve", str(model_dir), "--port", str(port),
                             "--device", "cpu", *args], stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        yield f"http://127.0.0.1:{port}/v1", proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
