"""Micro-batch 1 x accumulation 8 must give the gradient of micro-batch 8 x accumulation 1.

The step loss is normalised by whole-step totals (tokens, sequences), so splitting the step into
micro-batches only changes how the same sum is grouped; fp32 rounding is the only difference.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import tiny_config
from trainfit.models.policy import trainable_parameters
from trainfit.train.loop import accumulate, seed_step
from trainfit.train.run import build_stage

REWARD = str(Path(__file__).parent / "data" / "rewards_for_tests.py") + ":length_reward"


def step_gradients(cfg, tmp_path) -> tuple[list[torch.Tensor], float]:
    loaded, stage, _ = build_stage(cfg, tmp_path / f"stage-{cfg.train.micro_batch_size}")
    seed_step(cfg.train.seed, 0)
    batch = stage.prepare(0)
    sums = accumulate(loaded.model, batch, cfg.train.micro_batch_size, stage.loss)
    grads = [p.grad.detach().clone() for p in trainable_parameters(loaded.model)]
    return grads, sums["loss"]


def assert_same_gradients(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    flat_a, flat_b = torch.cat([g.flatten() for g in a]), torch.cat([g.flatten() for g in b])
    assert flat_b.norm() > 0, "gradient is zero: the comparison would prove nothing"
    rel = (flat_a - flat_b).norm() / flat_b.norm()
    assert rel < 1e-5, f"relative gradient difference {rel:.2e}"


def test_sft_micro1_accum8_equals_micro8_accum1(tmp_path):
    big = tiny_config(tmp_path, "sft", **{"train.micro_batch_size": 8})
    small = tiny_config(tmp_path, "sft", **{"train.micro_batch_size": 1})
    assert small.batch_plan().accumulation == 8 and big.batch_plan().accumulation == 1
    g8, loss8 = step_gradients(big, tmp_path)
    g1, loss1 = step_gradients(small, tmp_path)
    assert_same_gradients(g1, g8)
    assert abs(loss1 - loss8) < 1e-5 * abs(loss8)


@pytest.mark.parametrize("loss_type,beta", [("grpo", 0.0), ("dr_grpo", 0.0), ("dapo", 0.1)])
def test_grpo_micro1_accum8_equals_micro8_accum1(tmp_path, loss_type, beta):
    common = {"grpo.loss_type": loss_type, "grpo.beta": beta, "task.rewards": f"[{REWARD}]",
              "rollout.max_new_tokens": 6}
    big = tiny_config(tmp_path, "grpo", **common, **{"train.micro_batch_size": 8})
    small = tiny_config(tmp_path, "grpo", **common, **{"train.micro_batch_size": 1})
    g8, loss8 = step_gradients(big, tmp_path)
    g1, loss1 = step_gradients(small, tmp_path)
    assert_same_gradients(g1, g8)
    # The on-policy loss sums advantages that cancel within groups, so compare it absolutely too.
    assert abs(loss1 - loss8) <= 1e-6 + 1e-5 * abs(loss8)
