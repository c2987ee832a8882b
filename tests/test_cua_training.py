"""Screenshot episodes from the MiniWoB++ service through the trainer (make test-cua): the hf engine on
preset:vlm-tiny, a GRPO step, the openai engine against `trainfit serve`, expert SFT rows, and the CLI
service's shutdown."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from trainfit.envs import HTTPEnv
from trainfit.envs.cua_actions import parse_action

pytestmark = pytest.mark.cua

from cua_helpers import KEY, expert, row, served  # noqa: E402,F401
from trainfit.envs.miniwob_service import MiniWoBService  # noqa: E402
from trainfit.envs.service_http import EnvServer  # noqa: E402


class ExpertThroughHF:
    """Each turn runs the trainer's hf engine on the episode so far with its kept screenshots (the VLM's
    forward checks that the image tokens match the images), then takes the expert's action: a
    random-init policy's own text would be malformed and never reach a second screenshot."""

    def __init__(self, hf, tok, server, envs):
        self.hf, self.tok, self.server, self.envs, self.calls = hf, tok, server, envs, []

    def generate(self, prompts, *, images=None, seeds=None, max_new_tokens=None, logprobs=False, greedy=False,
                 **kw):
        from trainfit.rollout.base import Completion

        sampled = self.hf.generate(prompts, images=images, seeds=seeds, max_new_tokens=2)
        self.calls.append({"prompts": [list(p) for p in prompts], "images": images, "sampled": sampled})
        out = []
        for env in self.envs:
            ids = self.tok(expert(self.server, env), add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            out.append(Completion(ids, self.tok.decode(ids, skip_special_tokens=True), True))
        return out


def test_three_turn_screenshot_episode_through_the_hf_engine(served, monkeypatch):
    """enter-text on preset:vlm-tiny (train.device=cpu): click the box, type, press Submit; a screenshot
    opens the episode and follows turns 1 and 2; rollout.max_images_per_episode=2 drops the first."""
    import torch

    from trainfit.config import ModelConfig, PeftConfig, RolloutConfig
    from trainfit.envs import run_episodes
    from trainfit.models.policy import load_policy
    from trainfit.rollout.hf import HFEngine

    server, service, _ = served
    monkeypatch.setenv("CUA_TEST_KEY", KEY)
    policy = load_policy(ModelConfig(name="preset:vlm-tiny"), PeftConfig(), torch.device("cpu"))
    tok, proc = policy.tokenizer, policy.processor
    hf = HFEngine(policy.model, tok, RolloutConfig(max_new_tokens=2))
    hf.processor = proc
    seen = []
    hook = policy.model.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw.get("pixel_values") is not None or kw.get("mm_encoder_outputs") is not None),
        with_kwargs=True)
    envs = []

    def make_env():
        envs.append(HTTPEnv(server.url, api_key_env="CUA_TEST_KEY", timeout_s=60.0, retries=0))
        return envs[-1]

    engine = ExpertThroughHF(hf, tok, server, envs)
    try:
        (ep,) = run_episodes(make_env, [row("enter-text", 21)], engine, tok, seeds=[0], max_turns=3,
                             max_new_tokens=16, max_prompt_length=256, processor=proc, max_images=2)
    finally:
        hook.remove()
    assert not ep.failed and ep.done and ep.turns == 3
    assert ep.reward == 1.0 and ep.info["success"]                   # MiniWoB's reward for the episode
    pad, n = proc.image_token_id, proc.tokens_for(210, 160)
    start, end = (tok.convert_tokens_to_ids(t) for t in (proc.start_token, proc.end_token))
    # Three screenshots were shown (reset, after turn 1, after turn 2); the budget kept the last two.
    assert ep.info["images_dropped"] == 1 and len(ep.images) == 2 and [im.size for im in ep.images] == [(160, 210)] * 2
    ids, mask = ep.input_ids, ep.loss_mask
    assert ids.count(pad) == 2 * n
    spans, at = {}, 0
    for source, k in ep.segments:
        spans.setdefault(source, []).append((at, at + k))
        at += k
    (p1, p2, p3) = spans["policy"]
    pads = [i for i, t in enumerate(ids) if t == pad]
    # Each kept screenshot is n pads between its markers, inside the env's reply after turns 1 and 2.
    for (lo, hi), block in zip([(p1[1], p2[0]), (p2[1], p3[0])], (pads[:n], pads[n:])):
        assert block == list(range(block[0], block[0] + n)) and lo < block[0] and block[-1] < hi
        assert ids[block[0] - 1] == start and ids[block[-1] + 1] == end
    assert ids[:p1[0]].count(pad) == 0                                # the opening screenshot is gone
    # The loss is exactly the policy's action tokens (the expert's actions as the engine gave them), each
    # under the context it was sampled in: turns 1 and 2 saw the opening screenshot the budget dropped, so
    # they train in the row sealed before the drop; the final sequence trains turn 3.
    acts = [m["content"] for m in ep.messages if m["role"] == "assistant"]
    assert [parse_action(a, 160, 210).kind for a in acts] == ["click", "type", "click"]
    for (lo, hi), a in zip((p1, p2, p3), acts):
        assert ids[lo:hi] == tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert [i for i, m in enumerate(mask) if m] == list(range(*p3))
    first, last = ep.rows()
    c0, c1 = engine.calls[0]["prompts"][0], engine.calls[1]["prompts"][0]
    t1, t2 = ids[p1[0]:p1[1]], ids[p2[0]:p2[1]]
    assert first.input_ids == c1 + t2 and first.images == engine.calls[1]["images"][0] and len(first.images) == 2
    assert first.input_ids[len(c0):len(c0) + len(t1)] == t1
    assert [i for i, m in enumerate(first.loss_mask) if m] == \
        list(range(len(c0), len(c0) + len(t1))) + list(range(len(c1), len(first.input_ids)))
    assert last.input_ids == ids and ep.policy_tokens() == len(t1) + len(t2) + p3[1] - p3[0]
    # The hf engine generated every turn with the screenshots kept at that point: 1, 2, then 2.
    assert [len(c["images"][0]) if c["images"] else 0 for c in engine.calls] == [1, 2, 2]
    assert engine.calls[2]["prompts"][0] == ids[:p3[0]] and engine.calls[2]["images"][0] == ep.images
    assert any(seen) and all(len(c["sampled"]) == 1 for c in engine.calls)


