"""GRPO-family options through the real trainer: RLOO / REINFORCE++ advantages and GSPO ratios."""

from __future__ import annotations

import pytest
import torch

from test_distributed import final_params, losses, stage_cfg, train as train_cli, train_here, write
from test_grpo import grpo, train


def test_gspo_clips_whole_sequences_on_reused_rollouts(tmp_path):
    # num_iterations 2: step 2 reuses step 1's samples after an update, so ratios differ from 1. With
    # sequence-level ratios every token of a completion shares its ratio, so a completion is clipped
    # whole: the clipped-token fraction is a sum of whole completions' token shares.
    cfg = grpo(tmp_path, **{"grpo.num_iterations": 2, "train.max_steps": 2, "grpo.beta": 0.0,
                            "grpo.epsilon": 1e-4, "grpo.importance": "sequence", "grpo.advantage": "rloo"})
    _, changed, metrics = train(cfg, tmp_path / "gspo")
    first, second = [m for m in metrics if m["kind"] == "train"]
    assert changed
    assert first["ratio"] == pytest.approx(1.0, abs=1e-6) and first["clip_frac"] == 0.0
    assert abs(second["ratio"] - 1.0) > 1e-5 and second["clip_frac"] > 0.0


@pytest.mark.parametrize("estimator", ["rloo", "reinforce_pp", "reinforce_pp_batch"])
def test_advantage_estimators_train(tmp_path, estimator):
    cfg = grpo(tmp_path, **{"grpo.advantage": estimator, "train.max_steps": 1})
    _, changed, metrics = train(cfg, tmp_path / estimator)
    step = [m for m in metrics if m["kind"] == "train"][0]
    assert changed and torch.isfinite(torch.tensor(step["loss"]))


@pytest.mark.multiprocess
def test_reinforce_pp_batch_statistics_span_ranks(tmp_path):
    # REINFORCE++ normalises over the whole step: with 2 ranks each holding half the groups, the
    # advantages (and so the weights) must equal the 1-rank run's, which needs the cross-rank gather.
    config = write(stage_cfg(tmp_path, "grpo", "x", **{"grpo.advantage": "reinforce_pp_batch"}), tmp_path / "c.yaml")
    train_here(config, f"run_dir={tmp_path / 'one'}")
    two = train_cli(config, f"run_dir={tmp_path / 'two'}", "distributed.num_gpus=2", "distributed.strategy=ddp")
    assert two.returncode == 0, two.stderr[-3000:]
    assert "2 ranks" in two.stdout
    a, b = final_params(tmp_path / "one"), final_params(tmp_path / "two")
    assert (a - b).norm() / a.norm() < 1e-5
    # GRPO under DDP (this test stands for test_distributed's grpo-ddp case): the same loss at every step.
    for step, loss in losses(tmp_path / "one").items():
        assert losses(tmp_path / "two")[step] == pytest.approx(loss, rel=1e-5, abs=1e-7)
