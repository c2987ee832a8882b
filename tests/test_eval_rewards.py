"""Eval on a task with rewards reports each reward's held-out mean (`eval_reward/<name>`) and their
weighted sum (`eval_reward`) beside the task's own accuracy, from the same greedy completions."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from rich.console import Console

from conftest import tiny_config
from trainfit.tasks import build_task, resolve_rewards, resolve_weights
from trainfit.train.evaluate import task_accuracy
from trainfit.train.report import read_metrics
from trainfit.train.run import run_pipeline

REWARDS = """
def const(prompts, completions, **fields):
    return [1.0] * len(completions)

def answer_len(prompts, completions, answer, **fields):
    return [float(len(a)) for a in answer]

def chars(prompts, completions, **fields):
    return [float(len(c)) for c in completions]
"""


@dataclass
class Out:
    text: str
    token_ids: list


class ScriptedEngine:
    """Greedy 'decoding' that answers every prompt with the next scripted text; counts its calls."""

    def __init__(self, texts):
        self.texts, self.calls = texts, 0

    def generate(self, prompts, greedy=False, batch_size=None, **kw):
        assert greedy
        self.calls += 1
        return [Out(t, list(range(len(t)))) for t, _ in zip(self.texts, prompts)]


def test_task_accuracy_scores_the_same_completions_with_the_rewards(tmp_path):
    from trainfit.models.tokenizer import build_tokenizer

    (tmp_path / "rw.py").write_text(REWARDS)
    cfg = tiny_config(tmp_path, "grpo", **{"task.rewards": f"[default, {tmp_path}/rw.py:chars]",
                                           "task.reward_weights": "[2.0, 0.5]", "task.num_eval": 4})
    task = build_task(cfg.task)
    answers = [ex.answer for ex in task.eval_examples()]
    texts = [answers[0], answers[1], "nope", "x" * 7]                   # two right, two wrong
    engine = ScriptedEngine(texts)
    fns, weights = resolve_rewards(cfg.task, task), resolve_weights(cfg.task, task)
    out = task_accuracy(engine, build_tokenizer(), task, chat=False, rewards=(fns, weights))
    assert engine.calls == 1                                           # one generation serves both
    chars = [len(t) for t in texts]
    assert out["accuracy"] == 0.5 and out["eval_reward/correctness"] == 0.5
    assert out["eval_reward/chars"] == pytest.approx(sum(chars) / 4)
    assert out["eval_reward"] == pytest.approx(2.0 * 0.5 + 0.5 * sum(chars) / 4)
    assert "eval_reward" not in task_accuracy(ScriptedEngine(texts), build_tokenizer(), task, chat=False)


def test_grpo_eval_rows_carry_the_runs_rewards_on_held_out_rows(tmp_path):
    (tmp_path / "rw.py").write_text(REWARDS)
    cfg = tiny_config(tmp_path, "grpo", **{"task.rewards": f"[{tmp_path}/rw.py:const, {tmp_path}/rw.py:answer_len]",
                                           "task.reward_weights": "[2.0, 0.5]", "task.num_eval": 8,
                                           "train.max_steps": 1})
    run_pipeline(cfg, console=Console(file=open("/dev/null", "w")))
    evals = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "eval"]
    held_out = build_task(cfg.task).eval_examples()
    mean_len = sum(len(ex.answer) for ex in held_out) / len(held_out)
    assert len(evals) == 2                                             # before and after training
    for row in evals:
        assert "accuracy" in row
        assert row["eval_reward/const"] == 1.0
        assert row["eval_reward/answer_len"] == pytest.approx(mean_len, abs=1e-6)
        assert row["eval_reward"] == pytest.approx(2.0 + 0.5 * mean_len, abs=1e-5)
