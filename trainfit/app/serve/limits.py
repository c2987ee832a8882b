"""What `trainfit serve` takes at most, and the JSON it answers past it.

    generation queue    --max-queue sequences waiting or generating; one more is answered 503 with
                        Retry-After (header and JSON), never queued
    connections         --max-connections open at once; one more is answered 503 with Retry-After and closed
    slow clients        a request's head must arrive within --read-timeout-s of its first byte, and its
                        body within --read-timeout-s of the head: else 408 and the connection is closed
                        (no thread waits on a slow client: the server is asyncio, generation one thread)
    sizes               a head over 64 KiB is 431, a body over --max-body-mb is 413; a bad request line
                        or header is 400; every answer is OpenAI's {"error": {...}} JSON
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from http import HTTPStatus

MAX_HEAD_BYTES = 64 * 1024
MAX_RETRY_AFTER_S = 60


@dataclass(frozen=True)
class ServeLimits:
    max_queue: int = 256            # sequences waiting for or in generation
    max_connections: int = 1024     # open HTTP connections
    read_timeout_s: float = 10.0    # a request's head (from its first byte), then its body
    max_body_bytes: int = 16 * 1024 * 1024
    max_head_bytes: int = MAX_HEAD_BYTES

    def __post_init__(self):
        if self.max_queue < 1 or self.max_connections < 1 or self.read_timeout_s <= 0 or self.max_body_bytes < 1:
            raise ValueError(f"serve limits must be positive: {self}")


def retry_after(seconds: float) -> int:
    """A Retry-After value: whole seconds, 1 to MAX_RETRY_AFTER_S."""
    return int(min(MAX_RETRY_AFTER_S, max(1, math.ceil(seconds))))


def error_body(status: int, message: str, type_: str = "invalid_request_error", **extra) -> dict:
    """OpenAI's error shape (what protocol.APIError.body gives), with extra fields such as retry_after."""
    return {"error": {"message": message, "type": type_, "code": status, **extra}}


def raw_response(status: int, body: dict, headers: dict[str, str] | None = None) -> bytes:
    """A whole HTTP/1.1 response, for answers given below the ASGI app (a connection over the limit,
    a slow or oversized head), which then close the connection."""
    data = json.dumps(body).encode()
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", "content-type: application/json",
             f"content-length: {len(data)}", "connection: close", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + data
