"""The episode runner: exact token bookkeeping, loss masks, limits, failures, and lock-step generation."""

from __future__ import annotations

import json

import pytest

from envs_helpers import ScriptedEngine, ScriptedEnv
from trainfit.config import ConfigError
from trainfit.envs import ChatRenderer, StepResult, run_episodes, transcript_record, turn_seed
from trainfit.models.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def run(tok, engine, envs, n=None, **kw):
    envs = list(envs)
    n = n or len(envs)
    it = iter(envs)
    args = dict(seeds=list(range(100, 100 + n)), max_turns=4, max_new_tokens=32, max_prompt_length=64,
                max_observation_tokens=32)
    args.update(kw)
    return run_episodes(lambda: next(it), [None] * n, engine, tok, **args)


def test_hand_built_episode_masks_exactly_the_engine_tokens(tok):
    eos = tok.eos_token_id
    t1 = ids(tok, "call add") + [eos]      # turn 1 ends with eos: only the "\n" after it is added
    t2 = ids(tok, "it is 5")               # turn 2 hits the token limit (no eos)
    engine = ScriptedEngine(tok, lambda p, s, turn: [t1, t2][turn])
    env = ScriptedEnv([StepResult([{"role": "user", "content": "result 5"}], 0.25, False, {"k": 1}),
                       StepResult([], 1.0, True, {})])
    (ep,) = run(tok, engine, [env], logprobs=True)
    prompt = ids(tok, "<|im_start|>user\nAdd 2 and 3.<|im_end|>\n<|im_start|>assistant\n")
    between = ids(tok, "\n<|im_start|>user\nresult 5<|im_end|>\n<|im_start|>assistant\n")
    assert ep.input_ids == prompt + t1 + between + t2
    assert ep.loss_mask == [0] * len(prompt) + [1] * len(t1) + [0] * len(between) + [1] * len(t2)
    assert ep.segments == [["prompt", len(prompt)], ["policy", len(t1)], ["template", 1],
                           ["env", len(between) - 1], ["policy", len(t2)]]
    assert ep.logprobs == [-0.5] * (len(t1) + len(t2))
    # The tokens are what the template gives for the whole transcript, the policy's turns included.
    assert tok.decode(ep.input_ids) == tok.apply_chat_template(ep.messages, tokenize=False)[:-len("<|im_end|>\n")]
    assert [m["role"] for m in ep.messages] == ["user", "assistant", "user", "assistant"]
    assert (ep.reward, ep.turns, ep.done, ep.failed, ep.info["end"], ep.info["k"]) == (1.25, 2, True, False, "done", 1)
    assert env.actions == ["call add", "it is 5"] and env.closed
    rec = json.loads(json.dumps(transcript_record(3, ep)))
    assert rec["step"] == 3 and rec["messages"] == ep.messages and rec["reward"] == 1.25 and rec["end"] == "done"
    assert rec["token_roles"] == ep.segments and rec["policy_tokens"] == len(t1) + len(t2)
    assert rec["tokens"] == {"prompt": len(prompt), "policy": len(t1) + len(t2), "template": 1, "env": len(between) - 1}
    assert (rec["failed"], rec["error"], rec["turns"], rec["info"]) == (False, None, 2, {"k": 1})


def test_turn_without_eos_gets_the_end_of_turn_token_with_loss_0(tok):
    t1 = ids(tok, "hello")
    engine = ScriptedEngine(tok, lambda p, s, turn: t1)
    env = ScriptedEnv([StepResult([{"role": "user", "content": "x"}], 0.0, False, {}), StepResult([], 0.0, True, {})])
    (ep,) = run(tok, engine, [env])
    at = len(ep.input_ids) - 2 * len(t1) - len(ids(tok, "<|im_end|>\n<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"))
    assert ep.input_ids[at + len(t1)] == tok.eos_token_id and ep.loss_mask[at + len(t1)] == 0
    assert ep.segments[2] == ["template", 2]  # eos + "\n"