def test_grpo_step_against_the_service(served, tmp_path):
    """One GRPO step of preset:vlm-tiny (train.device=cpu) on click-button through the trainer: every
    episode opens with a MiniWoB screenshot the hf engine and the training forward see, none fails,
    and each episode's reward is what the service gave (penalties for the random policy's text, or
    MiniWoB's reward when it happens to act)."""
    from rich.console import Console

    from conftest import tiny_config
    from trainfit.train.faults import Faults
    from trainfit.train.loop import train_stage
    from trainfit.train.report import read_metrics
    from trainfit.train.run import build_stage

    _, _, pool = served
    service = MiniWoBService(["click-button"], pool, penalty=-0.1)
    server = EnvServer(service).start()
    cfg = tiny_config(tmp_path, "grpo", **{"model.name": "preset:vlm-tiny", "env.type": "http", "env.url": server.url,
                                          "rollout.max_turns": 2, "rollout.max_images_per_episode": 1,
                                          "rollout.max_new_tokens": 6, "grpo.num_generations": 2,
                                          "train.global_batch_size": 4, "train.micro_batch_size": 4,
                                          "train.max_steps": 1, "task.num_eval": 1, "grpo.beta": 0.1})
    try:
        loaded, stage, _ = build_stage(cfg, tmp_path / "stage")
        train_stage(cfg, loaded, stage, tmp_path / "stage", resume=False, console=Console(quiet=True),
                    faults=Faults(), save_final=lambda path, state_dict=None: path)
    finally:
        server.stop()
    (m,) = [m for m in read_metrics(tmp_path / "stage" / "metrics.jsonl") if "loss" in m]
    assert m["env_failed"] == 0.0 and m["loss"] == m["loss"]
    recs = [json.loads(line) for line in (tmp_path / "stage" / "transcripts.jsonl").read_text().splitlines()]
    assert len(recs) >= 4
    for r in recs:
        assert len(r["messages"][0]["image_hashes"]) == 1 and "Click on the" in r["messages"][0]["content"]
        invalid = sum(1 for msg in r["messages"][2:] if msg["role"] == "user" and msg["content"].startswith("Invalid"))
        # The episode's reward is the service's: -0.1 per invalid action, plus MiniWoB's (0 unless it ended the task).
        assert r["reward"] + 0.1 * invalid in (pytest.approx(0.0), pytest.approx(1.0), pytest.approx(-1.0))


