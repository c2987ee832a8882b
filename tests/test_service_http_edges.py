"""The environment service's HTTP edges, spoken to with raw sockets on 127.0.0.1 (a stand-in browser, no
Chromium): a text a browser cannot type is a penalty that restarts no browser; an oversized body sent
without waiting gets its 413 (never a reset); chunked and conflicting lengths, other methods, a junk
request line and an over-long header are answered in JSON with their status; a query string does not
change the route; a replaced browser leaves one line in the log."""

from __future__ import annotations

import json
import logging
import socket

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from test_cua_action_fuzz import ANY_CHAR, typeable
from test_cua_service import FakeBrowser, post, raw, read_reply, service

from trainfit.envs.miniwob_browser import BrowserPool
from trainfit.envs.miniwob_service import MiniWoBService
from trainfit.envs.service_http import MAX_BODY_BYTES, EnvServer


class TypingBrowser(FakeBrowser):
    """Fails on text it cannot send, as ChromeDriver does (a lone surrogate, a control, a WebDriver key...)."""

    def step(self, action):
        if action.kind == "type" and not typeable(action.text):
            raise ValueError(f"InvalidArgumentException: cannot type {action.text!r}")
        return super().step(action)


@pytest.fixture(scope="module")
def running():
    svc = MiniWoBService(["click-button"], BrowserPool(1, make=TypingBrowser))
    server = EnvServer(svc, read_timeout_s=0.5, sweep_s=60).start()
    yield server, svc
    server.stop()


@pytest.fixture
def server(running, capfd):
    yield running
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err


def exchange(server, data: bytes, timeout: float = 5.0) -> tuple[int, str, dict]:
    """Send `data` all at once on a new connection, then read one answer: (status, head, JSON body)."""
    with socket.create_connection(server.httpd.server_address[:2], timeout=timeout) as s:
        s.sendall(data)
        head, body, _ = read_reply(s)
    assert b"Content-Type: application/json" in head, head
    return int(head.split()[1]), head.decode("latin-1"), json.loads(body)


@pytest.mark.parametrize("action", [
    'type("\\ud800")',                                                               # the escape, as reported
    'type("\ud800")',                                                                # the character itself
    '<tool_call>{"name": "computer_use", "arguments": {"action": "type", "text": "\\ud800"}}</tool_call>',
    'type("a\\u0007")',
])
def test_untypeable_text_is_a_penalty_and_restarts_no_browser(server, action):
    server, svc = server
    eid = svc.reset({"seed": 1})["episode_id"]
    made = FakeBrowser.made
    steps = [post("/step", json.dumps({"episode_id": eid, "step": k, "action": a}).encode())
             for k, a in ((1, action), (2, 'type("ok")'))]
    (code, body, closes), (code2, body2, _) = raw(server, *steps)
    assert code == 200 and body["reward"] == -0.1 and not body["done"]
    assert "cannot type" in body["info"]["invalid_action"]
    assert not closes and code2 == 200 and body2["reward"] == 0.0                  # the episode goes on
    assert svc.pool.stats()["replaced"] == 0 and FakeBrowser.made == made


@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(st.text(ANY_CHAR, min_size=1, max_size=20), st.booleans())
def test_any_unicode_action_over_http_restarts_no_browser(running, text, as_type):
    server, svc = running
    eid = svc.reset({"seed": 3})["episode_id"]
    action = f"type({json.dumps(text)})" if as_type else text
    request = post("/step", json.dumps({"episode_id": eid, "step": 1, "action": action}).encode())
    ((code, body, _),) = raw(server, request)
    assert code == 200 and ("invalid_action" in body["info"] or body["reward"] >= 0), body
    assert svc.pool.stats()["replaced"] == 0


def test_a_10_mb_body_sent_without_waiting_gets_its_413(server):
    server, _ = server
    big = b"x" * (10 << 20)
    for _ in range(3):   # the reset was intermittent: a few tries on fresh connections
        code, head, body = exchange(server, post("/step", big))
        assert code == 413 and f"over the limit of {MAX_BODY_BYTES}" in body["error"] and "Connection: close" in head


def test_an_oversized_body_announced_with_expect_100_is_refused_before_continue(server):
    server, _ = server
    request = (b"POST /step HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 10485760\r\n\r\n")
    code, head, body = exchange(server, request)
    assert code == 413 and "100 Continue" not in head and "over the limit" in body["error"]


def test_a_chunked_body_gets_411_in_json(server):
    server, _ = server
    request = (b"POST /step HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"14\r\n{\"episode_id\": \"x\"}\r\n0\r\n\r\n")
    code, head, body = exchange(server, request)
    assert code == 411 and "Content-Length" in body["error"] and "Connection: close" in head


def test_two_different_content_lengths_get_400_and_equal_ones_are_one(server):
    server, svc = server
    eid = svc.reset({"seed": 2})["episode_id"]
    data = json.dumps({"episode_id": eid}).encode()
    n = len(data)
    code, head, body = exchange(server, (f"POST /close HTTP/1.1\r\nHost: x\r\nContent-Length: {n}\r\n"
                                         f"Content-Length: {n + 5}\r\n\r\n").encode() + data + b"     ")
    assert code == 400 and "2 different Content-Length values" in body["error"] and "Connection: close" in head
    code, _, body = exchange(server, f"POST /close HTTP/1.1\r\nHost: x\r\nContent-Length: {n}\r\n"
                                     f"Content-Length: {n}\r\n\r\n".encode() + data)
    assert code == 200 and body == {"closed": True}


@pytest.mark.parametrize("request_line, allow", [("PUT /reset", "POST"), ("GET /step", "POST"),
                                                 ("POST /health", "GET"), ("DELETE /close?x=1", "POST")])
def test_another_method_gets_405_with_allow_in_json(server, request_line, allow):
    server, _ = server
    code, head, body = exchange(server, f"{request_line} HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{{}}".encode())
    assert code == 405 and f"Allow: {allow}" in head and f"takes {allow}" in body["error"]


def test_a_junk_request_line_gets_400_in_json(server):
    server, _ = server
    code, head, body = exchange(server, b"\x16\x03\x01 junk junk\r\n\r\n")
    assert code == 400 and head.startswith("HTTP/1.") and "Bad Request" in body["error"]


def test_a_70_kb_header_gets_431_in_json(server):
    server, _ = server
    code, head, body = exchange(server, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n")
    assert code == 431 and "Connection: close" in head and "Line too long" in body["error"]


def test_a_query_string_does_not_change_the_route(server):
    server, _ = server
    code, _, body = exchange(server, b"GET /health?x=1 HTTP/1.1\r\nHost: x\r\n\r\n")
    assert code == 200 and body["tasks"] == ["click-button"]


def test_a_replaced_browser_leaves_one_log_line(caplog):
    svc = service(size=1)
    eid = svc.reset({"seed": 4})["episode_id"]
    svc.pool.slots[0].browser.explode = True
    with caplog.at_level(logging.WARNING, logger="trainfit.envs.miniwob_service"):
        code, _ = svc.step({"episode_id": eid, "step": 1, "action": "click(1, 1)"})
    assert code == 410 and svc.pool.stats()["replaced"] == 1
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("browser replaced: it failed during step 1 of episode") and "click-button seed 4" in line
    assert "RuntimeError: chrome not reachable" in line and "answered 410" in line