def test_episode_token_limit_ends_the_episode(tok):
    long = ids(tok, "one two three four five six seven eight nine ten")
    engine = ScriptedEngine(tok, lambda p, s, turn: long)
    env = ScriptedEnv([])  # never done
    prompt_len = len(ids(tok, "<|im_start|>user\nAdd 2 and 3.<|im_end|>\n<|im_start|>assistant\n"))
    limit = prompt_len + len(long) + 12  # room for one turn and part of an observation, not a second turn
    (ep,) = run(tok, engine, [env], max_episode_tokens=limit, max_turns=5)
    assert len(ep.input_ids) <= limit and ep.info["end"] == "max_episode_tokens"
    assert ep.turns == 1 and sum(ep.loss_mask) == len(long)
    # A completion longer than the room left is cut to it (and the episode ends there).
    (ep2,) = run(tok, engine, [ScriptedEnv([])], max_episode_tokens=prompt_len + 4, max_turns=5)
    assert len(ep2.input_ids) == prompt_len + 4 and ep2.loss_mask[-4:] == [1] * 4
    assert ep2.messages[1]["content"] == tok.decode(long[:4], skip_special_tokens=True)


def test_default_episode_budget_is_prompt_plus_turns_times_limits(tok):
    engine = ScriptedEngine(tok, lambda p, s, turn: ids(tok, "word " * 40))
    (ep,) = run(tok, engine, [ScriptedEnv([])], max_turns=3, max_new_tokens=20, max_prompt_length=64,
                max_observation_tokens=16)
    assert len(ep.input_ids) <= 64 + 3 * (20 + 16)
    assert ep.turns == 3 and sum(ep.loss_mask) == 3 * 20


def test_max_turns_is_respected_and_finish_reward_added(tok):
    engine = ScriptedEngine(tok, lambda p, s, turn: ids(tok, "hm") + [tok.eos_token_id])
    env = ScriptedEnv([], final_reward=0.5)
    (ep,) = run(tok, engine, [env], max_turns=3)
    assert ep.turns == 3 and len(engine.calls) == 3 and len(env.actions) == 3
    assert ep.info["end"] == "max_turns" and not ep.done and ep.reward == 0.5


def test_failing_env_marks_only_its_episode_failed(tok):
    engine = ScriptedEngine(tok, lambda p, s, turn: ids(tok, "ok") + [tok.eos_token_id])
    envs = [ScriptedEnv([StepResult([], 1.0, True, {})]), ScriptedEnv([], fail_at="step1"),
            ScriptedEnv([], fail_at="reset"), ScriptedEnv([StepResult([{"role": "user", "content": "more"}], 0.0, False, {}),
                                                       StepResult([], 2.0, True, {})])]
    eps = run(tok, engine, envs)
    assert [e.failed for e in eps] == [False, True, True, False]
    assert eps[1].error == "RuntimeError: step exploded" and eps[2].error == "RuntimeError: reset exploded"
    for e in eps[1:3]:
        assert e.reward == 0.0 and set(e.loss_mask) <= {0} and e.info["end"] == "failed"
    assert len(eps[1].input_ids) > 0 and sum(eps[1].loss_mask) == 0  # its tokens are kept, not trained
    assert (eps[0].reward, eps[3].reward, eps[3].turns) == (1.0, 2.0, 2)
    assert all(e.closed for e in envs[:2] + envs[3:])


