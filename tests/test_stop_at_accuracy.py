"""train.stop_at_accuracy ends a stage at the first held-out evaluation that reaches it (early stopping
on the task's accuracy): the steps, the final model, the summary and the metrics say where it ended."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from conftest import tiny_config
from trainfit.config import ConfigError
from trainfit.train import loop
from trainfit.train.run import DONE, run_pipeline

QUIET = Console(file=open("/dev/null", "w"))


def scripted_accuracies(monkeypatch, values: list[float]) -> list[float]:
    """Each held-out evaluation returns the next of `values` (the first is the one before step 1)."""
    seen: list[float] = []

    def evaluate(stage, model, ranks, collective):
        seen.append(values[len(seen)])
        return {"accuracy": seen[-1]}

    monkeypatch.setattr(loop, "_evaluate", evaluate)
    return seen


def test_the_stage_ends_at_the_first_evaluation_reaching_the_target(tmp_path, monkeypatch):
    # Evaluations before step 1, then at steps 2, 4, 6, 8: 0.0, 0.2, 0.45, 0.5, 0.7. The target 0.5 is
    # first reached at step 6 (0.45 at step 4 is below it), so 6 of the 20 steps run.
    seen = scripted_accuracies(monkeypatch, [0.0, 0.2, 0.45, 0.5, 0.7])
    cfg = tiny_config(tmp_path, "sft", **{"train.max_steps": 20, "train.eval_every": 2,
                                          "train.stop_at_accuracy": 0.5})
    (result,) = run_pipeline(cfg, console=QUIET)
    stage_dir = tmp_path / "run"
    assert seen == [0.0, 0.2, 0.45, 0.5]   # no evaluation after the one that ended it
    rows = [json.loads(line) for line in (stage_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows if r["kind"] == "train") == 6
    assert [(r["step"], r["accuracy"]) for r in rows if r["kind"] == "eval"] == [(0, 0.0), (2, 0.2), (4, 0.45), (6, 0.5)]
    stop = [r for r in rows if r["kind"] == "stop"]
    assert len(stop) == 1 and stop[0]["step"] == 6 and "reached train.stop_at_accuracy=0.5 at step 6" in stop[0]["message"]
    assert [r["step"] for r in rows if r["kind"] == "memory"] == [6]
    stage = json.loads((stage_dir / "summary.json").read_text())["stages"][0]
    assert stage["steps"] == 6 and stage["accuracy_after"] == 0.5
    assert (stage_dir / DONE).exists() and (stage_dir / "final").is_dir()
    assert (result.steps, result.last_eval) == (6, {"accuracy": 0.5})   # what the caller gets back, too


def test_without_reaching_it_every_step_runs(tmp_path, monkeypatch):
    seen = scripted_accuracies(monkeypatch, [0.0, 0.1, 0.2, 0.3])
    cfg = tiny_config(tmp_path, "sft", **{"train.max_steps": 4, "train.eval_every": 2,
                                          "train.stop_at_accuracy": 0.9})
    run_pipeline(cfg, console=QUIET)
    # Before, at step 2, and the final evaluation at step 4 (eval_every skips the last step).
    assert seen == [0.0, 0.1, 0.2]
    stage = json.loads((tmp_path / "run" / "summary.json").read_text())["stages"][0]
    assert stage["steps"] == 4 and stage["accuracy_after"] == 0.2


@pytest.mark.parametrize("overrides, fix", [
    ({"train.eval_every": 0}, "set train.eval_every, e.g. 100"),
    ({"train.eval_every": 5, "task.name": "null", "data.path": "rows.jsonl"}, "set task.name"),
])
def test_it_needs_a_held_out_accuracy_to_watch(tmp_path, overrides, fix):
    with pytest.raises(ConfigError, match="train.stop_at_accuracy=0.5") as e:
        tiny_config(tmp_path, "sft", **{"train.stop_at_accuracy": 0.5, **overrides})
    assert fix in str(e.value)


@pytest.mark.parametrize("worker", ["thread", "process"])
def test_an_async_stage_ended_early_stops_its_rollout_worker(tmp_path, monkeypatch, worker):
    import multiprocessing
    import threading

    from test_grpo_async import grpo

    # Evaluations before step 1 and at step 2: 0.0, then 0.9 >= 0.5 ends the stage at step 2 of 6, while
    # the worker (max_staleness 1) has rollouts left to sample. Neither its thread nor its process (the
    # rollout it samples then is not waited for) may outlive the stage.
    scripted_accuracies(monkeypatch, [0.0, 0.9])
    cfg = grpo(tmp_path, **{"train.max_steps": 6, "train.eval_every": 2, "train.stop_at_accuracy": 0.5,
                            "rollout.mode": "async", "rollout.max_staleness": 1, "rollout.sync_check": "never",
                            "rollout.worker": worker})
    (result,) = run_pipeline(cfg, console=QUIET)
    assert result.steps == 2
    assert not [t for t in threading.enumerate() if t.name == "trainfit-rollout"]
    assert not [p for p in multiprocessing.active_children() if p.name == "trainfit-rollout"]
