"""Faults of an environment service seen through trainfit's HTTP client (envs/http.py): a service that
dies mid-episode, an undecodable or oversized screenshot, a non-JSON body. Each fails only its episode,
with a message saying what went wrong; the other episodes of the batch go on."""

from __future__ import annotations

import base64
import io

import pytest

from conftest import JSONService, send_json
from envs_helpers import ScriptedEngine
from trainfit.envs import EnvError, HTTPEnv, run_episodes
from trainfit.models.tokenizer import build_tokenizer
from trainfit.tasks import Example
from trainfit.data import image_parts as observations


def png(size) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, (0, 90, 0)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


class ShotServer(JSONService):
    """Opens with text; every step answers with `shot()` as an image part (never done)."""

    def __init__(self, shot=lambda: png((32, 24)), body=None):
        self.shot, self.body = shot, body
        super().__init__()

    def handle(self, handler, body):
        if handler.path != "/reset" and self.body is not None:
            return send_json(handler, 200, self.body)   # the bytes as given, JSON or not
        super().handle(handler, body)

    def answer(self, path, body):
        if path == "/reset":
            return {"episode_id": "e", "observation": [{"role": "user", "content": "Click OK."}]}
        return {"observation": [{"role": "user", "content": [{"type": "image", "image": self.shot()}]}],
                "reward": 0.0, "done": False}


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def episodes(tok, urls, turns=2):
    """One episode per URL, in one lock-step batch (as GRPO runs a group)."""
    it = iter(urls)
    engine = ScriptedEngine(tok, lambda p, s, t: tok("click(1, 2)", add_special_tokens=False)["input_ids"])
    # A generous timeout: the oversized screenshot (7681x4320 PNG) is encoded per request, which takes
    # seconds on a loaded machine; every failure these tests expect comes sooner than a timeout.
    return run_episodes(lambda: HTTPEnv(next(it), timeout_s=30.0, retries=1, backoff_s=0.01),
                        [Example("go", None, "", "", {})] * len(urls), engine, tok, seeds=list(range(len(urls))),
                        max_turns=turns, max_new_tokens=8, max_prompt_length=64)


def test_a_service_that_dies_mid_episode_fails_only_its_episode(tok):
    good, doomed = ShotServer(), ShotServer()
    env = HTTPEnv(doomed.url, timeout_s=2.0, retries=1, backoff_s=0.01)
    env.reset(Example("go", None, "", "", {}))
    doomed.close()                    # the service is gone between two steps
    with pytest.raises(EnvError, match=r"/step unreachable: 2 attempts over [0-9.]+ s \(last: connection failed"):
        env.step("click(1, 2)")
    try:
        eps = episodes(tok, [good.url, doomed.url])
    finally:
        good.close()
    assert not eps[0].failed and eps[0].turns == 2
    assert eps[1].failed and "unreachable" in eps[1].error and sum(eps[1].loss_mask) == 0


@pytest.mark.parametrize("shot, says", [
    (lambda: base64.b64encode(b"not an image at all").decode(), "an image part is not base64 PNG/JPEG"),
    (lambda: "%%%not base64%%%", "an image part is not base64 PNG/JPEG"),
    (lambda: png((7681, 4320)), "7681x4320 pixels is over the limit of 33177600 pixels (7680x4320"),
])
def test_undecodable_or_oversized_screenshots_fail_the_episode_naming_the_limit(tok, shot, says):
    good, bad = ShotServer(), ShotServer(shot=shot)
    try:
        eps = episodes(tok, [bad.url, good.url])
    finally:
        good.close()
        bad.close()
    assert eps[0].failed and says in eps[0].error and "/step message 0" in eps[0].error
    assert not eps[1].failed and eps[1].turns == 2


def test_an_image_over_the_byte_limit_is_refused_before_decoding(tok, monkeypatch):
    monkeypatch.setattr(observations, "MAX_IMAGE_B64_CHARS", 100)
    bad = ShotServer(shot=lambda: png((64, 64)) + "A" * 200)
    try:
        (ep,) = episodes(tok, [bad.url])
    finally:
        bad.close()
    assert ep.failed and "base64 characters, over the limit of 100 (MAX_IMAGE_B64_CHARS" in ep.error


def test_a_non_json_step_reply_fails_the_episode_after_retries(tok):
    good, bad = ShotServer(), ShotServer(body=b"<html>502 Bad Gateway</html>")
    try:
        eps = episodes(tok, [good.url, bad.url])
    finally:
        good.close()
        bad.close()
    assert not eps[0].failed
    assert eps[1].failed and "/step gave no valid reply: 2 attempts over" in eps[1].error and "the reply is not JSON" in eps[1].error
