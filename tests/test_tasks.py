"""Tasks and rewards: determinism, train/eval disjointness, correct targets, the tasks' own
evaluation, JSONL validation, user reward loading, and the weighted scoring of a batch."""

from __future__ import annotations

import json
import math

import pytest
import torch

from trainfit.config import Config, ConfigError, TaskConfig
from trainfit.config.schema import expand_stages
from trainfit.tasks import (ArithmeticTask, Example, JsonlTask, build_task,
                            load_reward, resolve_rewards, resolve_weights, score)
from trainfit.tasks.rewards import exact_match, format_reward, numeric_match


def _arith(name="arithmetic", **kw) -> ArithmeticTask:
    return build_task(TaskConfig(name=name, **kw))


def _expr(ex: Example) -> str:
    return ex.fields["expression"]


def test_stream_is_deterministic_in_seed_and_index():
    a, b, c = _arith(seed=1), _arith(seed=1), _arith(seed=2)
    first = [a.train_example(i).prompt for i in range(100)]
    assert first == [b.train_example(i).prompt for i in range(100)]
    assert first != [c.train_example(i).prompt for i in range(100)]
    # Example i does not depend on what was drawn before it (resume and data-parallel ranks rely
    # on this): ask in reverse order on a fresh task.
    assert [a.train_example(i).prompt for i in reversed(range(100))] == first[::-1]
    assert [e.prompt for e in a.eval_examples()] == [e.prompt for e in b.eval_examples()]


@pytest.mark.parametrize("name", ["arithmetic", "arithmetic_tagged"])
def test_train_never_yields_a_heldout_problem(name):
    # Default space: 21*21 operand pairs x 2 operators = 882 problems, 200 held out, so a stream
    # that ignored the held-out set would hit it in ~23% of 5000 draws.
    task = _arith(name)
    held = {_expr(e) for e in task.eval_examples()}
    assert len(held) == len(task.eval_examples()) == 200
    train = {_expr(task.train_example(i)) for i in range(5000)}
    assert not train & held
    # Nearly the whole non-held-out space is reached, so exclusion is not just a narrow stream.
    assert len(train) > 600


def test_num_train_cycles_a_fixed_set_and_a_stage_may_set_its_own():
    full = build_task(TaskConfig(name="arithmetic", max_operand=99, num_eval=100))
    few = build_task(TaskConfig(name="arithmetic", max_operand=99, num_eval=100, num_train=50))
    held = {_expr(e) for e in few.eval_examples()}
    drawn = [few.train_example(i).prompt for i in range(500)]
    # Index i is the set's i mod 50: the first 50 draws of the full stream, then again from the start.
    assert drawn[:50] == [full.train_example(i).prompt for i in range(50)]
    assert drawn[50:100] == drawn[:50] and drawn[450:] == drawn[:50]
    assert len(set(drawn)) <= 50 and not {p.rstrip("=") for p in drawn} & held
    # The full space draws far more distinct problems in as many steps; the held-out set is the same.
    assert len({full.train_example(i).prompt for i in range(500)}) > 400
    assert [e.prompt for e in full.eval_examples()] == [e.prompt for e in few.eval_examples()]
    # In a pipeline, SFT can learn from the few labelled problems while GRPO draws from every problem.
    sft, grpo = expand_stages(Config(model={"name": "preset:tiny"}, task={"name": "arithmetic", "max_operand": 99},
                                     stages=[{"stage": "sft", "task": {"num_train": 50}}, {"stage": "grpo"}]))
    assert (sft.task.num_train, grpo.task.num_train) == (50, None)


def test_hash_threshold_path_is_disjoint_too(monkeypatch):
    # Large spaces are not enumerated; force that path on the small space, where held-out problems
    # are about half of it and a missed membership check would show up at once.
    monkeypatch.setattr(ArithmeticTask, "enumerate_limit", 0)
    task = _arith(num_eval=100)
    held = {_expr(e) for e in task.eval_examples()}
    assert len(held) == 100
    train = [_expr(task.train_example(i)) for i in range(5000)]
    assert not set(train) & held
    assert not any(task.is_heldout(e) for e in train)


def test_targets_are_the_value_of_the_expression():
    task = _arith(num_operands=3, max_operand=12, operations="+-*")
    exs = [task.train_example(i) for i in range(500)] + task.eval_examples()
    for ex in exs:
        expr = _expr(ex)
        assert ex.prompt == f"{expr}="
        # Python's own evaluator as the reference (the task has its own precedence code).
        assert int(ex.answer) == eval(expr) and ex.target == ex.answer
    assert any(int(ex.answer) < 0 for ex in exs), "subtraction should produce negative answers"
    assert {op for ex in exs for op in "+-*" if op in _expr(ex)} == {"+", "-", "*"}

    tagged = _arith("arithmetic_tagged")
    ex = tagged.train_example(0)
    assert ex.prompt == f"{_expr(ex)} in tags:"
    assert ex.target == f"<answer>{eval(_expr(ex))}</answer>"
    assert tagged.is_correct(ex.target, ex) and tagged.stop_strings() == ["</answer>"]


