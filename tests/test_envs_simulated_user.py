"""Simulated-user environment: one copy of the weights, adapters off for the user, domain selection."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from envs_helpers import ScriptedEngine
from trainfit.config import ConfigError, ModelConfig, PeftConfig
from trainfit.envs import (DONE, SimulatedUserEnv, UserSimulator, build_env_factory, env_task, keyword_reward,
                           run_episodes, select_examples)
from trainfit.envs.simulated_user import user_view
from trainfit.models.policy import load_policy
from trainfit.tasks import Example, build_task

from conftest import tiny_config

CPU = torch.device("cpu")
DATA = Path(__file__).resolve().parents[1] / "examples" / "data" / "customer_service.jsonl"


def su_config(tmp_path, **kw):
    return tiny_config(tmp_path, "grpo", **{"env.type": "simulated_user", "peft.method": "lora", "peft.r": 4,
                                            "task.name": "jsonl", "task.path": str(DATA), "task.num_eval": 0,
                                            "rollout.max_turns": 2, "env.user_max_new_tokens": 6, **kw})


@pytest.fixture(scope="module")
def policy():
    lm = load_policy(ModelConfig(name="preset:tiny", seed=2), PeftConfig(method="lora", r=4), CPU)
    with torch.no_grad():  # a non-trivial adapter (lora_B starts at zero), so "adapters off" is visible
        g = torch.Generator().manual_seed(0)
        for n, p in lm.model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return lm


def param_bytes() -> int:
    """Bytes of every distinct parameter storage alive in the process."""
    seen = {}
    for o in gc.get_objects():
        if type(o) is torch.nn.Parameter:  # `type`, not isinstance: no __instancecheck__ on odd objects
            seen[o.data_ptr()] = o.numel() * o.element_size()
    return sum(seen.values())


def test_user_plays_with_the_policys_own_parameters(tmp_path, policy):
    cfg = su_config(tmp_path)
    task = env_task(cfg, build_task(cfg.task))
    before = param_bytes()
    make_env = build_env_factory(cfg, task, policy.model, policy.tokenizer, True, CPU)
    env = make_env()
    user = env.user
    assert user.model is policy.model and user.engine.model is policy.model
    ptrs = {n: p.data_ptr() for n, p in policy.model.named_parameters()}
    assert {n: p.data_ptr() for n, p in user.engine.model.named_parameters()} == ptrs
    # The embedding the user's forward passes read is the policy's very tensor, with adapters off.
    seen = []
    emb = policy.model.get_input_embeddings()
    lora = next(m for n, m in policy.model.named_modules() if n.endswith("q_proj") and hasattr(m, "disable_adapters"))
    hook = emb.register_forward_hook(lambda m, i, o: seen.append((m.weight.data_ptr(), lora.disable_adapters)))
    try:
        tok = policy.tokenizer
        engine = ScriptedEngine(tok, lambda p, s, t: tok("Sure, I can help.", add_special_tokens=False)["input_ids"]
                                + [tok.eos_token_id])
        examples = [task.train_example(i) for i in range(3)]
        eps = run_episodes(make_env, examples, engine, tok, seeds=[1, 2, 3], max_turns=2, max_new_tokens=16,
                           max_prompt_length=256, max_observation_tokens=32)
    finally:
        hook.remove()
    assert seen and all(ptr == ptrs[next(n for n in ptrs if n.endswith("embed_tokens.weight"))] for ptr, _ in seen)
    assert all(off for _, off in seen)                 # every user forward ran with adapters disabled
    assert not lora.disable_adapters                  # and they are back on afterwards
    assert param_bytes() == before                    # no second copy of the weights
    for ep in eps:
        assert not ep.failed, ep.error
        assert ep.messages[0]["role"] == "system" and ep.messages[1]["role"] == "user"


def test_with_adapters_the_user_speaks_like_the_base_model(policy):
    base = load_policy(ModelConfig(name="preset:tiny", seed=2), PeftConfig(), CPU)
    view = user_view("You want a refund for order 5531.", "retail", [{"role": "assistant", "content": "Hello!"}])
    kw = dict(max_new_tokens=8, temperature=0.7, seed=3)
    as_user = UserSimulator(policy.model, policy.tokenizer, shares_policy=True, is_peft=True, **kw)
    plain = UserSimulator(base.model, base.tokenizer, shares_policy=False, **kw)
    with_adapter = UserSimulator(policy.model, policy.tokenizer, shares_policy=False, **kw)
    ids = lambda u: u.engine.generate([_ids(policy.tokenizer, view)], greedy=True)[0].token_ids
    with as_user.context():
        disabled = ids(as_user)
    assert disabled == ids(plain)
    assert disabled != ids(with_adapter)  # the adapter does change the outputs, so the check has teeth
    assert as_user.reply(view) == plain.reply(view)  # sampled replies too (seeded by content)


def _ids(tok, view):
    return tok(tok.apply_chat_template(view, tokenize=False, add_generation_prompt=True), add_special_tokens=False)["input_ids"]


def test_domain_and_tasks_per_domain_select_rows(tmp_path):
    rows = build_task(su_config(tmp_path).task)
    all_rows = [rows.train_example(i) for i in range(rows.num_train)]
    assert sorted({e.fields["domain"] for e in all_rows}) == ["airline", "retail", "telecom"]
    picked = select_examples(all_rows, ["airline", "telecom"], 2, seed=7)
    assert [e.fields["domain"] for e in picked] == ["airline", "airline", "telecom", "telecom"]
    assert select_examples(list(reversed(all_rows)), ["airline", "telecom"], 2, seed=7) == picked  # order-free
    draws = {tuple(e.fields["instructions"] for e in select_examples(all_rows, ["retail"], 2, seed=s)) for s in range(8)}
    assert len(draws) > 1                                                   # the seed matters
    assert len(select_examples(all_rows, [], 0, seed=0)) == len(all_rows)    # empty = everything
    with pytest.raises(ConfigError, match=r"env.domains names \['bank'\].*'airline', 'retail', 'telecom'"):
        select_examples(all_rows, ["bank"], 1, seed=0)
    cfg = su_config(tmp_path, **{"env.domains": "[retail]", "env.tasks_per_domain": 3})
    task = env_task(cfg, build_task(cfg.task))
    assert task.num_train == 3 and {task.train_example(i).fields["domain"] for i in range(9)} == {"retail"}
    assert [n for n, _ in task.reward_funcs()] == ["keywords"]


class StubUser:
    """Answers from a script: (text, done) pairs."""

    def __init__(self, script):
        self.script, self.views = list(script), []

    def reply(self, view):
        self.views.append(view)
        return self.script.pop(0)


def test_user_ends_with_done_and_reward_scores_the_agent_side():
    ex = Example(None, [{"role": "system", "content": "You are an agent."}], "refund|QX77", "",
                 {"domain": "airline", "instructions": "Get a refund for QX77.", "keywords": ["refund", "QX77"]})
    user = StubUser([("I want my money back.", False), ("Thanks!", False), ("", True)])
    env = SimulatedUserEnv(user, [("keywords", keyword_reward)])
    opening = env.reset(ex)
    assert opening == [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "I want my money back."}]
    assert user.views[0][0]["role"] == "system" and "Get a refund for QX77." in user.views[0][0]["content"]
    r1 = env.step("Which booking?")
    assert (r1.done, r1.observation) == (False, [{"role": "user", "content": "Thanks!"}])
    # The simulator sees the agent as `user` and itself as `assistant`.
    assert [m["role"] for m in user.views[1][1:]] == ["assistant", "user"]
    r2 = env.step("I issued a refund for QX77.")
    assert r2.done and r2.observation == [] and r2.reward == 1.0 and r2.info["user_done"] == 1.0
    assert env.finish() == 0.0  # scored once
    assert DONE == "###DONE###"
    with pytest.raises(Exception, match="instructions"):
        env.reset(Example(None, [{"role": "user", "content": "x"}], "a", "", {}))


def test_user_model_setting_loads_a_separate_frozen_model(tmp_path, policy):
    cfg = su_config(tmp_path, **{"env.user_model": "preset:tiny", "model.seed": 2})
    make_env = build_env_factory(cfg, build_task(cfg.task), policy.model, policy.tokenizer, True, CPU)
    user = make_env().user
    assert user.model is not policy.model and not user.disable_adapters
    assert not any(p.requires_grad for p in user.model.parameters())
    policy_ptrs = {p.data_ptr() for p in policy.model.parameters()}
    assert not policy_ptrs & {p.data_ptr() for p in user.model.parameters()}
