"""distributed.rollout_gpus: which GPUs train and which run the async rollout worker (config/devices.py),
the rules around it, and the worker's copy placed on its own device (train/async_rollout.py). CPU tests
(train.device=cpu) unless marked gpu."""

from __future__ import annotations

import pytest
import torch
import yaml
from rich.console import Console
from typer.testing import CliRunner

from conftest import tiny_config
from trainfit.app.cli import app
from trainfit.config import ConfigError, device_split, rollout_device
from trainfit.train.async_rollout import worker_copy
from trainfit.train.faults import Faults
from trainfit.train.loop import train_stage
from trainfit.train.run import build_stage

QUIET = Console(file=open("/dev/null", "w"))
ASYNC_SPLIT = {"rollout.mode": "async", "distributed.num_gpus": 2, "distributed.rollout_gpus": 1,
               "train.device": "auto"}


def test_device_split_gives_the_last_gpus_to_the_worker():
    s = device_split(2, 1)
    assert (s.train, s.rollout, s.separate) == ((0,), (1,), True)
    s = device_split(8, 3)
    assert (s.train, s.rollout) == ((0, 1, 2, 3, 4), (5, 6, 7))
    s = device_split(4, 0)
    assert (s.train, s.rollout, s.separate) == ((0, 1, 2, 3), (), False)
    with pytest.raises(ValueError):
        device_split(2, 2)   # nothing would train
    assert rollout_device(device_split(2, 1), "cuda:0") == "cuda:1"
    assert rollout_device(device_split(1, 0), "cpu") == "cpu"   # no rollout GPU: the trainer's device


def test_rollout_gpus_leave_the_training_world_and_the_batch(tmp_path):
    cfg = tiny_config(tmp_path, "grpo", **ASYNC_SPLIT)
    # 2 GPUs, 1 of them sampling: one training process, which trains the whole global batch of 8.
    assert cfg.world_size == 1 and cfg.engine() == "single"
    assert cfg.batch_plan().per_device_batch == 8
    assert cfg.device_split().rollout == (1,)


def _plan_exit(tmp_path, overrides: dict):
    cfg = tiny_config(tmp_path, "grpo")   # a valid base file; the overrides on the command line break it
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg.model_dump(exclude_defaults=True)))
    return CliRunner().invoke(app, ["plan", str(path), *[f"{k}={v}" for k, v in overrides.items()]])


@pytest.mark.parametrize("overrides, says", [
    ({"distributed.num_gpus": 2, "distributed.rollout_gpus": 1},
     ["distributed.rollout_gpus=1", "rollout.mode=sync", "Set rollout.mode=async"]),
    ({"rollout.mode": "async", "distributed.num_gpus": 2, "distributed.rollout_gpus": 2},
     ["distributed.rollout_gpus=2 leaves no GPU to train", "Set distributed.num_gpus=3"]),
    ({"rollout.mode": "async", "distributed.num_gpus": 4, "distributed.rollout_gpus": 2},
     ["distributed.rollout_gpus=2 with num_gpus=4", "Set distributed.num_gpus=2, rollout_gpus=1"]),
    ({**ASYNC_SPLIT, "train.device": "cpu"}, ["train.device=cpu", "distributed.rollout_gpus=0"]),
    ({**ASYNC_SPLIT, "model.quantization": "4bit", "peft.method": "lora"},
     ["model.quantization=4bit", "Set model.quantization=none, or distributed.rollout_gpus=0"]),
], ids=["needs-async", "none-left", "one-beside-one", "cpu", "quantized"])
def test_rollout_gpu_rules_exit_2_with_the_fix(tmp_path, overrides, says):
    res = _plan_exit(tmp_path, overrides)
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    flat = " ".join(res.output.split())
    for s in says:
        assert s in flat, (s, flat)


