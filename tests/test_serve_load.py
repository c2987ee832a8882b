"""`trainfit serve` under load, on a real uvicorn server on 127.0.0.1 with a stand-in policy whose
generation waits for the test: a full queue answers 503 with Retry-After, a slow client holds up no one
and is answered 408, malformed and oversized requests get 4xx JSON. No timing thresholds: the order of
events decides (the load numbers are bench/serve_load.py's)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from trainfit.app.serve.app import create_app
from trainfit.app.serve.limits import ServeLimits
from trainfit.app.serve.server import serving_in_thread
from trainfit.rollout.base import Completion


class Vocab:
    def __len__(self):
        return 100


class GatedPolicy:
    """A served policy whose generate waits until `gate` is set (so the queue fills when the test says)."""

    name = source = "stub"
    adapters: dict = {}
    max_model_len = 0
    processor = None

    def __init__(self):
        self.tokenizer, self.gate, self.generating = Vocab(), threading.Event(), threading.Event()

    def resolve(self, model):
        if model in (None, self.name):
            return None
        raise KeyError(model)

    def generate(self, key, prompts, seeds, batch_size=None, images=None):
        self.generating.set()
        self.gate.wait(20)
        return [Completion([7], "x", False, [-0.5]) for _ in prompts]


@pytest.fixture
def serve():
    """serve(**limits) -> (base URL, policy, app) of a server whose limits are small enough to reach in a
    test (a 0.3 s read timeout unless told); the generation gate is open unless `gated`."""
    with contextlib.ExitStack() as stack:
        policies = []

        def start(gated=False, **kw):
            policy = GatedPolicy()
            if not gated:
                policy.gate.set()
            policies.append(policy)
            limits = ServeLimits(**{"max_queue": 2, "max_connections": 8, "read_timeout_s": 0.3,
                                    "max_body_bytes": 1000, **kw})
            app = create_app(policy, max_batch=4, batch_wait_ms=0, limits=limits)
            return stack.enter_context(serving_in_thread(app, limits)), policy, app
        yield start
        for p in policies:
            p.gate.set()


@pytest.fixture
def served(serve):
    return serve()


def complete(url, n=1):
    return httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "n": n, "max_tokens": 1}, timeout=20)


def raw(url, data: bytes, then=b"") -> tuple[int, dict]:
    """Send `data` (and `then`) on a socket of its own; the status and JSON body of the reply."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as s:
        s.sendall(data)
        if then:
            s.sendall(then)
        reply = b""
        while b"\r\n\r\n" not in reply or len(reply.split(b"\r\n\r\n", 1)[1]) < _length(reply):
            chunk = s.recv(65536)
            if not chunk:
                break
            reply += chunk
    head, body = reply.split(b"\r\n\r\n", 1)
    return int(head.split()[1]), json.loads(body)


def _length(reply: bytes) -> int:
    for line in reply.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            return int(v)
    return 1 << 30


def test_a_full_queue_answers_503_with_retry_after_then_serves_again(serve):
    url, policy, app = serve(gated=True)
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(complete, url, 2)          # fills the queue (2 sequences) and waits at the gate
        assert policy.generating.wait(20)
        busy = complete(url)
        assert busy.status_code == 503
        err = busy.json()["error"]
        assert err["type"] == "server_overloaded" and "--max-queue" in err["message"]
        assert int(busy.headers["retry-after"]) == err["retry_after"] >= 1
        policy.gate.set()
        assert first.result().status_code == 200
    assert complete(url).status_code == 200            # drained: admitted again
    queue = httpx.get(f"{url}/health").json()["queue"]     # what an operator sees
    assert queue == {"depth": 0, "max_depth": 2, "limit": 2, "refused": 1}


def test_a_request_larger_than_the_queue_is_400_not_503(served):
    url, policy, _ = served
    r = complete(url, n=3)
    assert r.status_code == 400 and "more than the server queues at once (2" in r.json()["error"]["message"]


def test_slow_clients_hold_up_no_one(serve):
    url, _, _ = serve(read_timeout_s=60)
    host, port = url.removeprefix("http://").split(":")
    slow = [socket.create_connection((host, int(port))) for _ in range(4)]
    try:
        for s in slow[:2]:      # half a head, and then nothing
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
        for s in slow[2:]:      # a whole head, half a body
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{\"pro")
        assert [complete(url).status_code for _ in range(3)] == [200] * 3
        for s in slow:          # still waiting, unanswered, while the others were served
            s.setblocking(False)
            with pytest.raises(BlockingIOError):
                s.recv(1)
    finally:
        for s in slow:
            s.close()


def test_a_head_that_stops_coming_is_408(served):
    url, _, _ = served
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as slow:
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")   # and then nothing
        reply = slow.recv(65536)
    assert reply.startswith(b"HTTP/1.1 408") and b"--read-timeout-s" in reply


def test_a_body_that_stops_coming_is_408(served):
    url, _, _ = served
    status, body = raw(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                            b"Content-Length: 100\r\n\r\n{\"prompt\": ")
    assert status == 408 and body["error"]["type"] == "timeout"


@pytest.mark.parametrize("data, status, says", [
    (b"HELLO THERE\r\n\r\n", 400, "malformed HTTP request"),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n", 431, "head is over 65536 bytes"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n" + b"x" * 5000, 413,
     "body is over 1000 bytes"),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 4\r\n\r\n{no}",
     400, "not valid JSON"),
    (b"PUT /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 405, "Method Not Allowed"),
    (b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n", 404, "Not Found"),
])
def test_malformed_and_oversized_requests_get_4xx_json(served, data, status, says):
    url, _, _ = served
    got, body = raw(url, data)
    assert got == status and says in body["error"]["message"] and body["error"]["code"] == status


def test_conflicting_content_lengths_are_400_json(served):
    url, _, _ = served
    got, body = raw(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}")
    assert got == 400 and body["error"]["code"] == 400


def test_a_chunked_body_is_read_whole(served):
    url, _, _ = served
    payload = json.dumps({"prompt": [1, 2], "max_tokens": 1}).encode()
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(payload), payload)
    got, body = raw(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n" + chunked)
    assert got == 200 and body["choices"][0]["text"] == "x"


def test_connections_past_the_limit_get_503_with_retry_after(serve):
    url, _, _ = serve(read_timeout_s=60)
    host, port = url.removeprefix("http://").split(":")
    held = [socket.create_connection((host, int(port))) for _ in range(8)]
    try:
        status, body = raw(url, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")   # the ninth
    finally:
        for s in held:
            s.close()
    assert status == 503 and body["error"]["retry_after"] >= 1
