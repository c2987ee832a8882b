"""A GRPO run whose groups have had no learning signal for several steps warns once, naming the
cause and the usual fixes, on the console and as a `kind: warning` row in metrics.jsonl."""

from __future__ import annotations

import io

import torch
from rich.console import Console

from conftest import tiny_config
from trainfit.train.report import read_metrics
from trainfit.train.run import run_pipeline
from trainfit.train.warnings_rl import ZeroAdvantageWatch, zero_advantage_patience, zero_signal_frac

REWARDS = """
def constant(prompts, completions, **fields):
    return [0.5] * len(completions)

def text_hash(prompts, completions, **fields):
    # differs between two completions unless their texts are the same
    return [float(sum(map(ord, c)) % 97) for c in completions]
"""
FIXES = ("partial-credit", "format reward", "SFT", "grpo.num_generations", "rollout.temperature")


def _run(tmp_path, reward: str, steps: int):
    (tmp_path / "rw.py").write_text(REWARDS)
    cfg = tiny_config(tmp_path, "grpo", **{"task.rewards": f"[{tmp_path}/rw.py:{reward}]",
                                           "train.max_steps": steps, "train.global_batch_size": 8,
                                           "train.micro_batch_size": 8})
    buf = io.StringIO()
    run_pipeline(cfg, console=Console(file=buf, width=100_000, force_terminal=False))
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    return " ".join(buf.getvalue().split()), rows


def test_constant_reward_warns_once_with_the_fixes(tmp_path):
    out, rows = _run(tmp_path, "constant", steps=4)
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["zero_adv_frac"] for r in train] == [1.0] * 4
    warnings = [r for r in rows if r["kind"] == "warning"]
    assert len(warnings) == 1 and warnings[0]["step"] == zero_advantage_patience(4) == 2
    assert out.count("no learning signal") == 1
    for fix in FIXES:
        assert fix in out and fix in warnings[0]["message"]
    assert "now 4" in out and "stages: [{stage: sft}, {stage: grpo}]" in out  # the run's G; markup kept literal


def test_varied_rewards_do_not_warn(tmp_path):
    out, rows = _run(tmp_path, "text_hash", steps=3)
    assert all(r["zero_adv_frac"] < 1.0 for r in rows if r["kind"] == "train")
    assert not [r for r in rows if r["kind"] == "warning"] and "no learning signal" not in out


def test_watch_needs_consecutive_steps_and_warns_once():
    w = ZeroAdvantageWatch(max_steps=100, num_generations=8, temperature=0.7)
    assert w.patience == 5
    fracs = [1, 1, 1, 1, 0.5, 1, 1, 1, 1]           # a step with signal resets the count
    assert [w.update(i + 1, f) for i, f in enumerate(fracs)] == [None] * 9
    msg = w.update(10, 1.0)
    assert msg and "steps 6-10" in msg and "now 8" in msg and "now 0.7" in msg
    assert all(w.update(11 + i, 1.0) is None for i in range(10))


def test_zero_signal_frac_counts_groups_with_equal_rewards():
    r = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 1.0, 2.0, 5.0, 2.0])      # 3 groups of 3
    assert zero_signal_frac(r, torch.ones(9, dtype=torch.bool), 3) == 1 / 3
    valid = torch.tensor([1, 1, 1, 1, 1, 1, 1, 0, 1], dtype=torch.bool)   # group 3: its valid members tie
    assert zero_signal_frac(r, valid, 3) == 2 / 3