def test_chat_mode_gives_messages():
    ex = _arith(chat=True).train_example(0)
    assert ex.prompt is None
    assert ex.messages == [{"role": "user", "content": f"{_expr(ex)}="}]


def test_operand_range_and_count():
    task = _arith(num_operands=4, max_operand=5, operations="*")
    for i in range(200):
        operands = [int(x) for x in _expr(task.train_example(i)).split("*")]
        assert len(operands) == 4 and all(0 <= x <= 5 for x in operands)


def test_too_many_eval_problems_is_a_config_error():
    # max_operand=3, one operator: 16 problems, so at most 8 can be held out.
    with pytest.raises(ConfigError, match=r"task.num_eval=200.*<= 8"):
        _arith(max_operand=3, operations="+")


@pytest.mark.parametrize("completion, ok", [
    ("19", True), (" 19\n", True), ("19 because 12+7", True), ("18", False), ("191", False),
    ("-19", False), ("", False), ("abc", False), ("= 19", False), ("1 9", False)])
def test_arithmetic_is_correct(completion, ok):
    ex = Example("12+7=", None, "19", "19", {"answer": "19"})
    task = _arith()
    assert task.is_correct(completion, ex) is ok
    # The default reward is the same judgement.
    (name, fn), = task.reward_funcs()
    assert name == "correctness"
    assert fn(["12+7="], [completion], answer=["19"]) == [1.0 if ok else 0.0]


def test_negative_answers_are_judged():
    ex = Example("3-12=", None, "-9", "-9", {})
    assert _arith().is_correct("-9", ex) and not _arith().is_correct("9", ex)


@pytest.mark.parametrize("completion, fmt, correct", [
    ("<answer>19</answer>", 1.0, 1.0),
    ("  <answer> 19 </answer>\n", 1.0, 1.0),
    ("<answer>18</answer>", 1.0, 0.0),
    ("19", 0.0, 0.0),                                 # no tags -> no credit for correctness either
    ("The sum is <answer>19</answer>.", 0.0, 1.0),    # right answer, extra text breaks the format
    ("<answer>19", 0.0, 0.0),
    ("<answer>nineteen</answer>", 0.0, 0.0),
    ("<answer>19</answer><answer>20</answer>", 0.0, 1.0),
])
def test_tagged_rewards(completion, fmt, correct):
    task = _arith("arithmetic_tagged")
    ex = Example("12+7 in tags:", None, "19", "<answer>19</answer>", {"answer": "19"})
    rewards = dict(task.reward_funcs())
    assert list(rewards) == ["format", "correctness"]
    assert rewards["format"](["p"], [completion], answer=["19"]) == [fmt]
    assert rewards["correctness"](["p"], [completion], answer=["19"]) == [correct]
    assert task.is_correct(completion, ex) is (correct == 1.0)
    # The built-in `format` reward uses the same regex by default.
    assert format_reward(["p"], [completion], answer=["19"]) == [fmt]


def _write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_split_fields_and_targets(tmp_path):
    rows = [{"prompt": f"{i}+{i}=", "answer": 2 * i, "level": i % 3} for i in range(20)]
    rows[0]["completion"] = "the answer is 0"
    rows[1] = {"messages": [{"role": "user", "content": "Capital of France?"}], "answer": "Paris"}
    path = _write_jsonl(tmp_path / "data.jsonl", rows)
    task = build_task(TaskConfig(name="jsonl", path=str(path), num_eval=5, seed=3))
    held = task.eval_examples()
    train = [task.train_example(i) for i in range(task.num_train)]
    key = lambda e: e.prompt or e.messages[0]["content"]
    # One epoch visits each training row once; train and eval split the file exactly.
    assert len(held) == 5 and task.num_train == 15 and len({key(e) for e in train}) == 15
    assert {key(e) for e in train} | {key(e) for e in held} == {r.get("prompt") or "Capital of France?" for r in rows}
    assert not {key(e) for e in train} & {key(e) for e in held}
    everything = {key(e): e for e in train + held}
    # Answers become strings; every row field is kept; `completion` is the SFT target.
    e0, e1, e7 = everything["0+0="], everything["Capital of France?"], everything["7+7="]
    assert e0.target == "the answer is 0" and e0.answer == "0"
    assert e7.answer == "14" and e7.target == "14" and e7.fields["level"] == 1
    assert e1.prompt is None and e1.messages[0]["content"] == "Capital of France?"
    # Numeric answers compare numbers, others exact text; the default reward agrees.
    assert task.is_correct("so 7+7 = 14.0", e7) and not task.is_correct("14 or 15", e7)
    assert task.is_correct(" Paris ", e1) and not task.is_correct("paris", e1)
    (name, fn), = task.reward_funcs()
    assert fn(["a", "b"], ["14", "Paris."], answer=["14", "Paris"], level=[1, None]) == [1.0, 0.0]
    # Determinism and a fresh order per epoch.
    again = JsonlTask(str(path), num_eval=5, seed=3)
    assert [key(again.train_example(i)) for i in range(40)] == [key(task.train_example(i)) for i in range(40)]
    assert [key(task.train_example(i)) for i in range(15)] != [key(task.train_example(i)) for i in range(15, 30)]


