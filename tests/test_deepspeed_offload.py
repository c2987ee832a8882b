"""DeepSpeed ZeRO-3 and ZeRO-Offload in the trainer, on CPU (DeepSpeed's CPU accelerator, gloo).

Tolerance: 1e-5 relative, as for DDP and FSDP. DeepSpeed's CPU Adam (the optimizer ZeRO-Offload
requires) computes the same AdamW update as torch's, w *= 1 - lr*wd; w -= lr/bc1 * m / (sqrt(v)/sqrt(bc2)
+ eps), in fp32 with AVX-512 in a different operation order: the weights differ from torch's by float
rounding only (2.7e-7 relative after 3 steps of ZeRO-3 + optimizer offload on 2 ranks, measured), so the
tolerance the other engines meet holds and no looser one is needed.

The first DeepSpeed run on a machine compiles its CPU ops (~3 minutes each on 2 cores); `make test`
builds them once into .venv/torch_extensions (trainfit/train/zero.py), so these tests only load them.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from conftest import tiny_config
from test_distributed import final_params, losses, stage_cfg, train, write
from test_fsdp_adapters import gathered
from trainfit.config import ConfigError
from trainfit.models.runnable import not_trainable

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs the deepspeed extra")

DS = "distributed.strategy=deepspeed"
ZERO3_OFFLOAD = [DS, "distributed.zero_stage=3", "distributed.offload_optimizer=true"]
# Training runs under DeepSpeed (a heavy extra: ~25 s of imports and CPU-op loading per process) run in
# their own CI step, `make test-deepspeed`, as the vLLM and MiniWoB++ ones do; the checks below them stay
# in `make test`.
DS_RUN = pytest.mark.deepspeed


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """3 SFT steps on one process without DeepSpeed: the reference every DeepSpeed run must match."""
    tmp = tmp_path_factory.mktemp("ds")
    config = write(stage_cfg(tmp, "sft", "plain"), tmp / "c.yaml")
    run = train(config)
    assert run.returncode == 0, run.stderr[-3000:]
    return config, tmp / "plain"


def assert_same_training(ref: Path, run: Path) -> None:
    a, b = final_params(ref), final_params(run)
    assert (a - b).norm() / a.norm() < 1e-5
    want, got = losses(ref), losses(run)
    assert sorted(got) == sorted(want) == [1, 2, 3]
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-7), step


@DS_RUN
def test_zero3_optimizer_offload_on_two_ranks_equals_one_plain_rank(plain, tmp_path):
    config, ref = plain
    two = train(config, f"run_dir={tmp_path / 'z3'}", "distributed.num_gpus=2", *ZERO3_OFFLOAD)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "2 ranks" in two.stdout
    assert_same_training(ref, tmp_path / "z3")
    read, total = gathered(two.stdout)   # the final save gathered each parameter on its own, every one once
    assert read == total
    # ...the comparison is not vacuous: three steps moved the weights away from the init.
    from trainfit.config import ModelConfig, PeftConfig
    from trainfit.models.policy import load_policy
    init = load_policy(ModelConfig(name="preset:tiny"), PeftConfig(), torch.device("cpu")).model
    from transformers import AutoModelForCausalLM
    # The final model, gathered from the ZeRO-3 partitions, is a plain transformers directory that
    # computes what the plain run's does (and not what the untrained init does).
    ids = torch.tensor([[1, 5, 9, 3, 7, 2]])
    with torch.no_grad():
        out = AutoModelForCausalLM.from_pretrained(tmp_path / "z3" / "final").eval()(ids).logits
        want = AutoModelForCausalLM.from_pretrained(ref / "final").eval()(ids).logits
        before = init.eval()(ids).logits
    assert torch.allclose(out, want, rtol=1e-4, atol=1e-5)
    assert (out - before).abs().max() > 1e-3


@DS_RUN
def test_zero2_optimizer_offload_sft_matches_plain(plain, tmp_path):
    # One card + ZeRO-2 + CPU Adam, the guides' 7B set-up: one process under torchrun.
    config, ref = plain
    run = train(config, f"run_dir={tmp_path / 'z2'}", DS, "distributed.zero_stage=2",
                "distributed.offload_optimizer=true")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "launching 1 ranks" in run.stdout
    assert_same_training(ref, tmp_path / "z2")


@DS_RUN
def test_zero3_checkpoint_resumes_with_the_same_losses(plain, tmp_path):
    # Parameters offloaded too; killed after step 3 with the step-2 checkpoint written, then resumed:
    # DeepSpeed's own partitioned files restore weights and CPU Adam state exactly.
    config, ref = plain
    args = [f"run_dir={tmp_path / 'cut'}", *ZERO3_OFFLOAD, "distributed.offload_params=true",
            "train.save_every=2"]
    cut = train(config, *args, "--fault", "kill_after_step:3")
    assert cut.returncode != 0
    ckpt = tmp_path / "cut" / "checkpoints" / "step-000002"
    assert (ckpt / "deepspeed").is_dir() and (ckpt / "model.safetensors").is_file()
    resumed = train(config, *args, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    assert_same_training(ref, tmp_path / "cut")


def test_zero3_checkpoint_refuses_another_rank_count(tmp_path):
    from trainfit.core.dist import Ranks
    from trainfit.train.checkpoint import load_checkpoint

    path = tmp_path / "step-000002"
    path.mkdir()
    (path / "state.json").write_text(json.dumps({"step": 2, "world_size": 1, "optimizer_format": "deepspeed"}))
    with pytest.raises(ConfigError, match="from 1 rank.*has 2 rank.*same rank count.*own ZeRO partition"):
        load_checkpoint(path, model=None, is_peft=False, optimizer=None, scheduler=None,
                        ranks=Ranks(rank=0, world=2), engine=object())


@DS_RUN
@pytest.mark.parametrize("zero", [
    ["distributed.zero_stage=3", "distributed.offload_optimizer=true"],  # generation on gathered weights
    # ZeRO-2 keeps whole weights: the rollout needs no gather, the optimizer steps on the CPU.
    ["distributed.zero_stage=2", "distributed.offload_optimizer=true"]])
def test_grpo_under_zero_offload_runs_three_steps(tmp_path, zero):
    config = write(stage_cfg(tmp_path, "grpo", "g"), tmp_path / "c.yaml")
    run = train(config, "distributed.num_gpus=2", DS, *zero)
    assert run.returncode == 0, run.stderr[-3000:]
    got = losses(tmp_path / "g")
    assert sorted(got) == [1, 2, 3] and all(torch.isfinite(torch.tensor(list(got.values()))))
    rows = [json.loads(x) for x in (tmp_path / "g" / "completions.jsonl").read_text().splitlines()]
    assert rows  # the rollouts were generated (on the gathered policy under ZeRO-3)


def test_runnable_settings(tmp_path):
    """train runs ZeRO 1-3 with optimizer offload and ZeRO-3 with parameter offload; the rest is refused."""
    def reason(stage="sft", **kw):
        return not_trainable(tiny_config(tmp_path, stage, **{"distributed.strategy": "deepspeed", **kw}))

    assert reason(**{"distributed.zero_stage": 3, "distributed.offload_optimizer": True,
                     "distributed.offload_params": True}) is None
    assert reason(**{"distributed.zero_stage": 2, "distributed.offload_optimizer": True}) is None
    assert reason("grpo", **{"distributed.zero_stage": 3}) is None
    assert "needs zero_stage=3" in reason(**{"distributed.zero_stage": 2, "distributed.offload_params": True})
    assert "CPU Adam" in reason(**{"distributed.zero_stage": 2, "distributed.offload_optimizer": True,
                                   "train.optimizer": "adamw_8bit"})
    assert "needs a ZeRO stage" in reason(**{"distributed.offload_optimizer": True})
    assert reason("ppo", **{"distributed.zero_stage": 3, "distributed.offload_optimizer": True}) is None
    assert not_trainable(tiny_config(tmp_path, "ppo", **{"distributed.strategy": "fsdp"})) is None  # PPO under FSDP2
    # FSDP2's CPU offload runs over two ranks or more (one process is refused by the config rules).
    assert not_trainable(tiny_config(tmp_path, "sft", **{"distributed.strategy": "fsdp", "distributed.num_gpus": 2,
                                                          "train.micro_batch_size": 4,
                                                          "distributed.offload_params": True})) is None


def test_offload_beyond_the_machine_ram_is_refused_before_launch(monkeypatch, user_plan_cache):
    from trainfit.core import dist, machine
    from trainfit.config import load_config
    from trainfit.train import launch
    from trainfit.plan import plan

    cfg = load_config(Path(__file__).resolve().parents[1] / "examples" / "sft_7b_zero2_offload.yaml")
    need, gib = plan(cfg, suggest=False).cpu_ram, 2 ** 30
    assert need > 100 * gib  # fp32 master weights + Adam moments of 7.6B parameters
    monkeypatch.setattr(dist, "uses_cuda", lambda c: True)  # launching on this (GPU) machine
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(machine, "cpu_ram", lambda: {"total": need - gib, "available": need - 2 * gib})
    with pytest.raises(ConfigError, match=rf"about {need / gib:.1f} GiB in CPU RAM.*short by 1\.0 GiB"):
        launch.check_launch(cfg)
    monkeypatch.setattr(machine, "cpu_ram", lambda: {"total": need + gib, "available": need})
    launch.check_launch(cfg)  # enough RAM: launches


def test_planner_counts_the_zero3_gather_in_the_rollout_phase(tmp_path):
    # GRPO under ZeRO-3 generates with every parameter gathered (train/zero.py full_weights): the rollout
    # phase holds the whole weights, the partition kept plus the rest gathered (all of it when offloaded).
    from trainfit.plan import plan

    def weights(**kw) -> tuple[int, int]:
        p = plan(tiny_config(tmp_path, "grpo", **{"train.micro_batch_size": 2, **kw}), suggest=False)
        kept = sum(i.rollout for i in p.items if i.name.startswith("policy weights"))
        gathered = sum(i.rollout for i in p.items if i.name.startswith("ZeRO-3 weights gathered"))
        assert not any(i.train for i in p.items if i.name.startswith("ZeRO-3 weights gathered"))
        return kept, gathered

    whole, none = weights()
    assert none == 0
    zero3 = {"distributed.strategy": "deepspeed", "distributed.zero_stage": 3, "distributed.num_gpus": 2}
    kept, gathered = weights(**zero3)
    assert kept == whole // 2 and kept + gathered == whole
    kept, gathered = weights(**zero3, **{"distributed.offload_params": True, "distributed.offload_optimizer": True})
    assert kept == 0 and gathered == whole
