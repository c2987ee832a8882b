"""Screenshot observations through the HTTP environment: image parts in the protocol's JSON, their
tokens in the episode, the loss mask on the policy's tokens only, and rollout.max_images_per_episode."""

from __future__ import annotations

import base64
import hashlib
import io
import json

import pytest

from conftest import JSONService
from trainfit.envs import HTTPEnv, run_episodes, transcript_record
from trainfit.rollout.base import Completion
from trainfit.tasks import Example
from trainfit.models.images import load_processor
from trainfit.config import ModelConfig
from trainfit.models.vlm_preset import build_vlm_tokenizer


def png(colour, size):
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, format="PNG")
    return buf.getvalue()


SHOTS = [png((200, 0, 0), (96, 64)), png((0, 0, 200), (64, 64))]   # 6 and 4 image tokens on vlm-tiny


class ScreenServer(JSONService):
    """Opens with a text task; step k answers with screenshot k (one image part after a text part),
    done at step `done_at` with reward 1."""

    def __init__(self, done_at: int):
        self.done_at, self.requests = done_at, []
        super().__init__()

    def answer(self, path, body):
        self.requests.append((path, body))
        if path == "/reset":
            return {"episode_id": "e1", "observation": [{"role": "user", "content": "Close the window."}]}
        if path == "/step":
            k = body["step"]
            if k >= self.done_at:
                return {"observation": [], "reward": 1.0, "done": True}
            shot = base64.b64encode(SHOTS[(k - 1) % len(SHOTS)]).decode()
            return {"observation": [{"role": "user", "content": [{"type": "text", "text": "Screen:"},
                                                                 {"type": "image", "image": shot}]}],
                    "reward": 0.0, "done": False}
        return {}


