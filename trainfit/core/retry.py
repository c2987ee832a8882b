"""Retries of requests to a remote service: the openai rollout server and an environment service.

    policy = RetryPolicy(timeout_s=30, retries=6, backoff_s=0.5, max_s=120)
    reply = send(client, "POST", url, policy, json=body, read=lambda r: r.json())

A request is tried again when the server is dead (connection refused or reset), hangs (no reply within
`timeout_s`), or answers 408, 425, 429 or 5xx. Waits grow from `backoff_s`, doubling each retry, at most
MAX_WAIT_S each, each shortened by up to `JITTER` of itself at random so that many clients that lost the same
server do not come back in step. A `Retry-After` header (seconds or an HTTP date) is honoured: the wait is
at least what the server asked. Everything together (attempts and waits) stays within `max_s`: a retry
that could not start before then is not tried, and an attempt's timeout is cut to the time left. When
every attempt failed, `GaveUp` says what was tried (attempts, seconds, the last error); callers turn it
into their own error with the URL and what to check.

A reply the server gives for good (2xx, or a 4xx it will give again) goes to `read`, which returns the
caller's value or raises `Invalid` to have it retried (a 200 whose body is not what the protocol says).
"""

from __future__ import annotations

import email.utils
import random
import time
from dataclasses import dataclass
from typing import Callable, Optional, TypeVar

import httpx

from trainfit.config.rollout import RETRY_JITTER as JITTER, RETRY_MAX_WAIT_S as MAX_WAIT_S, outage_s

RETRY_STATUSES = frozenset({408, 425, 429})   # and every 5xx

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    timeout_s: float      # one attempt's timeout
    retries: int          # attempts after the first, at most
    backoff_s: float      # the first wait; it doubles each retry
    max_s: float          # attempts and waits together, at most

    def outage_s(self) -> float:
        """The longest outage these retries surely wait out (config/rollout.py)."""
        return outage_s(self.retries, self.backoff_s, self.max_s)

    def wait(self, retry: int, retry_after: Optional[float], rng: random.Random) -> float:
        """Seconds to wait before retry number `retry` (1, 2, ...)."""
        base = min(self.backoff_s * 2 ** (retry - 1), MAX_WAIT_S)
        base *= 1.0 - JITTER * rng.random()
        return max(base, retry_after or 0.0)


class Invalid(Exception):
    """Raised by a `read` function: the reply is not usable, try again (the message says why)."""


class GaveUp(Exception):
    """Every attempt failed. `state` is unreachable, hanging, failing or invalid; `last` the last error."""

    def __init__(self, state: str, attempts: int, seconds: float, last: str, why_stopped: str = ""):
        self.state, self.attempts, self.seconds, self.last = state, attempts, seconds, last
        self.why_stopped = why_stopped
        super().__init__(self.tried())

    def tried(self) -> str:
        """E.g. '4 attempts over 12.5 s (last: connection refused)'."""
        n = f"{self.attempts} attempt{'s' if self.attempts != 1 else ''}"
        stopped = f"; {self.why_stopped}" if self.why_stopped else ""
        return f"{n} over {self.seconds:.1f} s (last: {self.last}){stopped}"


def retry_after_s(response: httpx.Response) -> Optional[float]:
    """The reply's Retry-After in seconds (delta-seconds or an HTTP date), or None."""
    value = response.headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _transport_error(e: httpx.TransportError, timeout: float) -> tuple[str, str]:
    """(state, words) for a request that got no reply."""
    if isinstance(e, httpx.TimeoutException):
        return "hanging", f"no reply within {timeout:.3g} s ({type(e).__name__})"
    if isinstance(e, httpx.RemoteProtocolError):
        return "unreachable", f"the connection was closed without a reply ({e})"
    return "unreachable", f"connection failed ({type(e).__name__}: {e})"


def send(client: httpx.Client, method: str, url: str, policy: RetryPolicy, *,
         read: Callable[[httpx.Response], T] = lambda r: r, clock: Callable[[], float] = time.monotonic,
         sleep: Callable[[float], None] = time.sleep, **kw) -> T:
    """`read` of the first reply the server gives for good, retrying as the module docstring says;
    GaveUp when none came within the policy."""
    rng = random.Random()
    start = clock()
    deadline = start + policy.max_s
    state, last, asked, attempts, stopped = "unreachable", "no attempt", None, 0, ""
    for retry in range(policy.retries + 1):
        if retry:
            pause = policy.wait(retry, asked, rng)
            if clock() + pause >= deadline:
                stopped = (f"the server asked to retry after {asked:g} s" if asked and asked >= pause
                           else "the next retry") + f" would pass the {policy.max_s:g} s limit"
                break
            sleep(pause)
        left = deadline - clock()
        if left <= 0:
            break
        attempts += 1
        asked = None
        timeout = min(policy.timeout_s, left)
        try:
            r = client.request(method, url, timeout=timeout, **kw)
        except httpx.TransportError as e:
            state, last = _transport_error(e, timeout)
            continue
        if r.status_code in RETRY_STATUSES or r.status_code >= 500:
            state, last, asked = "failing", f"HTTP {r.status_code}: {r.text[:200]}", retry_after_s(r)
            continue
        try:
            return read(r)
        except Invalid as e:
            state, last = "invalid", str(e)
    raise GaveUp(state, attempts, clock() - start, last, stopped)