def test_expert_rows_are_sft_rows_with_their_screenshots(tmp_path):
    """`trainfit env expert` writes successful expert episodes as chat rows whose screenshots load and
    encode for SFT on preset:vlm-tiny: labels exactly on the assistant's actions, one image per screen."""
    from typer.testing import CliRunner

    from trainfit.app.cli import app
    from trainfit.config import ModelConfig
    from trainfit.data.text import IGNORE
    from trainfit.data.image_chat import encode_vlm_messages, mark_base_dirs
    from trainfit.models.images import load_processor
    from trainfit.models.vlm_preset import build_vlm_tokenizer

    r = CliRunner().invoke(app, ["env", "expert", "miniwob", "--tasks", "click-button,enter-text", "--seeds", "0-1",
                                 "--out", str(tmp_path / "sft")])
    assert r.exit_code == 0, r.output
    assert "wrote 4 expert episodes (4 tried)" in " ".join(r.output.split())
    path = tmp_path / "sft" / "rows.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(x["miniwob_task"], x["seed"], x["reward"]) for x in rows] == [
        ("click-button", 0, 1.0), ("click-button", 1, 1.0), ("enter-text", 0, 1.0), ("enter-text", 1, 1.0)]
    tok = build_vlm_tokenizer()
    proc = load_processor(ModelConfig(name="preset:vlm-tiny"), tok)
    for rec in mark_base_dirs(rows, str(path)):
        acts = [m["content"] for m in rec["messages"] if m["role"] == "assistant"]
        item = encode_vlm_messages(rec, tok, proc, max_len=4096)
        # enter-text: 3 actions and 3 screens (opening + after 2 actions); click-button: 1 and 1.
        assert len(item["images"]) == len(acts) == (3 if rec["miniwob_task"] == "enter-text" else 1)
        assert item["input_ids"].count(proc.image_token_id) == len(acts) * proc.tokens_for(210, 160)
        labelled = [t for t, lab in zip(item["input_ids"], item["labels"]) if lab != IGNORE]
        assert tok.decode(labelled, skip_special_tokens=True).replace("\n", "") == "".join(acts)
    r = CliRunner().invoke(app, ["env", "expert", "miniwob", "--tasks", "book-flight", "--out", str(tmp_path / "x")])
    assert r.exit_code == 2


def _descendants(pid: int) -> set[int]:
    """Process ids below `pid` (Linux /proc)."""
    from pathlib import Path

    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def test_the_cli_service_closes_its_browsers_on_sigterm(tmp_path):
    import os
    import re
    import signal
    import subprocess
    import sys

    env = {**os.environ, "SERVE_KEY": KEY}
    proc = subprocess.Popen([sys.executable, "-m", "trainfit.app.cli", "env", "serve", "miniwob", "--tasks", "click-button",
                             "--port", "0", "--pool", "1", "--key-env", "SERVE_KEY"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        line = proc.stdout.readline()
        url = re.search(r"at (http://127\.0\.0\.1:\d+)", line).group(1)
        r = httpx.post(f"{url}/reset", json={"task": {"seed": 1}}, headers={"Authorization": f"Bearer {KEY}"},
                       timeout=60)
        assert r.status_code == 200 and httpx.get(f"{url}/health").json()["pool"]["running"] == 1
        below = _descendants(proc.pid)
        assert below                                   # chromedriver and its Chromium
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while {p for p in below if os.path.exists(f"/proc/{p}")} - _zombies(below) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not ({p for p in below if os.path.exists(f"/proc/{p}")} - _zombies(below))
    finally:
        if proc.poll() is None:
            proc.kill()


def _zombies(pids: set[int]) -> set[int]:
    out = set()
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    out.add(p)
        except OSError:
            pass
    return out


def test_screenshot_episode_through_the_openai_engine_equals_the_hf_engine(served, tmp_path, monkeypatch):
    """The same seeded episodes (click-button, 2 turns, preset:vlm-tiny) sampled by the in-process hf
    engine and by the openai engine against `trainfit serve` of the same weights: the screenshot reaches
    the served model as an image part, and both give the same tokens, so the same actions and rewards."""
    import torch

    from serve_helpers import serve_subprocess
    from trainfit.config import ModelConfig, PeftConfig, RolloutConfig
    from trainfit.envs import run_episodes
    from trainfit.models.policy import load_policy
    from trainfit.models.save import save_pretrained
    from trainfit.rollout.hf import HFEngine
    from trainfit.rollout.openai_engine import OpenAIEngine

    server, _, _ = served
    monkeypatch.setenv("CUA_TEST_KEY", KEY)
    save_pretrained(load_policy(ModelConfig(name="preset:vlm-tiny"), PeftConfig(), torch.device("cpu")), tmp_path / "m")
    local = load_policy(ModelConfig(name=str(tmp_path / "m")), PeftConfig(), torch.device("cpu"))
    tok, proc = local.tokenizer, local.processor

    def episodes(engine):
        return run_episodes(lambda: HTTPEnv(server.url, api_key_env="CUA_TEST_KEY", timeout_s=60.0, retries=0),
                            [row("click-button", 40), row("click-button", 41)], engine, tok, seeds=[7, 8],
                            max_turns=2, max_new_tokens=6, max_prompt_length=256, processor=proc)

    hf = HFEngine(local.model, tok, RolloutConfig(max_new_tokens=6))
    hf.processor = proc
    want = episodes(hf)
    with serve_subprocess(tmp_path / "m", tmp_path / "server.log") as (url, _):
        eng = OpenAIEngine(RolloutConfig(engine="openai", base_url=url, max_new_tokens=6, health_timeout_s=120),
                           tok, workdir=tmp_path)
        try:
            got = episodes(eng)
        finally:
            eng.close()
    for g, w in zip(got, want):
        assert not g.failed and g.turns >= 1 and g.input_ids.count(proc.image_token_id) >= proc.tokens_for(210, 160)
        assert g.input_ids == w.input_ids and g.loss_mask == w.loss_mask and g.reward == w.reward