def test_four_gpus_one_rolling_out_names_the_split_once(tmp_path):
    with pytest.raises(ConfigError) as e:
        tiny_config(tmp_path, "grpo", **{**ASYNC_SPLIT, "distributed.num_gpus": 4, "train.global_batch_size": 12})
    # the world of 3 training GPUs is said by the split rule, not again by tf.async_single
    assert "rollout.mode=async trains in one process" not in str(e.value)
    assert "one rollout GPU beside one training GPU" in str(e.value)


def test_worker_copy_on_another_device_copies_every_tensor_there(tiny_lm):
    model, _ = tiny_lm
    for n, p in model.named_parameters():   # a LoRA-like split: some frozen, some trained
        p.requires_grad_(not n.endswith("weight") or "norm" in n)
    try:
        same = worker_copy(model)
        frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
        assert frozen and all(dict(same.named_parameters())[n] is dict(model.named_parameters())[n] for n in frozen)
        # "meta" stands for a second device on a CPU-only machine: nothing may stay behind or be shared.
        other = worker_copy(model, torch.device("meta"))
        mine, theirs = dict(other.named_parameters()), dict(model.named_parameters())
        assert mine.keys() == theirs.keys()
        assert all(p.device.type == "meta" for p in mine.values())
        assert all(b.device.type == "meta" for b in other.buffers())
        assert all(mine[n].requires_grad == theirs[n].requires_grad for n in mine)
        assert all(p.device.type == "cpu" for p in model.parameters())   # the trainer's model untouched
    finally:
        model.requires_grad_(True)


def test_cpu_async_run_with_no_rollout_gpus_keeps_the_worker_beside_the_trainer(tmp_path):
    cfg = tiny_config(tmp_path, "grpo", **{"rollout.mode": "async", "distributed.rollout_gpus": 0,
                                          "peft.method": "lora", "peft.r": 4, "train.max_steps": 2,
                                          "task.num_eval": 0})
    loaded, stage, _ = build_stage(cfg, tmp_path / "s")
    train_stage(cfg, loaded, stage, tmp_path / "s", resume=False, console=QUIET, faults=Faults(),
                save_final=lambda p: None)
    w = stage.worker
    assert w.device == torch.device("cpu")
    # frozen base shared (one copy in memory), adapters the worker's own
    base = {n: p for n, p in loaded.model.named_parameters() if not p.requires_grad}
    assert base and all(dict(w.model.named_parameters())[n] is p for n, p in base.items())


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="checks a machine without the rollout GPU")
def test_rollout_gpus_without_the_gpus_stop_before_training(tmp_path):
    # The rules accept it (train.device=auto); the trainer sees the machine: no cuda:1 here.
    cfg = tiny_config(tmp_path, "grpo", **ASYNC_SPLIT)
    with pytest.raises(ConfigError, match=r"distributed.rollout_gpus=1 runs the rollout worker on cuda:1"):
        build_stage(cfg, tmp_path / "s")


@pytest.mark.gpu
def test_two_gpus_one_trains_one_samples(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    cfg = tiny_config(tmp_path, "grpo", **{**ASYNC_SPLIT, "train.max_steps": 3, "task.num_eval": 0,
                                          "rollout.max_staleness": 1, "rollout.sync_check": "always"})
    loaded, stage, device = build_stage(cfg, tmp_path / "s")
    kept = []
    prepare = stage.prepare
    stage.prepare = lambda step: kept.append(prepare(step)) or kept[-1]
    train_stage(cfg, loaded, stage, tmp_path / "s", resume=False, console=QUIET, faults=Faults(),
                save_final=lambda p: None)
    w = stage.worker
    assert torch.device(device) == torch.device("cuda:0")
    assert all(p.device == torch.device("cuda:0") for p in loaded.model.parameters())
    assert all(p.device == torch.device("cuda:1") for p in w.model.parameters())
    # pushes crossed devices: rollout 2 was sampled by version 1, probed against the trainer's weights
    assert [b.metrics["policy_version"] for b in kept] == [0.0, 0.0, 1.0]
    assert kept[-1].metrics["sync_logp_diff"] < 0.05
