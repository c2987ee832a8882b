"""GRPO end to end with `rollout.engine: vllm` (colocated, in this process): every rollout round syncs
the trained weights into vLLM, the sync check proves vLLM samples from them, and after training the
served policy follows the trainer. Runs with vLLM's CPU build (`make test-vllm`); skips without vllm."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from rich.console import Console

from conftest import tiny_config
from trainfit.models.save import save_pretrained
from trainfit.rollout.sync_check import check_sync
from trainfit.train.faults import Faults
from trainfit.train.loop import train_stage
from trainfit.train.report import read_metrics
from trainfit.train.run import build_stage

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason=(
    "needs vllm: `make test-vllm` builds .venv-vllm with vLLM's CPU build and runs these (see README)"))

CPU = torch.device("cpu")
QUIET = Console(file=open("/dev/null", "w"))
REWARD = str(Path(__file__).parent / "data" / "rewards_for_tests.py") + ":length_reward"
PROBE = [[19, 13, 20]]


def run_grpo(tmp_path, **overrides):
    """Two GRPO steps on preset:small (head_dim 32: vLLM's attention kernels need >= 32) in fp32 on CPU."""
    from trainfit.rollout.vllm_engine import _on_cpu

    if not _on_cpu():
        pytest.skip("the CPU run; on a GPU the engine tests in test_vllm_engine.py cover vLLM")
    cfg = tiny_config(tmp_path, "grpo", **{
        "model.name": "preset:small", "rollout.engine": "vllm", "rollout.max_new_tokens": 6,
        "task.rewards": f"[{REWARD}]", "task.num_eval": 0, "train.max_steps": 2, "train.lr": 0.05,
        "rollout.sync_tolerance": 1e-3, **overrides})
    stage_dir = tmp_path / "stage"
    loaded, stage, _ = build_stage(cfg, stage_dir)
    engine = stage.engine
    assert engine.name == "vllm" and not engine.shares_weights
    before = {n: p.detach().clone() for n, p in loaded.model.named_parameters() if p.requires_grad}
    train_stage(cfg, loaded, stage, stage_dir, resume=False, console=QUIET, faults=Faults(),
                save_final=lambda p: save_pretrained(loaded, p, base_dir=stage_dir / "base"))
    steps = [m for m in read_metrics(stage_dir / "metrics.jsonl") if m["kind"] == "train"]
    assert [m["step"] for m in steps] == [1, 2]
    # Every rollout round (sync_check: auto) came from weights whose log-probs matched the trainer's.
    assert all(m["sync_logp_diff"] < 1e-3 for m in steps)
    changed = [n for n, p in loaded.model.named_parameters() if n in before and not torch.equal(before[n], p)]
    assert changed, "the two steps trained nothing"

    # After the last optimizer step vLLM still serves the step-2 rollout weights; one more sync and its
    # log-probs move with the training and match the trainer's on the probe batch.
    old = engine.generate(PROBE, seeds=[0], max_new_tokens=8, logprobs=True, temperature=1.0)[0]
    engine.sync(loaded.model)
    new = engine.generate(PROBE, seeds=[0], max_new_tokens=8, logprobs=True, temperature=1.0)[0]
    if new.token_ids == old.token_ids:
        assert max(abs(a - b) for a, b in zip(new.logprobs, old.logprobs)) > 1e-3
    after = check_sync(engine, loaded.model, loaded.tokenizer, CPU, n_prompts=3, tolerance=1e-3)
    assert after.mean_abs_diff < 1e-3 and after.tokens > 0
    engine.close()
    return engine


def test_lora_grpo_with_the_vllm_engine_follows_the_adapter(tmp_path):
    engine = run_grpo(tmp_path, **{"peft.method": "lora", "peft.r": 4})
    # Two rollout rounds and the final push: three adapters, each under a new name and id.
    assert engine.lora.lora_name == "trainfit-v3" and engine.lora.lora_int_id == 3


def test_full_grpo_with_the_vllm_engine_follows_the_weights(tmp_path):
    engine = run_grpo(tmp_path)
    assert engine.lora is None