class RecordingEngine:
    """Replies with fixed text each turn; records the prompts and images it was given."""

    def __init__(self, tok):
        self.tok, self.calls = tok, []

    def generate(self, prompts, *, greedy=False, seeds=None, max_new_tokens=None, batch_size=None,
                 logprobs=False, temperature=None, images=None):
        self.calls.append({"prompts": [list(p) for p in prompts], "images": images})
        ids = self.tok(f"click {len(self.calls)}", add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        return [Completion(list(ids), self.tok.decode(ids, skip_special_tokens=True), True) for _ in prompts]


@pytest.fixture(scope="module")
def vision():
    tok = build_vlm_tokenizer()
    return tok, load_processor(ModelConfig(name="preset:vlm-tiny"), tok)


def episode(server, tok, proc, max_turns, max_images=0):
    engine = RecordingEngine(tok)
    eps = run_episodes(lambda: HTTPEnv(server.url, timeout_s=5.0, retries=0), [Example("go", None, "", "", {})],
                       engine, tok, seeds=[0], max_turns=max_turns, max_new_tokens=16, max_prompt_length=128,
                       max_observation_tokens=32, processor=proc, max_images=max_images)
    return eps[0], engine


def policy_spans(ep):
    """[start, end) of each policy segment (segments are run-length [source, n])."""
    out, at = [], 0
    for source, n in ep.segments:
        if source == "policy":
            out.append((at, at + n))
        at += n
    return out


def sources(ep):
    """The source of each token of the final sequence (segments are run-length [source, n])."""
    return [src for src, n in ep.segments for _ in range(n)]


def test_two_turn_episode_with_one_screenshot(vision):
    tok, proc = vision
    server = ScreenServer(done_at=2)
    try:
        ep, engine = episode(server, tok, proc, max_turns=2)
    finally:
        server.close()
    assert not ep.failed and ep.done and ep.reward == 1.0 and ep.turns == 2
    ids, mask = ep.input_ids, ep.loss_mask
    pad = proc.image_token_id
    start, end = (tok.convert_tokens_to_ids(t) for t in (proc.start_token, proc.end_token))
    # The screenshot (96 x 64) is 6 pad tokens between its markers, inside the env's observation,
    # after the first policy turn and before the second.
    (p1, e1), (p2, e2) = policy_spans(ep)
    where = [i for i, t in enumerate(ids) if t == pad]
    assert len(where) == proc.tokens_for(64, 96) == 6 and where == list(range(where[0], where[0] + 6))
    assert ids[where[0] - 1] == start and ids[where[-1] + 1] == end
    assert e1 <= where[0] - 1 and where[-1] + 1 < p2
    # The loss mask is 1 exactly at the policy's sampled tokens (both turns, as the engine gave them).
    reply = lambda k: tok(f"click {k}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # noqa: E731
    assert ids[p1:e1] == reply(1) and ids[p2:e2] == reply(2)
    assert [i for i, m in enumerate(mask) if m] == list(range(p1, e1)) + list(range(p2, e2))
    # The engine's second turn saw the episode so far, the screenshot's tokens and the image itself.
    assert engine.calls[0]["images"] is None and engine.calls[1]["prompts"][0] == ids[:p2]
    (shown,) = engine.calls[1]["images"]
    assert len(shown) == 1 and shown[0].size == (96, 64) and ep.images == shown
    # The transcript records the image's hash, not its bytes.
    rec = json.dumps(transcript_record(1, ep))
    assert hashlib.sha256(SHOTS[0]).hexdigest() in rec and base64.b64encode(SHOTS[0]).decode()[:40] not in rec
    assert ep.messages[2]["content"] == "Screen:<image>"


def test_image_budget_drops_the_oldest_screenshot(vision):
    tok, proc = vision
    server = ScreenServer(done_at=3)   # two screenshots (6 then 4 tokens), then done
    try:
        ep, engine = episode(server, tok, proc, max_turns=3, max_images=1)
        full, _ = episode(server, tok, proc, max_turns=3, max_images=0)
    finally:
        server.close()
    pad = proc.image_token_id
    assert full.input_ids.count(pad) == 10 and len(full.images) == 2 and "images_dropped" not in full.info
    # Budget 1: the first (red, 96 x 64) screenshot's 6 tokens and 2 markers are gone, the second stays.
    assert ep.input_ids.count(pad) == 4 and ep.info["images_dropped"] == 1
    assert [im.size for im in ep.images] == [(64, 64)] and ep.images[0].getpixel((0, 0)) == (0, 0, 200)
    assert len(ep.input_ids) == len(full.input_ids) - 8 == sum(n for _, n in ep.segments)
    # Only environment tokens were removed: the policy's tokens are those of the full episode.
    assert [t for t, src in zip(ep.input_ids, sources(ep)) if src == "policy"] == \
        [t for t, m in zip(full.input_ids, full.loss_mask) if m]
    # The third turn was generated with only the kept screenshot.
    (shown,) = engine.calls[2]["images"]
    assert len(shown) == 1 and engine.calls[2]["prompts"][0].count(pad) == 4
    # Training rows: turns 1-2 sealed with the red screenshot they saw (the context turn 2 was sampled
    # in, then its tokens), turn 3 in the final sequence; every policy token carries loss exactly once.
    first, last = ep.rows()
    ctx2 = engine.calls[1]["prompts"][0]
    (p1, e1), _, _ = policy_spans(full)
    assert first.input_ids[:len(ctx2)] == ctx2 and len(first.input_ids) > len(ctx2)
    assert [i for i, m in enumerate(first.loss_mask) if m] == list(range(p1, e1)) + list(range(len(ctx2), len(first.input_ids)))
    assert [im.size for im in first.images] == [(96, 64)] and first.input_ids.count(pad) == 6
    assert last.input_ids == ep.input_ids and last.images == ep.images
    assert last.input_ids[:len(engine.calls[2]["prompts"][0])] == engine.calls[2]["prompts"][0]
    assert [i for i, m in enumerate(last.loss_mask) if m] == list(range(len(engine.calls[2]["prompts"][0]),
                                                                         len(last.input_ids)))
    trained = [t for row in (first, last) for t, m in zip(row.input_ids, row.loss_mask) if m]
    assert trained == [t for t, m in zip(full.input_ids, full.loss_mask) if m]
    assert ep.policy_tokens() == sum(full.loss_mask) and transcript_record(1, ep)["training_rows"] == 2
    assert len(transcript_record(1, ep)["messages"]) == 6


def test_grpo_step_on_screenshot_episodes(tmp_path):
    """GRPO on preset:vlm-tiny against the screenshot server: the hf engine generates turn 2 with the
    screenshot, the training forward gets it, the loss is finite and transcripts hold its hash."""
    import torch
    from rich.console import Console

    from conftest import tiny_config
    from trainfit.models.policy import unwrap
    from trainfit.train.faults import Faults
    from trainfit.train.loop import train_stage
    from trainfit.train.report import read_metrics
    from trainfit.train.run import build_stage

    server = ScreenServer(done_at=3)
    cfg = tiny_config(tmp_path, "grpo", **{"model.name": "preset:vlm-tiny", "env.type": "http", "env.url": server.url,
                                          "rollout.max_turns": 3, "rollout.max_images_per_episode": 1,
                                          "rollout.max_new_tokens": 4, "grpo.num_generations": 2,
                                          "train.global_batch_size": 2, "train.micro_batch_size": 2,
                                          "train.max_steps": 1, "task.num_eval": 1, "grpo.beta": 0.1})
    loaded, stage, _ = build_stage(cfg, tmp_path / "stage")
    pixels = []
    hook = unwrap(loaded.model, peft=True).register_forward_pre_hook(
        lambda m, a, kw: pixels.append((kw.get("pixel_values") is not None or kw.get("mm_encoder_outputs") is not None,
                                        torch.is_grad_enabled())),
        with_kwargs=True)
    try:
        train_stage(cfg, loaded, stage, tmp_path / "stage", resume=False, console=Console(quiet=True),
                    faults=Faults(), save_final=lambda path, state_dict=None: path)
    finally:
        hook.remove()
        server.close()
    (m,) = [m for m in read_metrics(tmp_path / "stage" / "metrics.jsonl") if "loss" in m]
    assert m["env_failed"] == 0.0 and m["loss"] == m["loss"]   # finite, not NaN
    assert any(p and not grad for p, grad in pixels)   # generation (turns 2, 3) with the screenshot
    assert any(p and grad for p, grad in pixels)       # the training forward with it (beta > 0: never skipped)
    rec = json.loads((tmp_path / "stage" / "transcripts.jsonl").read_text().splitlines()[0])
    hashes = [h for msg in rec["messages"] for h in msg.get("image_hashes", [])]
    assert hashes == [hashlib.sha256(s).hexdigest() for s in SHOTS] and rec["info"]["images_dropped"] == 1


def test_every_turn_trains_under_the_context_it_was_sampled_in(vision):
    """rollout.max_images_per_episode=1 over three turns with two screenshots: the training forward of
    each of the episode's rows (Episode.rows) gives every policy token the log-prob the hf engine
    sampled it with (train.device=cpu); scoring turns 1-2 in the final sequence, without the screenshot
    turn 2 saw, would not."""
    import torch

    from trainfit.config import PeftConfig, RolloutConfig
    from trainfit.data.image_examples import image_inputs
    from trainfit.models.logprobs import sequence_logprobs
    from trainfit.models.policy import load_policy
    from trainfit.rollout.hf import HFEngine

    policy = load_policy(ModelConfig(name="preset:vlm-tiny"), PeftConfig(), torch.device("cpu"))
    tok, proc, model = policy.tokenizer, policy.processor, policy.model.eval()
    hf = HFEngine(model, tok, RolloutConfig(max_new_tokens=4, temperature=1.0))
    hf.processor = proc
    server = ScreenServer(done_at=3)
    try:
        (ep,) = run_episodes(lambda: HTTPEnv(server.url, timeout_s=5.0, retries=0), [Example("go", None, "", "", {})],
                             hf, tok, seeds=[7], max_turns=3, max_new_tokens=4, max_prompt_length=128,
                             max_observation_tokens=32, processor=proc, max_images=1, logprobs=True)
    finally:
        server.close()
    assert not ep.failed and ep.turns == 3 and ep.info["images_dropped"] == 1

    def trainer_logprobs(rows):
        samples = [{"input_ids": r.input_ids, "loss_mask": r.loss_mask, "images": r.images} for r in rows]
        with torch.no_grad():
            logp, mask, _ = sequence_logprobs(model, samples, tok.pad_token_id, torch.device("cpu"), 1.0,
                                              inputs=image_inputs(samples, proc, torch.device("cpu")))
        return logp[mask]                                                                      # [policy tokens]

    rows = ep.rows()
    assert len(rows) == 2 and sum(sum(r.loss_mask) for r in rows) == ep.policy_tokens()
    engine = torch.tensor([x for r in rows for x in r.logprobs])
    torch.testing.assert_close(trainer_logprobs(rows), engine, atol=1e-4, rtol=1e-4)
    # The final sequence alone, with every turn's loss restored: turn 2 scored without its screenshot.
    whole = rows[-1].__class__(rows[-1].input_ids, [int(s == "policy") for s in sources(ep)], rows[-1].images)
    assert (trainer_logprobs([whole]) - engine).abs().max() > 1e-2


def test_the_episode_budget_counts_the_sequence_after_the_drop(vision):
    """rollout.max_episode_tokens is checked on the sequence the image budget leaves: an episode whose
    kept context fits goes on, even when the dropped screenshot and the new one would not fit together."""
    tok, proc = vision
    server = ScreenServer(done_at=3)
    try:
        unbounded, _ = episode(server, tok, proc, max_turns=3, max_images=1)
        engine = RecordingEngine(tok)
        # Room for the final, kept context and its last turn, 8 tokens short of it with the red screenshot kept.
        (ep,) = run_episodes(lambda: HTTPEnv(server.url, timeout_s=5.0, retries=0), [Example("go", None, "", "", {})],
                             engine, tok, seeds=[0], max_turns=3, max_new_tokens=16, max_prompt_length=128,
                             max_observation_tokens=32, processor=proc, max_images=1,
                             max_episode_tokens=len(unbounded.input_ids))
    finally:
        server.close()
    assert unbounded.done and unbounded.info["images_dropped"] == 1
    assert ep.done and ep.turns == 3 and ep.info["end"] == "done" and ep.input_ids == unbounded.input_ids
