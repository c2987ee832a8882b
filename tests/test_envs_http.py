"""HTTP environment adapter against a small local server implementing the documented protocol."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from envs_helpers import ScriptedEngine
from trainfit.envs import EnvError, HTTPEnv, build_env_factory, run_episodes
from trainfit.models.tokenizer import build_tokenizer
from trainfit.tasks import Example

from conftest import JSONService, send_json, tiny_config


class GuessServer(JSONService):
    """A number-guessing environment: reward 1 and done when the action contains the secret "7".

    mode: "ok"; "drop" closes the socket without replying for the first `k` requests; "slow" waits
    1 s before answering the first `k`; "garbage" always answers 200 with a body that is not JSON.
    """

    def __init__(self, mode="ok", k=0):
        self.mode, self.k, self.requests, self.headers, self.lock = mode, k, [], [], threading.Lock()
        super().__init__()

    def handle(self, handler, body):
        with self.lock:
            self.requests.append((handler.path, body))
            self.headers.append(dict(handler.headers))
            n = len(self.requests)
        if self.mode == "drop" and n <= self.k:
            handler.close_connection = True
            handler.connection.shutdown(socket.SHUT_RDWR)
            return
        if self.mode == "slow" and n <= self.k:
            time.sleep(1.0)
        if self.mode == "garbage":
            return send_json(handler, 200, b"<html>oops</html>")
        super().handle(handler, body)

    def answer(self, path, body):
        if path == "/reset":
            return {"episode_id": f"ep-{body['task']['id']}",
                    "observation": [{"role": "user", "content": f"Guess my number ({body['task']['id']})."}]}
        if path == "/step":
            hit = "7" in body["action"]
            return {"observation": [] if hit else [{"role": "user", "content": "No, try again."}],
                    "reward": 1.0 if hit else 0.0, "done": hit, "info": {"step": body["step"]}}
        return {}


@pytest.fixture
def server():
    s = GuessServer()
    yield s
    s.close()


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def ex(i):
    return Example("guess", None, "7", "7", {"id": i})


def fast(url, **kw):
    return HTTPEnv(url, **{"timeout_s": 2.0, "retries": 3, "backoff_s": 0.01, **kw})


def guesses(tok, by_turn):
    return ScriptedEngine(tok, lambda p, s, t: tok(by_turn[t], add_special_tokens=False)["input_ids"] + [tok.eos_token_id])


def test_normal_episode_and_api_key_header(server, tok, tmp_path, monkeypatch):
    monkeypatch.setenv("MY_ENV_KEY", "s3cret")
    cfg = tiny_config(tmp_path, "grpo", **{"env.type": "http", "env.url": server.url, "env.api_key_env": "MY_ENV_KEY",
                                          "rollout.max_turns": 3})
    make_env = build_env_factory(cfg, None, None, tok, False, "cpu")
    eps = run_episodes(make_env, [ex(1), ex(2)], guesses(tok, ["3", "7", "7"]), tok, seeds=[0, 1], max_turns=3,
                       max_new_tokens=8, max_prompt_length=64)
    for e in eps:
        assert not e.failed and e.done and e.reward == 1.0 and e.turns == 2 and e.info["step"] == 2
        assert [m["role"] for m in e.messages] == ["user", "assistant", "user", "assistant"]
        assert e.messages[2]["content"] == "No, try again."
    paths = [p for p, _ in server.requests]
    assert paths.count("/reset") == 2 and paths.count("/step") == 4 and paths.count("/close") == 2
    reset_task = next(b["task"] for p, b in server.requests if p == "/reset")
    assert reset_task["prompt"] == "guess" and reset_task["answer"] == "7"
    step = next(b for p, b in server.requests if p == "/step")
    assert set(step) == {"episode_id", "step", "action"} and step["episode_id"].startswith("ep-")
    assert all(h["Authorization"] == "Bearer s3cret" for h in server.headers)


def test_dropped_connections_are_retried_then_succeed(tok):
    s = GuessServer(mode="drop", k=2)
    try:
        env = fast(s.url)
        assert env.reset(ex(5)) == [{"role": "user", "content": "Guess my number (5)."}]
        assert [p for p, _ in s.requests] == ["/reset"] * 3
        env.close()
    finally:
        s.close()


def test_timeouts_are_retried_then_succeed():
    s = GuessServer(mode="slow", k=1)
    try:
        env = fast(s.url, timeout_s=0.2)
        assert env.reset(ex(4))[0]["content"] == "Guess my number (4)."
        assert len(s.requests) == 2
        with pytest.raises(EnvError, match=r"hanging: 1 attempt over [0-9.]+ s \(last: no reply within 0.2 s"):
            s.k = 3
            fast(s.url, timeout_s=0.2, retries=0).reset(ex(4))
    finally:
        s.close()


def test_malformed_replies_fail_the_episode_after_retries_and_others_go_on(server, tok):
    bad = GuessServer(mode="garbage")
    try:
        with pytest.raises(EnvError) as e:
            fast(bad.url, retries=2).reset(ex(1))
        msg = str(e.value)
        assert f"environment service at {bad.url}/reset gave no valid reply: 3 attempts over" in msg
        assert "not JSON" in msg and "trainfit/envs/http.py" in msg
        n_before = len(bad.requests)
        urls = iter([server.url, bad.url, server.url])
        eps = run_episodes(lambda: fast(next(urls), retries=1), [ex(1), ex(2), ex(3)], guesses(tok, ["7"]), tok,
                           seeds=[0, 1, 2], max_turns=2, max_new_tokens=8, max_prompt_length=64)
        assert [e.failed for e in eps] == [False, True, False]
        assert "gave no valid reply: 2 attempts over" in eps[1].error and sum(eps[1].loss_mask) == 0
        assert eps[0].reward == eps[2].reward == 1.0
        assert len(bad.requests) - n_before == 2
    finally:
        bad.close()


def test_missing_fields_are_retried_as_invalid(tok):
    s = GuessServer()
    s.answer = lambda path, body: {"observation": [{"role": "user"}]}  # no episode_id, no content
    try:
        with pytest.raises(EnvError, match=r"invalid reply: missing `episode_id`"):
            fast(s.url, retries=1).reset(ex(1))
        assert len(s.requests) == 2
    finally:
        s.close()


def test_unreachable_service_is_a_clear_error_fast():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now: connection refused
    with pytest.raises(EnvError) as e:
        fast(f"http://127.0.0.1:{port}", retries=2).reset(ex(1))
    msg = str(e.value)
    assert msg.startswith(f"environment service at http://127.0.0.1:{port}/reset unreachable: 3 attempts over ")
    assert "refused" in msg.lower() and "check env.url and that the service is running" in msg


class _Health:
    """The least a service behind trainfit's EnvServer needs for GET /health."""

    def health(self):
        return {"ok": True}

    def close_idle(self):
        pass


def test_env_server_prints_nothing_when_a_client_resets_a_kept_alive_connection(capfd):
    """httpx closes its pooled keep-alive connections when an environment closes; a reset between two
    requests is a normal end of a connection, so the service prints no traceback for it (it did)."""
    import struct

    from trainfit.envs.service_http import EnvServer

    server = EnvServer(_Health(), sweep_s=60).start()
    try:
        port = int(server.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            # The whole reply (its JSON body ends it): the handler has written it and goes on to read the
            # next request, so the reset below reaches that read without waiting.
            reply = b""
            while not reply.endswith(b"}"):
                chunk = s.recv(4096)
                assert chunk, reply   # the server must keep the connection open
                reply += chunk
            assert reply.startswith(b"HTTP/1.1 200")
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))   # close = RST
        time.sleep(0.5)   # the handler thread reads the reset
    finally:
        server.stop()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "ConnectionResetError" not in err
