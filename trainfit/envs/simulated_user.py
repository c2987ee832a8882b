"""A simulated customer: a model plays the user of a customer-service conversation.

Task rows (JSONL, read by the `jsonl` task; see examples/data/customer_service.jsonl):

    {"domain": "airline", "messages": [{"role": "system", "content": "<the agent's instructions>"}],
     "instructions": "<the user's goal, shown only to the simulated user>",
     "first_message": "<optional opening line; else the user model writes it>",
     "answer": "refund|7 days", "keywords": ["refund", "7 days"]}

The user model sees the conversation with roles swapped (the agent's turns are `user` messages to it,
its own are `assistant`) under a system prompt holding the instructions, and ends the conversation by
writing ###DONE###. By default it is the policy's own module with adapters disabled (no second copy of
the weights); `env.user_model` loads a separate frozen model instead. The reward is computed once, on
the agent's side of the conversation (its turns joined), when the user ends it or the runner's limits do.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
import time
from typing import Optional, Sequence

import torch

from trainfit.config import RolloutConfig
from trainfit.models.policy import reference_context
from trainfit.rollout.hf import HFEngine
from trainfit.tasks import score

from .base import BaseEnv, EnvError, StepResult

DONE = "###DONE###"
USER_SYSTEM = ("You are a customer writing to the {domain} support team. Your goal: {instructions}\n"
               "Write only the customer's next message, in one or two sentences. When your goal is met, or "
               "clearly cannot be met, write " + DONE + ".")


def user_view(instructions: str, domain: str, conversation: list[dict]) -> list[dict]:
    """The simulator's chat: its instructions, then the conversation with user/assistant swapped."""
    swap = {"assistant": "user", "user": "assistant"}
    view = [{"role": "system", "content": USER_SYSTEM.format(domain=domain or "customer", instructions=instructions)}]
    return view + [{"role": swap[m["role"]], "content": m["content"]} for m in conversation if m["role"] in swap]


class UserSimulator:
    """Generates user turns with `model`; thread-safe, and concurrent requests share one generate call.

    Environments step in a thread pool; each `reply` queues its request, waits `window_s` for the
    others, and whichever thread takes the generation lock first runs every queued request in one
    batch. Generation is serialised because disabling adapters toggles state on the shared module.
    """

    def __init__(self, model, tokenizer, *, shares_policy: bool, is_peft: bool = False, max_new_tokens: int = 64,
                 temperature: float = 0.7, seed: int = 0, window_s: float = 0.01):
        self.model, self.tokenizer = model, tokenizer
        # Adapters off only when the module IS the policy; a separate user model has none to disable.
        self.disable_adapters = shares_policy and is_peft
        self.engine = HFEngine(model, tokenizer, RolloutConfig(max_new_tokens=max_new_tokens, temperature=temperature,
                                                               stop=[DONE]))
        limit = getattr(getattr(model, "config", None), "max_position_embeddings", None) or 32768
        self.max_prompt_tokens = max(1, limit - max_new_tokens)
        self.seed, self.window_s = seed, window_s
        self._queue: list[dict] = []
        self._queue_lock, self._gen_lock = threading.Lock(), threading.Lock()

    def context(self):
        if self.disable_adapters:
            return reference_context(self.model, True)
        return contextlib.nullcontext()

    def reply(self, view: list[dict]) -> tuple[str, bool]:
        """(the user's next message without the marker, whether the user ended the conversation)."""
        # Seeded by content: the same conversation gets the same reply, so reruns are reproducible.
        digest = hashlib.sha256(f"{self.seed}|{json.dumps(view, sort_keys=True)}".encode()).digest()
        req = {"view": view, "seed": int.from_bytes(digest[:8], "little") >> 2, "done": threading.Event()}
        with self._queue_lock:
            self._queue.append(req)
        time.sleep(self.window_s)
        with self._gen_lock:
            with self._queue_lock:
                batch, self._queue = self._queue, []
            if batch:
                self._generate(batch)
        req["done"].wait()
        if "error" in req:
            raise EnvError(f"the simulated user's generation failed: {req['error']}")
        text = req["text"]
        return text.split(DONE)[0].strip(), DONE in text

    def _generate(self, batch: list[dict]) -> None:
        try:
            # Rendering and tokenizing here, under the lock: fast tokenizers are not safe to share.
            prompts = [self.tokenizer.apply_chat_template(r["view"], tokenize=False, add_generation_prompt=True)
                       for r in batch]
            ids = [self.tokenizer(p, add_special_tokens=False)["input_ids"][-self.max_prompt_tokens:] for p in prompts]
            with torch.no_grad(), self.context():
                outs = self.engine.generate(ids, seeds=[r["seed"] for r in batch])
            for r, o in zip(batch, outs):
                r["text"] = o.text
        except Exception as e:
            for r in batch:
                r["error"] = f"{type(e).__name__}: {e}"
        finally:
            for r in batch:
                r["done"].set()


class SimulatedUserEnv(BaseEnv):
    """The policy is the agent; `user` plays the customer whose goal is the row's `instructions`."""

    def __init__(self, user: UserSimulator, reward_fns: Sequence[tuple[str, object]],
                 reward_weights: Optional[Sequence[float]] = None):
        self.user, self.reward_fns, self.reward_weights = user, list(reward_fns), reward_weights
        self.example, self.conv, self.scored = None, [], False

    def reset(self, example) -> list[dict]:
        f = example.fields
        if not isinstance(f.get("instructions"), str) or not f["instructions"].strip():
            raise EnvError("a simulated_user task row needs `instructions` (the user's goal, a string); this row "
                           f"has fields {sorted(f)}.")
        self.example, self.scored = example, False
        opening = [dict(m) for m in example.messages] if example.messages is not None else (
            [{"role": "system", "content": example.prompt}] if example.prompt else [])
        first = f.get("first_message")
        if not first:
            first, _ = self.user.reply(self._view([]))
        self.conv = [{"role": "user", "content": first}]
        return opening + self.conv

    def _view(self, conv: list[dict]) -> list[dict]:
        f = self.example.fields
        return user_view(f["instructions"], f.get("domain") or "", conv)

    def step(self, action: str) -> StepResult:
        self.conv.append({"role": "assistant", "content": action})
        text, done = self.user.reply(self._view(self.conv))
        said = [{"role": "user", "content": text}] if text or not done else []
        self.conv.extend(said)
        if done:
            reward, info = self._score()
            return StepResult(said, reward, True, {"user_done": 1.0, **info})
        return StepResult(said, 0.0, False, {})

    def finish(self) -> float:
        return self._score()[0]

    def _score(self) -> tuple[float, dict]:
        if self.scored:  # the reward is given once per episode
            return 0.0, {}
        self.scored = True
        ex = self.example
        agent = "\n".join(m["content"] for m in self.conv if m["role"] == "assistant")
        prompt = ex.prompt if ex.prompt is not None else ex.messages
        total, per = score(self.reward_fns, self.reward_weights, [prompt], [agent], [ex])
        return float(total[0]), {f"reward/{k}": float(v[0]) for k, v in per.items()}
