"""Tool-use environment: call parsing, the calculator's safety, and episodes on the tiny preset."""

from __future__ import annotations

import json

import pytest
import torch

from envs_helpers import ScriptedEngine
from trainfit.config import ConfigError, ModelConfig, PeftConfig, RolloutConfig
from trainfit.envs import ToolEnv, build_env_factory, calculator, load_tools, parse_tool_calls, run_episodes, safe_eval
from trainfit.models.policy import load_policy
from trainfit.models.tokenizer import build_tokenizer
from trainfit.rollout.hf import HFEngine
from trainfit.tasks import Example, numeric_match
from trainfit.models.logprobs import batch_tensors

from conftest import tiny_config


def lookup(city: str, units: str = "C") -> dict:
    """Current temperature of a city.

    Args:
        city: The city name.
        units: C or F.
    """
    return {"city": city, "temp": 21 if units == "C" else 70}


def make_env(tools=(calculator, lookup)):
    env = ToolEnv(list(tools), [("numeric_match", numeric_match)])
    env.reset(Example(None, [{"role": "user", "content": "What is 37*12?"}], "444", "444", {}))
    return env


def call(name, args):
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def test_valid_tool_calls_run_and_come_back_as_tool_messages():
    env = make_env()
    res = env.step("Let me compute. " + call("calculator", {"expression": "37*12"}) + call("lookup", {"city": "Oslo"}))
    assert not res.done and res.reward == 0.0
    assert res.observation == [{"role": "tool", "name": "calculator", "content": "444"},
                               {"role": "tool", "name": "lookup", "content": '{"city": "Oslo", "temp": 21}'}]
    assert res.info == {"tool_calls": 2, "tool_errors": 0}
    calls, errors = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert calls == [{"name": "f", "arguments": {"x": 1}}] and errors == []  # arguments given as a JSON string
    # Nested arguments within the limit are the user's own JSON, and parse.
    deep = {"a": {"b": {"c": {"d": [[[1]]]}}}}
    calls, errors = parse_tool_calls(call("f", deep))
    assert calls == [{"name": "f", "arguments": deep}] and errors == []


@pytest.mark.parametrize("action, expect", [
    ("<tool_call>{not json}</tool_call>", "not valid JSON"),
    ("<tool_call>[1, 2]</tool_call>", "must be a JSON object"),
    ('<tool_call>{"name": "calculator"', "not closed"),
    (call("weather", {"city": "Oslo"}), "unknown tool 'weather'; available tools: calculator, lookup"),
    (call("calculator", {}), "bad arguments for calculator: missing a required argument: 'expression'"),
    (call("calculator", {"expression": 5}), "expression must be a JSON string"),
    (call("lookup", {"city": "Oslo", "country": "NO"}), "bad arguments for lookup"),
    (call("calculator", {"expression": "1/0"}), "calculator raised ZeroDivisionError"),
    (call("calculator", "2+2"), "must be a JSON object"),
    # json.loads recurses per bracket: 100k of them was a RecursionError out of env.step.
    ("<tool_call>" + "[" * 100_000 + "</tool_call>", "nests brackets more than 32 deep"),
    # An integer of 5000 digits is a ValueError (int()'s digit limit), not a JSONDecodeError.
    ('<tool_call>{"name": "calculator", "arguments": {"expression": ' + "9" * 5000 + "}}</tool_call>",
     "a number too long to read"),
])
def test_bad_tool_calls_answer_with_an_error_message_not_a_crash(action, expect):
    env = make_env()
    res = env.step(action)
    assert not res.done and len(res.observation) == 1
    msg = res.observation[0]
    assert msg["role"] == "tool" and msg["content"].startswith("error:") and expect in msg["content"]
    assert res.info["tool_errors"] == 1


def test_final_answer_ends_with_the_task_reward_and_a_format_signal():
    env = make_env()
    env.step(call("calculator", {"expression": "37*12"}))
    res = env.step("The answer is 444.")
    assert res.done and res.observation == [] and res.reward == 1.0
    assert res.info["format"] == 1.0 and res.info["reward/numeric_match"] == 1.0
    env = make_env()
    env.step("<tool_call>oops</tool_call>")
    res = env.step("443")
    assert res.reward == 0.0 and res.info["format"] == 0.0


def test_calculator_is_arithmetic_only():
    assert calculator("(37 + 5) * 12") == "504" and calculator("7 / 2") == "3.5" and calculator("2**10") == "1024"
    assert calculator("-3 // 2 + 10 % 4") == "0"
    for bad in ["__import__('os').system('true')", "x + 1", "(1).real", "[1, 2]", "'a' * 3", "9**9**9",
                "lambda: 1", "1 if 1 else 2", "a" * 300]:
        with pytest.raises(ValueError):
            safe_eval(bad)


