"""run_episodes(as_ready=True), the asynchronous rollout worker's episodes: each episode goes on as soon as its
environment answers, so a slow environment turn holds up only its own episode, and the episodes are the ones
lock-step gives (each turn sampled with its episode's own seed)."""

from __future__ import annotations

import threading

import pytest

from envs_helpers import ScriptedEngine, ScriptedEnv
from trainfit.envs import StepResult, run_episodes
from trainfit.models.tokenizer import build_tokenizer
from trainfit.tasks import Example


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def ex(i):
    return Example(f"task {i}", None, "7", "7", {"id": i})


def by_seed(tok):
    """An engine whose reply depends only on the row's prompt length and seed (never on the rows beside it)."""
    return ScriptedEngine(tok, lambda p, s, t: tok(f"say {s % 97} {len(p) % 13}", add_special_tokens=False)["input_ids"])


def test_as_ready_gives_the_lock_step_episodes(tok):
    # Three turns; episode i's environment ends it after i + 1 steps (1, 2, 3 and 3), rewards by step.
    def make_env_factory():
        count = iter(range(100))

        def make():
            i = next(count) % 4
            steps = [StepResult([{"role": "user", "content": f"obs {j}"}], 0.1 * (j + 1), j == i, {}) for j in range(3)]
            return ScriptedEnv(steps)
        return make

    kw = dict(seeds=[11, 22, 33, 44], max_turns=3, max_new_tokens=8, max_prompt_length=64)
    lock = run_episodes(make_env_factory(), [ex(i) for i in range(4)], by_seed(tok), tok, **kw)
    engine = by_seed(tok)
    ready = run_episodes(make_env_factory(), [ex(i) for i in range(4)], engine, tok, as_ready=True, **kw)
    assert [(e.input_ids, e.loss_mask, e.reward, e.turns, e.info["end"]) for e in ready] == \
           [(e.input_ids, e.loss_mask, e.reward, e.turns, e.info["end"]) for e in lock]
    assert [e.turns for e in ready] == [1, 2, 3, 3]


class Gate(ScriptedEnv):
    """Episode "slow" blocks in its first step until episode "fast" has ended (or 10 s pass); it records
    whether "fast" ended while its own turn was in flight."""

    fast_done = threading.Event()

    def __init__(self, name: str):
        steps = [StepResult([{"role": "user", "content": "again"}], 0.0, False, {}) for _ in range(2)]
        super().__init__(steps + [StepResult([], 1.0, True, {})])
        self.name, self.saw_fast_done = name, None

    def step(self, action):
        if self.name == "slow" and not self.actions:
            self.saw_fast_done = Gate.fast_done.wait(timeout=10)
        res = super().step(action)
        if self.name == "fast" and res.done:
            Gate.fast_done.set()
        return res


@pytest.mark.parametrize("as_ready", [True, False], ids=["as_ready", "lock_step"])
def test_a_slow_turn_holds_up_only_its_own_episode(tok, as_ready):
    Gate.fast_done = threading.Event()
    envs = [Gate("slow"), Gate("fast")]
    made = iter(envs)
    if not as_ready:   # lock-step: the fast episode's next turn waits for the slow turn (the gate times out)
        Gate.fast_done.set()   # ...so open the gate: only the call pattern is compared below
    engine = by_seed(tok)
    eps = run_episodes(lambda: next(made), [ex(0), ex(1)], engine, tok, seeds=[1, 2], max_turns=3, max_new_tokens=8,
                       max_prompt_length=64, as_ready=as_ready)
    assert [e.turns for e in eps] == [3, 3] and all(e.done for e in eps)
    if as_ready:
        # the fast episode played all three turns while the slow one's first turn was in flight
        assert envs[0].saw_fast_done is True
        assert [len(c["prompts"]) for c in engine.calls][:3] == [2, 1, 1]
    else:
        assert [len(c["prompts"]) for c in engine.calls] == [2, 2, 2]
