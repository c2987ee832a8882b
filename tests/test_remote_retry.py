"""Remote parts that fail (trainfit/core/retry.py): the environment client and the openai rollout engine
against a local server that dies, hangs, answers 503 with Retry-After, restarts and comes back."""

from __future__ import annotations

import json
import random
import socket
import threading
from types import SimpleNamespace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from conftest import send_json, tiny_config
from trainfit.config import ConfigError, EnvConfig, RolloutConfig
from trainfit.core.errors import EnvLost
from trainfit.core.retry import JITTER, MAX_WAIT_S, GaveUp, RetryPolicy, send
from trainfit.envs import HTTPEnv, run_groups
from trainfit.models.tokenizer import build_tokenizer
from trainfit.rollout.base import Completion, EngineError
from trainfit.rollout.openai_engine import OpenAIEngine
from trainfit.tasks import Example
from trainfit.train.evaluate import episode_eval


class Flaky:
    """A JSON service on 127.0.0.1 that can be stopped (connections refused) and started again on the
    same port with its state lost. `faults` are taken one per request, in order: "drop" closes the
    connection without a reply, "hang" replies only after the test ends, ("503", retry_after) answers 503;
    an empty list answers with `answer(method, path, body)` -> (status, dict)."""

    def __init__(self):
        self.faults: list = []
        self.seen: list[tuple[str, str]] = []
        self.lock, self.release = threading.Lock(), threading.Event()
        self.port = 0
        self.start()

    def start(self) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                outer.handle(self, "GET", None)

            def do_POST(self):
                outer.handle(self, "POST", json.loads(self.rfile.read(int(self.headers["Content-Length"]))))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.forget()
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def forget(self) -> None:
        """What a restart loses."""

    def handle(self, h: BaseHTTPRequestHandler, method: str, body) -> None:
        with self.lock:
            self.seen.append((method, h.path))
            fault = self.faults.pop(0) if self.faults else None
        if fault == "drop":
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)
            return
        if fault == "hang":
            self.release.wait(10)
            return
        if isinstance(fault, tuple):
            h.send_response(503)
            h.send_header("Retry-After", fault[1])
            h.send_header("Content-Length", "2")
            h.end_headers()
            h.wfile.write(b"{}")
            return
        status, reply = self.answer(method, h.path, body)
        send_json(h, status, json.dumps(reply).encode())

    def answer(self, method: str, path: str, body) -> tuple[int, dict]:
        return 200, {"ok": True}

    def close(self) -> None:
        self.release.set()
        self.stop()


@pytest.fixture
def flaky():
    s = Flaky()
    yield s
    s.close()


def fast(**kw) -> RetryPolicy:
    return RetryPolicy(**{"timeout_s": 0.3, "retries": 5, "backoff_s": 0.001, "max_s": 30.0, **kw})


def test_waits_double_from_backoff_with_jitter_capped_and_honour_retry_after():
    policy, rng = RetryPolicy(timeout_s=1, retries=9, backoff_s=0.5, max_s=600), random.Random(0)
    for retry in range(1, 10):
        base = min(0.5 * 2 ** (retry - 1), MAX_WAIT_S)
        assert base * (1 - JITTER) <= policy.wait(retry, None, rng) <= base
    assert policy.wait(1, 7.0, rng) == 7.0                   # the server asked for longer: at least that
    assert len({policy.wait(3, None, rng) for _ in range(5)}) == 5   # jittered: clients do not retry in step


def test_a_request_survives_a_dropped_connection_a_hang_and_a_503_in_turn(flaky):
    flaky.faults = ["drop", "hang", ("503", "2")]
    waits = []
    with httpx.Client() as client:
        r = send(client, "POST", flaky.url + "/x", fast(), json={}, sleep=waits.append)
    assert r.json() == {"ok": True} and len(flaky.seen) == 4
    assert len(waits) == 3 and waits[2] >= 2.0                # the 503's Retry-After was honoured


def test_a_dead_service_fails_with_one_message_naming_url_attempts_and_what_to_check(flaky):
    flaky.stop()
    env = HTTPEnv(flaky.url, timeout_s=0.3, retries=2, backoff_s=0.001)
    with pytest.raises(EnvLost) as e:
        env.reset(Example("go", None, "", "", {}))
    msg = str(e.value)
    assert f"environment service at {flaky.url}/reset unreachable: 3 attempts over" in msg
    assert "(last: connection failed (ConnectError" in msg and "check env.url and that the service is running" in msg
    assert "env.retries=2" in msg and "env.retry_max_s=" in msg
    flaky.start()                 # so close() has a server to stop


