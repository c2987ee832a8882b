"""The task interface: examples for SFT and GRPO, the task's own evaluation, and its default rewards.

A task is a small class (habit 7, after nanochat `tasks/gsm8k.py`). It yields examples, judges a
completion with `is_correct`, and its default reward *is* that judgement, so the number GRPO
optimises and the accuracy that eval reports cannot drift apart.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

# fn(prompts: list[str], completions: list[str], **fields: list) -> list[float]; see rewards.py.
RewardFn = Callable[..., list]


@dataclass
class Example:
    """One task item. Exactly one of `prompt` / `messages` is set.

    prompt:   raw text prompt (e.g. "12+7="), for models trained without a chat template.
    messages: chat prompt without the answer, e.g. [{"role": "user", "content": "12+7="}].
    answer:   the reference answer as a string ("19"); reward functions compare against it.
    target:   the ideal completion for SFT ("19", "<answer>19</answer>", or a JSONL `completion`).
    fields:   every row field and metadata; each becomes a keyword list for reward functions.
    """

    prompt: Optional[str]
    messages: Optional[list[dict]]
    answer: str
    target: str
    fields: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("Example needs exactly one of `prompt` or `messages`.")


class Task:
    """Base class. Subclasses set `name` and implement the three abstract methods.

    train_example(i): deterministic in (seed, i); generated tasks are an infinite stream, finite
        ones cycle through seeded permutations. Never yields a held-out example.
    eval_examples(): the held-out examples (at most task.num_eval), disjoint from training.
    is_correct(completion, ex): the task's evaluation; eval accuracy and the default reward use it.
    """

    name: str = "task"
    # Training examples before the stream repeats; None for generated (infinite) tasks.
    num_train: Optional[int] = None

    def __init__(self, seed: int = 0, num_eval: int = 0, chat: bool = False) -> None:
        self.seed = seed
        self.num_eval = num_eval
        self.chat = chat

    def train_example(self, i: int) -> Example:
        raise NotImplementedError

    def eval_examples(self) -> list[Example]:
        raise NotImplementedError

    def is_correct(self, completion: str, ex: Example) -> bool:
        raise NotImplementedError

    def reward_funcs(self) -> list[tuple[str, RewardFn]]:
        """The rewards behind `task.rewards: [default]`. The base one is `is_correct` as 1.0/0.0."""
        return [("correctness", self.correctness_reward)]

    def stop_strings(self) -> list[str]:
        """Strings that end a completion during generation (kept in the text); may be empty."""
        return []

    def correctness_reward(self, prompts: list, completions: list[str], **fields: list) -> list[float]:
        """1.0 where `is_correct` holds. Rebuilds each Example from the batch's fields, so a subclass
        that overrides `is_correct` changes its reward too."""
        examples = examples_from_batch(prompts, fields)
        return [1.0 if self.is_correct(c, ex) else 0.0 for c, ex in zip(completions, examples)]

    def make_example(self, text: str, answer: str, target: str, fields: dict[str, Any]) -> Example:
        """A raw-text example, or a one-turn chat one when `chat` is on."""
        if self.chat:
            return Example(None, [{"role": "user", "content": text}], answer, target, fields)
        return Example(text, None, answer, target, fields)


def examples_from_batch(prompts: list, fields: dict[str, list]) -> list[Example]:
    """Inverse of `rewards.gather_fields`: per-completion Examples from keyword lists.

    The prompt is whatever the caller passed (usually the rendered prompt text); `is_correct`
    implementations should rely on `answer` and `fields`, which round-trip exactly.
    """
    answers = fields.get("answer")
    if answers is None:
        raise ValueError("reward functions are called with an `answer` field; none was given.")
    out = []
    for i, p in enumerate(prompts):
        row = {k: v[i] for k, v in fields.items()}
        if isinstance(p, list):
            out.append(Example(None, p, str(answers[i]), "", row))
        else:
            out.append(Example("" if p is None else str(p), None, str(answers[i]), "", row))
    return out


class EpochShuffle:
    """Stream index i -> row index over `n` rows: each pass over the rows is a fresh permutation seeded
    by (key, epoch), so the order is deterministic in (key, i) and consecutive epochs differ."""

    def __init__(self, n: int, key: str):
        self.n, self.key, self.epoch, self.perm = n, key, -1, []

    def __call__(self, i: int) -> int:
        epoch, pos = divmod(i, self.n)
        if epoch != self.epoch:
            self.perm = list(range(self.n))
            random.Random(f"{self.key}|{epoch}").shuffle(self.perm)
            self.epoch = epoch
        return self.perm[pos]