def test_jsonl_eval_path_and_chat(tmp_path):
    train = _write_jsonl(tmp_path / "train.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}])
    ev = _write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "c", "answer": "3"}])
    task = build_task(TaskConfig(name="jsonl", path=str(train), eval_path=str(ev), chat=True))
    assert task.num_train == 2
    assert [e.messages for e in task.eval_examples()] == [[{"role": "user", "content": "c"}]]


@pytest.mark.parametrize("bad, message", [
    ({"prompt": "2+2="}, r"line 3 has no `answer`"),
    ({"answer": "4"}, r"line 3 has neither `prompt` nor `messages`"),
    ('{"prompt": "2+2=", ', r"line 3 is not valid JSON"),
    ('{"prompt": "2+2=', r"\(Unterminated string starting at column 12\)"),   # json's message ends in "at"
    ({"prompt": ["2+2="], "answer": 4}, r"line 3: `prompt` is a list"),
    ({"messages": "hi", "answer": 4}, r"line 3: `messages` must be"),
])
def test_jsonl_bad_row_names_file_and_line(tmp_path, bad, message):
    # Line 2 is blank: line numbers count lines in the file, not rows.
    path = _write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "1+1=", "answer": 2}, "", bad])
    with pytest.raises(ConfigError, match=message) as err:
        build_task(TaskConfig(name="jsonl", path=str(path), num_eval=0))
    assert "rows.jsonl" in str(err.value) and "e.g." in str(err.value)


def test_jsonl_missing_file_and_too_few_rows(tmp_path):
    with pytest.raises(ConfigError, match="task.path=.*does not exist"):
        build_task(TaskConfig(name="jsonl", path=str(tmp_path / "nope.jsonl")))
    path = _write_jsonl(tmp_path / "small.jsonl", [{"prompt": "a", "answer": 1}] * 3)
    with pytest.raises(ConfigError, match="task.num_eval=200 would hold out all 3 rows"):
        build_task(TaskConfig(name="jsonl", path=str(path)))


def test_numeric_match_reads_numbers_as_math_scoring_does():
    # The look-alikes math_verify's scoring normalises count for numeric_match too: a Unicode minus
    # (U+2212) is a minus, an answer written with one is -3 as well, and a sign or a digit still counts
    # (3 is not -3, 180 is not 18).
    comps = ["x = \u22123", "-3", "So she pays \\$18 in total.", "1e3", "3", "180"]
    answers = ["-3", "\u22123", "18", "1000", "-3", "18"]
    assert numeric_match([""] * 6, comps, answer=answers) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0]


def test_unknown_task_name_lists_valid_ones():
    with pytest.raises(ConfigError, match="arithmetic, arithmetic_tagged, jsonl"):
        build_task(TaskConfig(name="gsm8k"))
    with pytest.raises(ConfigError, match="task.name is not set"):
        build_task(TaskConfig())


def test_builtin_rewards():
    answers = ["1000", "0.5", "Paris"]
    comps = ["it is 1,000", "1/2 = 0.5000000001", "Paris"]
    assert numeric_match([""] * 3, comps, answer=answers) == [1.0, 1.0, 0.0]
    assert exact_match([""] * 3, comps, answer=answers) == [0.0, 0.0, 1.0]
    # A row's own format regex overrides the default answer-tag one; None falls back to it.
    assert format_reward(["", ""], ["ANSWER: 3", "<answer>3</answer>"], answer=["3", "3"],
                         format_regex=[r"^ANSWER: \d+$", None]) == [1.0, 1.0]


USER_REWARDS = '''
THRESHOLD = 3

def short(prompts, completions, **fields):
    return [1.0 if len(c) <= THRESHOLD else 0.0 for c in completions]

def by_level(prompts, completions, answer, level):
    # Names only the fields it uses, so it must not receive others.
    return [float(lv) for lv in level]
'''