def test_a_retry_after_past_the_window_stops_at_once_saying_so(flaky):
    flaky.faults = [("503", "60")] * 3
    with httpx.Client() as client, pytest.raises(GaveUp) as e:
        send(client, "GET", flaky.url + "/x", fast(max_s=5.0))
    assert e.value.attempts == 1 and e.value.state == "failing"
    assert "the server asked to retry after 60 s would pass the 5 s limit" in str(e.value)


def test_retry_window_shorter_than_one_request_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"env.retry_max_s=5 is shorter than one request \(env.timeout_s=30\)"):
        tiny_config(tmp_path, stage="grpo", **{"env.type": "http", "env.url": "http://127.0.0.1:1",
                                               "env.retry_max_s": 5, "rollout.max_turns": 2})


class Guess(Flaky):
    """Episodes of task A end at the first guess; task B's take two. At the first second step of a B
    episode the service "restarts": it forgets every episode and drops the connection. With `lose_b` it
    never knows a B episode at all."""

    def __init__(self, lose_b=False):
        self.crashes, self.lose_b = 1, lose_b
        super().__init__()

    def forget(self):
        self.episodes: dict[str, str] = {}
        self.resets: list[str] = []

    def answer(self, method, path, body):
        if path == "/reset":
            eid = f"{body['task']['id']}-{len(self.resets)}"
            self.resets.append(body["task"]["id"])
            if not self.lose_b or eid[0] != "B":
                self.episodes[eid] = body["task"]["id"]
            return 200, {"episode_id": eid, "observation": [{"role": "user", "content": f"Guess ({eid[0]})."}]}
        if path == "/step":
            if body["episode_id"] not in self.episodes:
                return 404, {"error": f"no episode {body['episode_id']}"}
            hit = "7" in body["action"]
            return 200, {"observation": [] if hit else [{"role": "user", "content": "No."}], "reward": float(hit),
                         "done": hit}
        return 200, {}

    def handle(self, h, method, body):
        if (h.path == "/step" and body["step"] == 2 and body["episode_id"].startswith("B") and self.crashes):
            with self.lock:
                self.crashes -= 1
                self.forget()
                self.faults.insert(0, "drop")
        super().handle(h, method, body)


class Guesser:
    """Guesses 7 at once on task A, and 3 then 7 on task B (seeded by nothing: the prompt decides)."""

    def __init__(self, tok):
        self.tok, self.seeds = tok, []

    def generate(self, prompts, *, seeds=None, max_new_tokens=None, logprobs=False, greedy=False, **kw):
        self.seeds.append(list(seeds))
        out = []
        for p in prompts:
            text = self.tok.decode(p)
            guess = "7" if "No." in text or "(A)" in text else "3"
            ids = self.tok(guess, add_special_tokens=False)["input_ids"]
            out.append(Completion(ids, guess, False, None))
        return out


def play(tok, server, group_retries):
    examples = [Example("task A", None, "7", "7", {"id": "A"})] * 2 + [Example("task B", None, "7", "7", {"id": "B"})] * 2
    engine = Guesser(tok)
    eps = run_groups(lambda: HTTPEnv(server.url, timeout_s=2.0, retries=3, backoff_s=0.001), examples, engine, tok,
                     group_size=2, group_retries=group_retries, seeds=[10, 11, 12, 13], max_turns=2,
                     max_new_tokens=4, max_prompt_length=64)
    return eps, engine


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_a_restarted_service_has_the_lost_group_sampled_again_whole(tok):
    server = Guess()
    try:
        eps, engine = play(tok, server, group_retries=1)
    finally:
        server.close()
    # Group A finished before the restart and is kept; group B lost its episodes and ran again, both of
    # them, with their own seeds: nothing failed, no group trains on part of its episodes.
    assert [ep.failed for ep in eps] == [False] * 4 and [ep.reward for ep in eps] == [1.0] * 4
    assert [ep.turns for ep in eps] == [1, 1, 2, 2]
    assert server.resets == ["B", "B"]                    # what the restarted service saw: B's group again
    assert engine.seeds[-2] == [12, 13] and engine.seeds[-1] == engine.seeds[1]   # the same seeds, both turns


def test_a_group_still_lost_after_its_retries_stops_the_step_naming_the_service(tok):
    server = Guess(lose_b=True)
    try:
        with pytest.raises(EnvLost, match=r"1 of 2 groups still lost episodes after sampling them again 1 time "
                                          r"\(env.group_retries\).*no longer knows episode"):
            play(tok, server, group_retries=1)
    finally:
        server.close()


