"""examples/ppo_pipeline_tiny.yaml: SFT -> RM (pairs made from the task) -> PPO scored by that reward
model and the task's check. At reduced size (default suite): the stages chain as the example says,
PPO reads the RM stage's model through `stage:rm`, and the summary's accuracy chain is the policy's.
At full size (slow, minutes on 2 cores): held-out accuracy after PPO is above the accuracy after SFT."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_resume import QUIET
from trainfit.config import ConfigError, load_config
from trainfit.train.report import read_metrics
from trainfit.train.run import run_pipeline

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "ppo_pipeline_tiny.yaml"
CPU = ["train.device=cpu", "logging.progress=false", "logging.plot=false", "logging.report_to=none"]


def test_pipeline_chains_sft_rm_ppo_at_reduced_size(tmp_path):
    small = ["task.num_eval=16", "stages.0.train.max_steps=3", "stages.1.train.max_steps=2",
             "stages.2.train.max_steps=2", "stages.2.train.global_batch_size=8", "stages.2.train.micro_batch_size=8"]
    cfg = load_config(EXAMPLE, [*CPU, *small, f"run_dir={tmp_path}"])
    results = run_pipeline(cfg, console=QUIET)
    assert [r.steps for r in results] == [3, 2, 2]
    # The PPO stage scored with the task's check plus ppo.reward_model_weight x the RM stage's model.
    ppo_cfg = load_config(tmp_path / "2-ppo" / "config.yaml")
    assert Path(ppo_cfg.rl_models.reward_model) == results[1].final_dir
    w = ppo_cfg.ppo.reward_model_weight
    rows = [r for r in read_metrics(tmp_path / "2-ppo" / "metrics.jsonl") if r["kind"] == "train"]
    for r in rows:
        parts = {k: v for k, v in r.items() if k.startswith("reward/")}
        assert set(parts) == {"reward/correctness", "reward/reward_model"}, parts
        assert r["reward"] == pytest.approx(parts["reward/correctness"] + w * parts["reward/reward_model"],
                                            abs=2e-6)
    # ... and it continued from the SFT policy, not from the reward model.
    assert Path(ppo_cfg.model.name) == results[0].final_dir
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert list(summary["accuracy"]) == ["before sft", "after sft", "after ppo"]
    assert summary["stages"][1]["accuracy_after"] is not None  # the RM's pair accuracy, in its own row


def test_stage_rm_reference_needs_an_rm_stage_before(tmp_path):
    cfg = load_config(EXAMPLE, [*CPU, f"run_dir={tmp_path}", "stages=[{stage: ppo, rl_models: {reward_model: 'stage:rm'}}]"])
    with pytest.raises(ConfigError, match="stage:rm"):
        run_pipeline(cfg, console=QUIET)


@pytest.mark.slow
def test_ppo_raises_held_out_accuracy_above_sft(tmp_path):
    cfg = load_config(EXAMPLE, [*CPU, f"run_dir={tmp_path}"])
    run_pipeline(cfg, console=QUIET)
    acc = json.loads((tmp_path / "summary.json").read_text())["accuracy"]
    assert acc["after ppo"] > acc["after sft"], acc
