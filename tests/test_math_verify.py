"""The `math_verify` reward (Hugging Face's Math-Verify) on hand-written cases, and how `task.name: dataset`
chooses it: the `default` reward and the accuracy of a task whose answers are all mathematical."""

from __future__ import annotations

import json

import pytest

from trainfit.config import ConfigError, TaskConfig
from trainfit.tasks import build_task, math_verify, resolve_rewards
from trainfit.tasks.math_reward import answer_equal, looks_mathematical, math_equal

# (reference answer, completion, equal?) written by hand: equivalent forms count, wrong answers and
# malformed output do not.
CASES = [
    ("0.5", "The answer is \\boxed{\\frac{1}{2}}.", True),       # fraction vs decimal
    ("\\frac{1}{2}", "so it is 0.5", True),
    ("\\frac{1}{2}", "$\\frac{2}{4}$", True),                    # unreduced
    ("\\frac{1}{2}", "50%", True),                               # percent
    ("72", "She earned 12 * 6 = 72 dollars.\n#### 72", True),    # GSM8K's convention
    ("72", "She earned $72.", True),                             # a currency sign
    ("72", "\\boxed{72.0}", True),
    ("1000", "In total 1,000 apples.", True),                    # thousands separator
    ("5", "The side is \\boxed{5\\text{ cm}}.", True),           # units stripped
    ("72", "\\boxed{72^\\circ}", True),
    ("3x+2", "The expression is $2 + 3x$.", True),               # commuted terms
    ("\\sqrt{2}/2", "$\\frac{\\sqrt{2}}{2}$", True),
    ("x^2", "\\boxed{x^{2}}", True),
    ("72", "The answer: 71", False),                             # wrong
    ("\\frac{1}{2}", "The answer is 1/3", False),
    ("1000", "1,001", False),
    ("3x+2", "$3x-2$", False),
    ("72", "", False),                                           # malformed or empty output
    ("72", "\\boxed{", False),
    ("72", "I cannot solve this.", False),
    ("72", "$$$\\frac{}{}", False),
    # MATH writes currency as an escaped dollar inside the answer: `\$` is text, not a `$...$` delimiter,
    # so the answer is still parsed as math (18.90, 32348) and a right completion scores.
    ("\\$18.90", "The total is \\boxed{\\$18.90}.", True),
    ("\\$18.90", "She pays $18.90 in all.", True),
    ("\\$18.90", "\\boxed{18.9}", True),
    ("\\$18.90", "\\boxed{\\$19.80}", False),
    ("\\$32,\\!348", "\\boxed{\\$32,\\!348}", True),             # `\!` is a thin negative space
    ("\\$32,\\!348", "\\boxed{32348}", True),
    ("\\$32,\\!348", "\\boxed{32,384}", False),
]


@pytest.mark.parametrize("answer, completion, equal", CASES)
def test_math_verify_on_hand_written_cases(answer, completion, equal):
    assert math_equal(completion, answer) is equal
    assert math_verify(["p"], [completion], answer=[answer]) == [1.0 if equal else 0.0]


@pytest.mark.parametrize("answer, mathematical", [
    ("72", True), ("-3.5", True), ("1,000", True), ("\\frac{1}{2}", True), ("3x+2", True), ("(1, 2)", True),
    ("\\pi/2", True), ("x^2", True), ("\\$18.90", True), ("\\$32,\\!348", True),
    ("p - q", True), ("5\\text{ cm}", True), ("\\text{Evelyn}", False), ("Paris", False), ("72 dollars", False),
    ("B", False), ("\\text{yes}", False),
    ("", False),
])
def test_which_answers_are_mathematical(answer, mathematical):
    assert looks_mathematical(answer) is mathematical


def _rows(tmp_path, rows) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_dataset_task_checks_mathematical_answers_with_math_verify(tmp_path):
    rows = [{"question": f"Half of {2 * i + 1}?", "answer": f"It is {2 * i + 1}/2.\n#### \\frac{{{2 * i + 1}}}{{2}}"}
            for i in range(6)]
    cfg = TaskConfig(name="dataset", path=_rows(tmp_path, rows), answer_pattern=r"####\s*(.+)", num_eval=2)
    task = build_task(cfg)
    (name, fn), = resolve_rewards(cfg, task)
    ex = task.train_example(0)
    half = float(ex.answer[len("\\frac{"):].split("}")[0]) / 2   # the row's answer as a decimal
    assert name == "math_verify" and any("use math_verify" in n for n in task.notes)
    assert ex.target.startswith("It is ") and ex.answer.startswith("\\frac{")   # the whole text stays the target
    assert task.is_correct(f"so \\boxed{{{half}}}", ex) and not task.is_correct(f"{half + 1}", ex)
    assert fn([ex.prompt] * 2, [f"{half}", "no idea"], answer=[ex.answer] * 2) == [1.0, 0.0]
    # The same rows as task.name=jsonl keep that task's check: the last number, as a number.
    jsonl = build_task(TaskConfig(name="jsonl", path=cfg.path, answer_pattern=cfg.answer_pattern, num_eval=2))
    assert resolve_rewards(cfg, jsonl)[0][0] == "correctness" and not jsonl.math