def test_user_reward_from_file_and_module(tmp_path, monkeypatch):
    (tmp_path / "user_rewards.py").write_text(USER_REWARDS)
    from_file = load_reward(f"{tmp_path}/user_rewards.py:short")
    assert from_file(["p", "p"], ["ab", "abcd"], answer=["", ""]) == [1.0, 0.0]
    monkeypatch.syspath_prepend(str(tmp_path))
    from_module = load_reward("user_rewards:short")
    assert from_module(["p"], ["abcd"], answer=[""]) == [0.0]
    # Through the config: `default` expands to the task's rewards and shares its weight.
    cfg = TaskConfig(name="arithmetic_tagged", rewards=["default", f"{tmp_path}/user_rewards.py:short"],
                     reward_weights=[0.5, 2.0])
    task = build_task(cfg)
    assert [n for n, _ in resolve_rewards(cfg, task)] == ["format", "correctness", "short"]
    assert resolve_weights(cfg, task) == [0.5, 0.5, 2.0]


@pytest.mark.parametrize("spec, message", [
    ("{dir}/missing.py:short", "does not exist"),
    ("{dir}/user_rewards.py:nope", "has no function 'nope'.*short"),
    ("{dir}/user_rewards.py:THRESHOLD", r"is not callable \(it is a int\)"),
    ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
    ("just_a_name", "neither `default`, a built-in"),
])
def test_bad_reward_specs(tmp_path, spec, message):
    (tmp_path / "user_rewards.py").write_text(USER_REWARDS)
    spec = spec.format(dir=tmp_path)
    cfg = TaskConfig(name="arithmetic", rewards=[spec])
    with pytest.raises(ConfigError, match=message) as err:
        resolve_rewards(cfg, build_task(cfg))
    assert "task.rewards" in str(err.value) and spec in str(err.value)


def test_duplicate_reward_names_are_rejected():
    cfg = TaskConfig(name="arithmetic_tagged", rewards=["default", "format"])
    with pytest.raises(ConfigError, match="two rewards named 'format'.*reward_weights"):
        resolve_rewards(cfg, build_task(cfg))


def _examples():
    return [Example("1+1=", None, "2", "2", {"level": 1}), Example("2+2=", None, "4", "4", {"level": 3})]


def test_score_weights_and_fields(tmp_path):
    (tmp_path / "user_rewards.py").write_text(USER_REWARDS)
    fns = [("correct", _arith().correctness_reward),
           ("level", load_reward(f"{tmp_path}/user_rewards.py:by_level"))]
    total, per = score(fns, [2.0, 0.5], ["1+1=", "2+2="], ["2", "5"], _examples())
    # correct = [1, 0], level = [1, 3]  ->  total = 2*[1, 0] + 0.5*[1, 3] = [2.5, 1.5]
    assert torch.equal(per["correct"], torch.tensor([1.0, 0.0]))
    assert torch.equal(per["level"], torch.tensor([1.0, 3.0]))
    assert torch.equal(total, torch.tensor([2.5, 1.5]))
    # weights=None means all 1.
    total, _ = score(fns, None, ["1+1=", "2+2="], ["2", "5"], _examples())
    assert torch.equal(total, torch.tensor([2.0, 3.0]))


@pytest.mark.parametrize("out, message", [
    ([1.0, math.nan], "non-finite"),
    ([1.0, math.inf], "non-finite"),
    ([1.0], "returned 1 values for 2 completions"),
    ([1.0, None], "must return a list of floats"),
])
def test_score_checks_outputs(out, message):
    fns = [("ok", lambda p, c, **f: [0.0] * len(c)), ("broken", lambda p, c, **f: out)]
    with pytest.raises(RuntimeError, match=f"'broken'.*{message}"):
        score(fns, None, ["a", "b"], ["x", "y"], _examples())


def test_score_names_a_function_that_raises():
    def crashes(prompts, completions, **fields):
        raise KeyError("solution")
    with pytest.raises(RuntimeError, match="'crashes' raised KeyError"):
        score([("crashes", crashes)], None, ["a", "b"], ["x", "y"], _examples())


def test_tagged_task_through_score_matches_is_correct():
    # End to end as the trainer uses it: resolve the default rewards, score a batch, and check
    # that correctness equals the eval judgement on the same completions.
    cfg = TaskConfig(name="arithmetic_tagged", num_eval=20)
    task = build_task(cfg)
    exs = task.eval_examples()[:4]
    comps = [exs[0].target, "<answer>99999</answer>", f"answer {exs[2].answer}", f" {exs[3].target} "]
    total, per = score(resolve_rewards(cfg, task), resolve_weights(cfg, task),
                       [e.prompt for e in exs], comps, exs)
    assert per["format"].tolist() == [1.0, 1.0, 0.0, 1.0]
    assert per["correctness"].tolist() == [float(task.is_correct(c, e)) for c, e in zip(comps, exs)]
    assert per["correctness"].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert total.tolist() == [2.0, 1.0, 0.0, 2.0]
