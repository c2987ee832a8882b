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
from trainfit.rollout.base import StaleEngineError
from trainfit.rollout.sync_check import check_sync
from trainfit.train.faults import Faults
from trainfit.train.loop import train_stage
from trainfit.train.report import read_metrics
from trainfit.train.run import build_stage

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason=(
    "needs vllm: `make test-vllm` builds .venv-vllm with vLLM's CPU build and runs these (see docs/serve.md)"))

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


def test_async_grpo_samples_with_the_stages_vllm_instance_and_lends_it_to_evaluations(tmp_path, monkeypatch):
    """rollout.mode=async, k=1, with the colocated vLLM engine (thread worker): the worker samples with the
    stage's one instance, each push is probed there, and an evaluation mid-run borrows it between rollouts,
    sampling the trainer's weights while the worker waits."""
    from trainfit.rollout.vllm_engine import _on_cpu
    from trainfit.train import grpo as grpo_module

    if not _on_cpu():
        pytest.skip("the CPU run; on a GPU the engine tests in test_vllm_engine.py cover vLLM")
    cfg = tiny_config(tmp_path, "grpo", **{
        "model.name": "preset:small", "rollout.engine": "vllm", "rollout.max_new_tokens": 6,
        "task.rewards": f"[{REWARD}]", "task.num_eval": 4, "train.max_steps": 4, "train.eval_every": 2,
        "train.lr": 0.05, "rollout.sync_tolerance": 1e-3, "rollout.mode": "async", "rollout.max_staleness": 1,
        "peft.method": "lora", "peft.r": 4})
    stage_dir = tmp_path / "stage"
    loaded, stage, _ = build_stage(cfg, stage_dir)
    seen, lent = [], []
    accuracy = grpo_module.task_accuracy

    def evaluated(engine, *args, **kw):   # inside the evaluation: the engine holds the trainer's weights now
        worker = stage.worker
        if worker is not None and not worker.closed:
            assert worker.engine is engine is stage.engine and worker._lent and not worker._busy
            lent.append(len(seen))
        seen.append(check_sync(engine, loaded.model, loaded.tokenizer, CPU, n_prompts=2, tolerance=1e-3).mean_abs_diff)
        return accuracy(engine, *args, **kw)

    monkeypatch.setattr(grpo_module, "task_accuracy", evaluated)
    train_stage(cfg, loaded, stage, stage_dir, resume=False, console=QUIET, faults=Faults(),
                save_final=lambda p: save_pretrained(loaded, p, base_dir=stage_dir / "base"))
    rows = read_metrics(stage_dir / "metrics.jsonl")
    steps = [m for m in rows if m["kind"] == "train"]
    assert [m["staleness_max"] for m in steps] == [0.0, 1.0, 1.0, 1.0]
    # every push, the first at the worker's start included, reached the stage's vLLM instance (the probe
    # samples there against the trainer's weights)
    assert all(m["sync_logp_diff"] < 1e-3 for m in steps)
    assert len(seen) == len([m for m in rows if m["kind"] == "eval"]) == 3   # start, step 2, the end
    assert lent == [1]   # the mid-run one borrowed the worker's engine (before it started; after it closed)
    assert all(d < 1e-3 for d in seen)
    assert stage.engine.llm is not None   # the worker left the stage's instance open for the last evaluation
    stage.engine.close()


def test_a_borrowed_vllm_engine_is_given_back_with_the_workers_weights(tmp_path):
    """An evaluation pushes the trainer's weights into the shared vLLM instance; handing it back puts the
    worker's copy (the version it samples next) back in."""
    from trainfit.rollout.vllm_engine import _on_cpu
    from trainfit.train.rollout_batch import current_engine

    if not _on_cpu():
        pytest.skip("the CPU run")
    cfg = tiny_config(tmp_path, "grpo", **{
        "model.name": "preset:small", "rollout.engine": "vllm", "rollout.max_new_tokens": 6,
        "task.rewards": f"[{REWARD}]", "task.num_eval": 4, "train.max_steps": 4, "rollout.sync_tolerance": 1e-3,
        "rollout.mode": "async", "rollout.max_staleness": 1})
    loaded, stage, _ = build_stage(cfg, tmp_path / "stage")
    stage.prepare(0)   # starts the worker (its copy: version 0) and takes rollout 0
    worker = stage.worker
    with torch.no_grad():   # the trainer moves on: its weights now differ from the copy's
        for p in loaded.model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    with worker.borrowed_engine() as lent:
        assert lent
        with current_engine(stage.engine, loaded.model, loaded.tokenizer, CPU, cfg, sleep_after=False):
            assert check_sync(stage.engine, loaded.model, loaded.tokenizer, CPU, n_prompts=2,
                              tolerance=1e-3).mean_abs_diff < 1e-3
    back = check_sync(stage.engine, worker.model, loaded.tokenizer, CPU, n_prompts=2, tolerance=1e-3)
    assert back.mean_abs_diff < 1e-3
    with pytest.raises(StaleEngineError):   # and no longer the trainer's
        check_sync(stage.engine, loaded.model, loaded.tokenizer, CPU, n_prompts=2, tolerance=1e-3)
    stage.close()
    stage.engine.close()