def test_dataset_task_with_text_answers_says_why_not_math_verify(tmp_path):
    rows = [{"prompt": f"Capital {i}?", "answer": "Paris"} for i in range(4)]
    task = build_task(TaskConfig(name="dataset", path=_rows(tmp_path, rows), num_eval=1))
    assert not task.math and resolve_rewards(TaskConfig(name="dataset", path="x"), task)[0][0] == "correctness"
    assert any("no answer is mathematical (e.g. 'Paris')" in n and "task.answer_pattern" in n for n in task.notes)
    ex = task.train_example(0)
    assert task.is_correct("\\boxed{paris}", ex) and task.is_correct("Paris.", ex) and not task.is_correct("Lyon", ex)


# MATH-500 mixes text answers with math ones. Each row is judged on its own: Math-Verify where the answer
# is math (`p - q`, `5\text{ cm}`, `\$18.90`), normalised text where it is not (`\text{Evelyn}`).
# (answer, completion, equal?) written by hand.
MIXED = [
    ("\\text{Evelyn}", "So the winner is \\boxed{\\text{Evelyn}}.", True),
    ("\\text{Evelyn}", "\\boxed{Evelyn}", True),          # Math-Verify would read E*e*l*n*v*y: text instead
    ("\\text{Evelyn}", "Evelyn", True),
    ("\\text{Evelyn}", "\\boxed{\\text{Emily}}", False),
    ("p - q", "\\boxed{-q + p}", True),                     # symbolic, not text
    ("p - q", "\\boxed{q - p}", False),
    ("5\\text{ cm}", "The side is \\boxed{5}.", True),      # the unit is dropped
    ("5\\text{ cm}", "\\boxed{5.0\\text{ cm}}", True),
    ("5\\text{ cm}", "\\boxed{6\\text{ cm}}", False),
    ("\\$18.90", "\\boxed{18.9}", True),
    ("\\frac{1}{2}", "\\boxed{0.5}", True),
]


def test_dataset_task_decides_math_or_text_per_row(tmp_path):
    answers = [a for a, _, _ in MIXED]
    rows = [{"prompt": f"Question {i}?", "answer": a} for i, a in enumerate(dict.fromkeys(answers))]
    held = _rows(tmp_path, [{"prompt": "held out", "answer": "1"}]).replace("rows.jsonl", "held.jsonl")
    (tmp_path / "rows.jsonl").rename(held)
    cfg = TaskConfig(name="dataset", path=_rows(tmp_path, rows), eval_path=held, num_eval=1)
    task = build_task(cfg)
    (name, fn), = resolve_rewards(cfg, task)
    # One text answer no longer turns Math-Verify off: the math rows keep it, and the start line says so.
    assert task.math and name == "math_verify"
    assert any("5 of 6 answers are mathematical and checked by math_verify; the other 1 (e.g. '\\\\text{Evelyn}') "
               "by normalised text" in n for n in task.notes), task.notes
    got = fn(["p"] * len(MIXED), [c for _, c, _ in MIXED], answer=answers)
    assert got == [1.0 if eq else 0.0 for _, _, eq in MIXED]
    for answer, completion, equal in MIXED:
        assert answer_equal(completion, answer) is equal, (answer, completion)


def test_math_verify_missing_is_a_config_error_with_the_fix(monkeypatch, tmp_path):
    import builtins

    real = builtins.__import__

    def no_math_verify(name, *a, **k):
        if name == "math_verify":
            raise ImportError("No module named 'math_verify'")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_math_verify)
    with pytest.raises(ConfigError, match=r"pip install 'trainfit\[math\]'"):
        resolve_rewards(TaskConfig(name="arithmetic", rewards=["math_verify"]), build_task(TaskConfig(name="arithmetic")))
    with pytest.raises(ConfigError, match=r"pip install 'trainfit\[math\]'"):
        build_task(TaskConfig(name="dataset", path=_rows(tmp_path, [{"prompt": "1+1", "answer": 2}] * 3), num_eval=1))