def test_one_generate_call_per_turn_for_all_live_episodes(tok):
    engine = ScriptedEngine(tok, lambda p, s, turn: ids(tok, f"t{turn}") + [tok.eos_token_id])
    cont = StepResult([{"role": "user", "content": "next"}], 0.0, False, {})
    end = StepResult([], 1.0, True, {})
    envs = [ScriptedEnv([end]), ScriptedEnv([cont, end]), ScriptedEnv([cont, cont, end]), ScriptedEnv([cont, cont, end])]
    eps = run(tok, engine, envs)
    assert [len(c["prompts"]) for c in engine.calls] == [4, 3, 2]
    assert [e.turns for e in eps] == [1, 2, 3, 3]
    seeds = [100, 101, 102, 103]
    assert engine.calls[0]["seeds"] == seeds  # turn 0 keeps the episode's seed
    assert engine.calls[1]["seeds"] == [turn_seed(s, 1) for s in seeds[1:]]
    assert len({turn_seed(100, t) for t in range(5)}) == 5
    # Each call's prompts are the episodes' whole token sequences so far.
    assert engine.calls[2]["prompts"][0] == eps[2].input_ids[:len(engine.calls[2]["prompts"][0])]


def test_long_observation_is_cut_to_its_limit_keeping_the_generation_prompt(tok):
    engine = ScriptedEngine(tok, lambda p, s, turn: ids(tok, "ok") + [tok.eos_token_id])
    big = StepResult([{"role": "user", "content": "blah " * 200}], 0.0, False, {})
    (ep,) = run(tok, engine, [ScriptedEnv([big, StepResult([], 0.0, True, {})])], max_observation_tokens=24)
    env_tokens = ep.segments[3]
    assert env_tokens[0] == "env" and env_tokens[1] <= 24
    gen = ids(tok, "<|im_start|>assistant\n")
    start = sum(n for _, n in ep.segments[:4])
    assert ep.input_ids[start - len(gen):start] == gen
    assert ep.info["observations_truncated"] == 1 and len(ep.messages[2]["content"]) < 1000


def test_template_prefix_property_checked(tok):
    # Rewrites the last assistant turn (as Qwen3 does with think blocks): handled by anchoring.
    t = tok.chat_template.replace("{% generation %}", "{% generation %}{% if loop.last %}<think></think>{% endif %}")
    tok2 = build_tokenizer()
    tok2.chat_template = t
    r = ChatRenderer(tok2)
    want = ids(tok, "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n")
    assert r.observation_ids([{"role": "user", "content": "x"}]) == want
    # Renders messages newest first: no prefix, no anchor -> a clear configuration error.
    tok2.chat_template = ("{% for m in messages|reverse %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    with pytest.raises(ConfigError, match="not prefix-stable"):
        ChatRenderer(tok2)


def test_episode_eval_reports_the_success_rate_the_environment_says(tok, tmp_path):
    """An environment whose infos say `success` (the MiniWoB++ service) gives the held-out success rate,
    also as `accuracy` (what the run's summary chains); a failed episode counts as no success."""
    from types import SimpleNamespace

    from conftest import tiny_config
    from trainfit.train.evaluate import episode_eval

    cfg = tiny_config(tmp_path, "grpo", **{"env.type": "http", "env.url": "http://127.0.0.1:1",
                                          "rollout.max_turns": 2})
    ends = [StepResult([], 1.0, True, {"success": True}), StepResult([], -0.1, False, {"success": False}),
            StepResult([], 1.0, True, {"success": True})]
    envs = iter([ScriptedEnv([ends[0]]), ScriptedEnv([ends[1]]), ScriptedEnv([ends[2]], fail_at="step1"),
                 ScriptedEnv([StepResult([], 0.0, True, {})])])
    task = SimpleNamespace(eval_examples=lambda: [None] * 4)
    engine = ScriptedEngine(tok, lambda p, s, t: ids(tok, "ok") + [tok.eos_token_id])
    out = episode_eval(lambda: next(envs), engine, tok, task, cfg, judge_final=False)
    # Episode 1 succeeded; 2 did not; 3 failed in its environment; 4 never said.
    assert out["success"] == out["accuracy"] == 0.25 and out["eval_env_failed"] == 0.25
    envs = iter([ScriptedEnv([StepResult([], 0.0, True, {})]) for _ in range(4)])
    assert "success" not in episode_eval(lambda: next(envs), engine, tok, task, cfg, judge_final=False)
