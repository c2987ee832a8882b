"""rollout.mode=async with multi-turn environments on the CPU (train.device=cpu): the tool-using agent example
and cua_tiny's GRPO stage (screenshots over HTTP, grpo.num_iterations=4) train with their episodes run by the
rollout worker, the HTTP service answering each request after a delay while the trainer trains."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch
from rich.console import Console

from report_helpers import ScreenService
from trainfit.config import expand_stages, load_config
from trainfit.train.faults import Faults
from trainfit.train.loop import train_stage
from trainfit.train.report import read_metrics
from trainfit.train.run import build_stage

ROOT = Path(__file__).resolve().parents[1]
QUIET = Console(file=open("/dev/null", "w"))


def train(cfg, stage_dir: Path, on_loss=None):
    """Train the stage in this process; returns (weights before, weights after, train rows, the stage)."""
    loaded, stage, _ = build_stage(cfg, stage_dir)
    before = {n: p.detach().clone() for n, p in loaded.model.named_parameters() if p.requires_grad}
    if on_loss is not None:
        loss = stage.loss
        stage.loss = lambda *a, **k: on_loss(loss, *a, **k)
    train_stage(cfg, loaded, stage, stage_dir, resume=False, console=QUIET, faults=Faults(),
                save_final=lambda path, state_dict=None: path)
    after = {n: p.detach().clone() for n, p in loaded.model.named_parameters() if p.requires_grad}
    rows = [m for m in read_metrics(stage_dir / "metrics.jsonl") if m["kind"] == "train"]
    return before, after, rows, stage


def test_agent_tools_example_trains_async(tmp_path):
    # examples/agent_tools.yaml's GRPO stage (calculator tool, 2 turns) as shipped, cut to 3 small steps.
    cfg = expand_stages(load_config(ROOT / "examples" / "agent_tools.yaml", [
        f"run_dir={tmp_path / 'run'}", "stages.1.train.max_steps=3", "stages.1.train.eval_every=0", "task.num_eval=0",
        "stages.1.train.global_batch_size=8", "stages.1.train.micro_batch_size=8", "stages.1.grpo.num_generations=4",
        "rollout.max_new_tokens=8", "logging.progress=false", "logging.save_transcripts=2",
        "stages.1.rollout.mode=async", "stages.1.rollout.max_staleness=1", "stages.1.rollout.sync_check=always"]))[1]
    _, _, rows, _ = train(cfg, tmp_path / "run")
    assert [m["policy_version"] for m in rows] == [0.0, 0.0, 1.0]
    assert [m["staleness_max"] for m in rows] == [0.0, 1.0, 1.0]
    assert all(m["env_failed"] == 0.0 and m["loss"] == m["loss"] for m in rows)
    # the worker's copy of the weights sampled like the trainer's at each push
    assert all(m["sync_logp_diff"] < 1e-4 for m in rows[1:])
    # preset:tiny rarely calls the tool right, so the rewards (and the update) may all be 0; the policy's
    # turns were sampled and counted all the same
    assert all(m["completion_len"] > 0 and m["tokens"] > 0 for m in rows)
    # the episodes were the worker's: their transcripts name the step that trained them
    import json

    steps = {json.loads(x)["step"] for x in (tmp_path / "run" / "transcripts.jsonl").read_text().splitlines()}
    assert steps == {1, 2, 3}


class SlowScreens(ScreenService):
    """ScreenService answering every request after `delay` seconds; it keeps when each was being served. A
    step's reward is 0.1 x (the action's length mod 5), so a random policy's episodes differ in reward."""

    def __init__(self, delay: float):
        self.delay, self.served, self.lock = delay, [], threading.Lock()
        super().__init__()

    def handle(self, handler, body):
        began = time.monotonic()
        time.sleep(self.delay)
        super().handle(handler, body)
        with self.lock:
            self.served.append((began, time.monotonic()))

    def answer(self, path, body):
        out = super().answer(path, body)
        if path == "/step":
            out["reward"] = 0.1 * (len(body.get("action", "")) % 5)
        return out


def test_cua_tiny_grpo_stage_trains_async_against_a_slow_service(tmp_path):
    # cua_tiny's GRPO stage as shipped (preset:vlm-tiny, screenshots, reinforce_pp, beta 0.05, 4 optimizer
    # steps per rollout), 2 rollouts of 8 episodes, against a stand-in for the MiniWoB service that takes
    # 50 ms over every request.
    service = SlowScreens(delay=0.05)
    try:
        (_, cfg) = expand_stages(load_config(ROOT / "examples" / "cua_tiny.yaml", [
            f"run_dir={tmp_path / 'run'}", f"env.url={service.url}", "env.retries=0", "task.num_eval=0",
            f"task.path={ROOT / 'examples/data/cua_tiny_tasks.jsonl'}", "rollout.max_turns=2",
            "rollout.max_new_tokens=8", "logging.progress=false", "logging.save_transcripts=0",
            "stages.1.train.max_steps=8", "stages.1.train.eval_every=0", "stages.1.train.global_batch_size=8",
            "stages.1.train.micro_batch_size=8", "stages.1.grpo.num_generations=4",
            "stages.1.rollout.mode=async", "rollout.max_staleness=1", "rollout.sync_check=never"]))
        assert cfg.grpo.num_iterations == 4 and cfg.env.type == "http" and cfg.rollout.max_images_per_episode == 1
        losses: list[tuple[float, float]] = []

        def timed(loss, *a, **k):
            began = time.monotonic()
            out = loss(*a, **k)
            losses.append((began, time.monotonic()))
            return out

        before, after, rows, stage = train(cfg, tmp_path / "run", on_loss=timed)
    finally:
        service.close()
    # Rollout 0 (steps 1-4) by version 0, rollout 1 (steps 5-8) by version 0 too: one rollout stale, k = 1.
    assert [m["policy_version"] for m in rows] == [0.0] * 8
    assert [m["staleness_max"] for m in rows] == [0.0] * 4 + [1.0] * 4
    assert max(m["staleness_max"] for m in rows) <= cfg.rollout.max_staleness
    assert all(m["env_failed"] == 0.0 and m["loss"] == m["loss"] for m in rows)
    assert "iw_mean" in rows[4] and "iw_mean" not in rows[0]
    assert any(not torch.equal(before[n], after[n]) for n in before)
    # Rollout 1's episodes were played while the trainer trained on rollout 0: some request to the service
    # was being served during a training forward/backward.
    assert any(a0 < l1 and l0 < a1 for a0, a1 in service.served for l0, l1 in losses)
    assert stage.worker.most_queued <= 1
