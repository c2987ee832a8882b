"""Scripted stand-ins for the rollout engine and environments, shared by the env tests."""

from __future__ import annotations

from typing import Callable, Optional

from trainfit.envs import BaseEnv, StepResult
from trainfit.rollout.base import Completion


class ScriptedEngine:
    """Returns fixed token ids: reply(prompt_ids, seed, turn) -> ids. Records every generate call."""

    def __init__(self, tokenizer, reply: Callable[[list[int], int, int], list[int]]):
        self.tok, self.reply, self.calls = tokenizer, reply, []

    def generate(self, prompts, *, greedy=False, seeds=None, max_new_tokens=None, batch_size=None,
                 logprobs=False, temperature=None):
        turn = len(self.calls)
        self.calls.append({"prompts": [list(p) for p in prompts], "seeds": list(seeds), "max_new_tokens": max_new_tokens})
        out = []
        for p, s in zip(prompts, seeds):
            ids = list(self.reply(p, s, turn))[:max_new_tokens]
            eos = self.tok.eos_token_id
            out.append(Completion(ids, self.tok.decode(ids, skip_special_tokens=True), bool(ids) and ids[-1] == eos,
                                  [-0.5] * len(ids) if logprobs else None))
        return out


class ScriptedEnv(BaseEnv):
    """Opens with one user message, then answers each step with the next scripted StepResult."""

    def __init__(self, steps: list[StepResult], opening: str = "Add 2 and 3.", fail_at: Optional[str] = None,
                 final_reward: float = 0.0):
        self.steps, self.opening, self.fail_at, self.final_reward = list(steps), opening, fail_at, final_reward
        self.actions, self.closed = [], False

    def reset(self, example):
        if self.fail_at == "reset":
            raise RuntimeError("reset exploded")
        return [{"role": "user", "content": self.opening}]

    def step(self, action):
        self.actions.append(action)
        if self.fail_at == f"step{len(self.actions)}":
            raise RuntimeError("step exploded")
        if not self.steps:
            return StepResult([{"role": "user", "content": "go on"}], 0.0, False, {})
        return self.steps.pop(0)

    def finish(self):
        return self.final_reward

    def close(self):
        self.closed = True