def test_tools_from_config_specs(tmp_path):
    f = tmp_path / "mytools.py"
    f.write_text('def shout(text: str) -> str:\n    """Upper-case text.\n\n    Args:\n        text: What to shout.\n    """\n'
                 '    return text.upper()\n\ndef bare(x):\n    return x\n')
    (fn,) = load_tools([f"{f}:shout"])
    assert fn("hi") == "HI" and load_tools([]) == [calculator]
    assert load_tools(["trainfit.envs.tools:calculator"]) == [calculator]
    with pytest.raises(ConfigError, match=r"env.tools entry .*docstring"):
        load_tools([f"{f}:bare"])
    with pytest.raises(ConfigError, match=r"env.tools entry 'nope' is not `module:function`"):
        load_tools(["nope"])
    with pytest.raises(ConfigError, match=r"env.tools entry .* has no function 'missing'"):
        load_tools([f"{f}:missing"])


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_scripted_two_turn_episode_with_the_real_chat_template(tok):
    eos = tok.eos_token_id
    turns = [tok(call("calculator", {"expression": "37*12"}), add_special_tokens=False)["input_ids"] + [eos],
             tok("It is 444.", add_special_tokens=False)["input_ids"] + [eos]]
    engine = ScriptedEngine(tok, lambda p, s, t: turns[t])
    ex = Example(None, [{"role": "user", "content": "What is 37*12?"}], "444", "444", {})
    (ep,) = run_episodes(lambda: ToolEnv([calculator], [("numeric_match", numeric_match)]), [ex], engine, tok,
                         seeds=[1], max_turns=4, max_new_tokens=64, max_prompt_length=512)
    assert ep.done and ep.reward == 1.0 and ep.turns == 2
    assert [m["role"] for m in ep.messages] == ["user", "assistant", "tool", "assistant"]
    assert ep.messages[2] == {"role": "tool", "name": "calculator", "content": "444"}
    # The tokens are the template's rendering of the transcript with the tools' schemas.
    schema = ToolEnv([calculator], []).tools
    text = tok.apply_chat_template(ep.messages, tools=schema, tokenize=False)
    assert tok.decode(ep.input_ids) + "\n" == text
    assert "<tools>\n" + json.dumps(schema[0], ensure_ascii=False) in text and "<tool_response>\n444\n</tool_response>" in text
    policy = [t for t, m in zip(ep.input_ids, ep.loss_mask) if m]
    assert policy == turns[0] + turns[1]
    # The first policy token sits right after the generation prompt.
    first = ep.loss_mask.index(1)
    assert tok.decode(ep.input_ids[:first]).endswith("<|im_start|>assistant\n")


def test_real_engine_on_the_tiny_preset_gives_consistent_masks(tmp_path):
    cfg = tiny_config(tmp_path, "grpo", **{"env.type": "tools", "rollout.max_turns": 2, "task.chat": "true",
                                          "rollout.max_new_tokens": 12, "env.max_observation_tokens": 48})
    lm = load_policy(ModelConfig(name="preset:tiny", seed=1), PeftConfig(), torch.device("cpu"))
    from trainfit.tasks import build_task
    task = build_task(cfg.task)
    base_env = build_env_factory(cfg, task, lm.model, lm.tokenizer, False, torch.device("cpu"))
    assert isinstance(base_env(), ToolEnv)

    class CallsFirst(ToolEnv):  # a random model never calls a tool; make its first reply one
        def step(self, action):
            first = self.n_calls == 0
            return super().step(action + call("calculator", {"expression": "1+1"}) if first else action)

    make_env = lambda: CallsFirst([calculator], [("numeric_match", numeric_match)])
    engine = HFEngine(lm.model, lm.tokenizer, RolloutConfig(max_new_tokens=12))
    examples = [task.train_example(0)] * 3 + [task.train_example(1)] * 3
    eps = run_episodes(make_env, examples, engine, lm.tokenizer, seeds=list(range(6)), max_turns=2,
                       max_new_tokens=12, max_prompt_length=512, max_observation_tokens=48, logprobs=True)
    for ep in eps:
        assert not ep.failed, ep.error
        assert ep.turns == 2 and ep.messages[2]["content"] == "2"
        assert [s for s, _ in ep.segments] == ["prompt", "policy", "template", "env", "policy"] or \
            [s for s, _ in ep.segments] == ["prompt", "policy", "env", "policy"]
        assert len(ep.input_ids) == len(ep.loss_mask) == sum(n for _, n in ep.segments)
        assert sum(ep.loss_mask) == sum(n for s, n in ep.segments if s == "policy") > 0
        assert len(ep.input_ids) <= 512 + 2 * (12 + 48)
        assert len(ep.logprobs) == sum(ep.loss_mask) and all(lp <= 0 for lp in ep.logprobs)
    ids, attn, mask = batch_tensors([{"input_ids": e.input_ids, "loss_mask": e.loss_mask} for e in eps], 0, "cpu")
    assert int(mask.sum()) == sum(sum(e.loss_mask) for e in eps)  # first tokens are prompt, never shifted out


# The preset template before tools existed: without tools and tool messages the output must not change.
OLD_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ m['content'] }}<|im_end|>{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.mark.parametrize("msgs", [
    [{"role": "user", "content": "12+7="}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo\n"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}, {"role": "user", "content": "b"}],
])
def test_template_without_tools_is_byte_identical_to_before(tok, msgs):
    for gen in (False, True):
        assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen) == \
            tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen, chat_template=OLD_TEMPLATE)
    new = tok.apply_chat_template(msgs, return_dict=True, return_assistant_tokens_mask=True)
    old = tok.apply_chat_template(msgs, return_dict=True, return_assistant_tokens_mask=True, chat_template=OLD_TEMPLATE)
    assert new["input_ids"] == old["input_ids"] and new["assistant_masks"] == old["assistant_masks"]