class FakeOpenAI(Flaky):
    """An OpenAI-compatible server: /health, /v1/models, /v1/completions (token ids and log-probs), and
    adapter loading; a restart forgets the loaded adapters."""

    def forget(self):
        self.adapters: list[str] = []

    def answer(self, method, path, body):
        if path == "/health":
            return 200, {}
        if path == "/v1/models":
            return 200, {"data": [{"id": m} for m in ["base", *self.adapters]]}
        if path == "/v1/load_lora_adapter":
            self.adapters.append(body["lora_name"])
            return 200, {}
        if body["model"] not in ["base", *self.adapters]:
            return 404, {"error": {"message": f"The model `{body['model']}` does not exist."}}
        return 200, {"choices": [{"token_ids": [5, 6], "finish_reason": "length",
                                  "logprobs": {"token_logprobs": [-0.5, -0.25]}}]}


@pytest.fixture
def openai():
    s = FakeOpenAI()
    yield s
    s.close()


def engine_for(server, tok, tmp_path, **kw):
    cfg = RolloutConfig(engine="openai", base_url=server.url + "/v1", health_timeout_s=5,
                        **{"request_timeout_s": 0.5, "request_retries": 4, "retry_backoff_s": 0.001, **kw})
    return OpenAIEngine(cfg, tok, workdir=tmp_path)


def test_openai_engine_retries_a_503_a_drop_and_a_hang_then_samples(openai, tok, tmp_path):
    eng = engine_for(openai, tok, tmp_path)
    openai.faults = [("503", "0"), "drop", "hang"]
    try:
        (c,) = eng.generate([[1, 2, 3]], seeds=[4], logprobs=True)
    finally:
        eng.close()
    assert c.token_ids == [5, 6] and c.logprobs == [-0.5, -0.25]
    assert [p for _, p in openai.seen].count("/v1/completions") == 4


def test_openai_engine_reloads_the_adapter_a_restarted_server_lost(openai, tok, tmp_path):
    eng = engine_for(openai, tok, tmp_path)
    (tmp_path / "v1").mkdir()
    openai.adapters.append("trainfit-v1")
    eng.adapter = eng.model_name = "trainfit-v1"
    eng.adapter_path = tmp_path / "v1"
    openai.stop()
    openai.start()                       # restarted: the adapter is gone
    try:
        (c,) = eng.generate([[1, 2, 3]], seeds=[4])
    finally:
        eng.close()
    assert c.token_ids == [5, 6] and openai.adapters == ["trainfit-v1"]
    assert ("POST", "/v1/load_lora_adapter") in openai.seen


def test_openai_engine_gives_up_on_a_dead_server_with_one_message(openai, tok, tmp_path):
    eng = engine_for(openai, tok, tmp_path, request_retries=2)
    openai.stop()
    try:
        with pytest.raises(EngineError) as e:
            eng.generate([[1, 2, 3]], seeds=[4])
    finally:
        eng.close()
        openai.start()
    msg = str(e.value)
    assert f"the OpenAI-compatible server at {openai.url}/v1/completions unreachable: 3 attempts over" in msg
    assert "Check that it is running at rollout.base_url" in msg and "rollout.request_retries=2" in msg


def test_the_outage_the_defaults_wait_out_is_derived_from_retries_and_backoff():
    # env: waits 0.5, 1, 2, 4, 8, 16, 30, 30 s at their shortest (half) = 45.75 s, within retry_max_s=120.
    assert EnvConfig().outage_s() == 45.75
    # openai: 1, 2, 4, 8, 16, 30, 30, 30, 30, 30 s halved = 90.5 s, within retry_max_s=900.
    assert RolloutConfig().outage_s() == 90.5
    assert EnvConfig(retries=8, retry_max_s=40).outage_s() == 40   # the window bounds it


def test_a_held_out_episode_lost_to_a_restart_is_played_again_not_scored_as_a_failure(tok):
    # Evaluation counted an episode the restarted service forgot as failed (eval_env_failed > 0, a lower
    # eval_reward): it is played again, as a group of one, with its own seed.
    server = Guess()
    examples = [Example("task A", None, "7", "7", {"id": "A"}), Example("task B", None, "7", "7", {"id": "B"})]
    task = SimpleNamespace(eval_examples=lambda: examples, is_correct=lambda text, ex: "7" in text)
    cfg = SimpleNamespace(env=EnvConfig(group_retries=1), episode_tokens=lambda: 256,
                          rollout=RolloutConfig(max_turns=2, max_new_tokens=4, max_prompt_length=64))
    try:
        out = episode_eval(lambda: HTTPEnv(server.url, timeout_s=2.0, retries=3, backoff_s=0.001), Guesser(tok),
                           tok, task, cfg, judge_final=False)
    finally:
        server.close()
    assert out["eval_env_failed"] == 0.0 and out["eval_reward"] == 1.0
    assert server.resets == ["B"]              # what the restarted service saw: B's episode once more
