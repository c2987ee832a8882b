"""PPO under DeepSpeed ZeRO (CPU accelerator, gloo, fp32): policy and critic wrapped as one module.

ZeRO-3 on 2 ranks must train what one plain process trains (1e-5 relative, as DDP); ZeRO-3 gathers
policy and critic whole for the rollout (train/ppo.py `prepare`, zero.py `full_weights`).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from test_ppo import ppo_cfg
from test_resume import run_cli, train_losses, write_config

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs the deepspeed extra")

DS = "distributed.strategy=deepspeed"


def params(run, sub: str = "") -> torch.Tensor:
    from safetensors.torch import load_file

    sd = load_file(str(run / "final" / sub / "model.safetensors"))
    return torch.cat([sd[k].flatten() for k in sorted(sd)])


@pytest.mark.deepspeed  # a training run under DeepSpeed: `make test-deepspeed`
def test_ppo_zero3_on_two_ranks_equals_one_plain_rank_and_zero2_runs(tmp_path):
    # A full fine-tune with kl_coef > 0 and a reward model: ZeRO-3 partitions the frozen reference copy and
    # the reward model too, each in an engine without an optimizer (train/frozen.py).
    config = write_config(ppo_cfg(tmp_path, "x", **{"train.micro_batch_size": 2, "ppo.kl_coef": 0.1,
                                                    "rl_models.reward_model": "preset:tiny",
                                                    "rl_models.reward_dtype": "fp32"}), tmp_path / "c.yaml")
    one = run_cli(config, f"run_dir={tmp_path / 'one'}")
    assert one.returncode == 0, one.stderr[-3000:]
    z3 = run_cli(config, f"run_dir={tmp_path / 'z3'}", "distributed.num_gpus=2", DS, "distributed.zero_stage=3")
    assert z3.returncode == 0, z3.stderr[-3000:]
    assert "2 ranks" in z3.stdout
    for sub in ("", "critic"):
        a, b = params(tmp_path / "one", sub), params(tmp_path / "z3", sub)
        assert (a - b).norm() / a.norm() < 1e-5, sub
    want, got = train_losses(tmp_path / "one"), train_losses(tmp_path / "z3")
    assert sorted(got) == sorted(want) == [1, 2, 3]
    for step, loss in want.items():
        assert got[step] == pytest.approx(loss, rel=1e-5, abs=1e-7), step
    # ...and the comparison is not vacuous: three steps moved the policy away from its init.
    from trainfit.config import ModelConfig, PeftConfig
    from trainfit.models.policy import load_policy

    from safetensors.torch import load_file

    init = load_policy(ModelConfig(name="preset:tiny"), PeftConfig(), torch.device("cpu")).model.state_dict()
    final = load_file(str(tmp_path / "z3" / "final" / "model.safetensors"))
    assert set(final) <= set(init) and any(not torch.equal(init[k], v) for k, v in final.items())
    # ZeRO-2 (weights whole, optimizer and gradients partitioned) on one process runs the 3 steps.
    z2 = run_cli(config, f"run_dir={tmp_path / 'z2'}", DS, "distributed.zero_stage=2")
    assert z2.returncode == 0, z2.stderr[-3000:]
    assert sorted(train_losses(tmp_path / "z2")) == [1, 2, 3]


@pytest.mark.deepspeed
def test_each_zero3_rank_holds_the_frozen_model_partitions_the_planner_plans(tmp_path):
    # The reference copy and the reward model of a full fine-tune, partitioned by their optimizer-less
    # engines (train/frozen.py): each rank keeps 1/2 of each, the planner's per-rank rows, up to the
    # buffers (replicated) and the padding of tensors that do not split evenly.
    from test_fsdp_adapters import assert_shards_as_planned, planned_rows, shard_bytes

    config = write_config(ppo_cfg(tmp_path, "x", **{"train.micro_batch_size": 2, "ppo.kl_coef": 0.1,
                                                    "rl_models.reward_model": "preset:tiny",
                                                    "rl_models.reward_dtype": "fp32"}), tmp_path / "c.yaml")
    z3 = (DS, "distributed.zero_stage=3")
    ranks = shard_bytes(config, tmp_path / "bytes", 2, *z3)
    planned, whole = planned_rows(config, 2, *z3), planned_rows(config, 1)
    assert_shards_as_planned(ranks, planned, {("reference", "frozen"): "reference policy",
                                              ("reward", "frozen"): "reward model"})
    for got in ranks:   # partitioned, not whole
        assert got["reference"]["frozen"] < 0.6 * whole["reference policy"]
        assert got["reward"]["frozen"] < 0.6 * whole["reward model"]


@pytest.mark.slow
def test_shared_base_lora_under_zero3_offload_on_two_ranks_equals_one_plain_rank(tmp_path):
    # The critic's frozen base tensors are the policy's own parameters (value_model.shared_backbone):
    # ZeRO-3 partitions each once and gathers it for both trees, so 2 ranks still train what 1 does.
    from safetensors.torch import load_file

    config = write_config(ppo_cfg(tmp_path, "x", **{"train.micro_batch_size": 2, "ppo.kl_coef": 0.1,
                                                    "peft.method": "lora", "peft.r": 4, "train.lr": 1e-2}),
                          tmp_path / "c.yaml")
    one = run_cli(config, f"run_dir={tmp_path / 'one'}")
    assert one.returncode == 0, one.stderr[-3000:]
    z3 = run_cli(config, f"run_dir={tmp_path / 'z3'}", "distributed.num_gpus=2", DS, "distributed.zero_stage=3",
                 "distributed.offload_optimizer=true", "distributed.offload_params=true")
    assert z3.returncode == 0, z3.stderr[-3000:]
    adapters = [load_file(str(tmp_path / r / "final" / "adapter_model.safetensors")) for r in ("one", "z3")]
    a, b = (torch.cat([sd[k].flatten() for k in sorted(sd)]) for sd in adapters)
    assert (a - b).norm() / a.norm() < 1e-5
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in adapters[1].items())  # LoRA B starts at 0
    c1, c2 = params(tmp_path / "one", "critic"), params(tmp_path / "z3", "critic")
    assert (c1 - c2).norm() / c1.norm() < 1e-5
