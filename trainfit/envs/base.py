"""The environment protocol multi-turn GRPO talks to.

    env = make_env()                      # one environment per episode
    messages = env.reset(example)         # the opening chat: [{"role": ..., "content": ...}, ...]
    result = env.step(action_text)        # the policy's reply -> StepResult(observation, reward, done, info)
    ...                                   # until result.done, rollout.max_turns, or the token budget
    env.close()

`observation` holds only the NEW messages (tool results, the user's next message); the episode runner
appends them to the conversation. An environment may set `tools` (JSON schemas, rendered through the
chat template's `tools=` argument) and may implement `finish()`: the reward for an episode the runner
ended (turn or token limit) before the environment said done, e.g. scoring the conversation so far.
Any exception from reset / step marks that one episode failed; `EnvError` is the one to raise on
purpose, with a message that says what to fix.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol, runtime_checkable

from trainfit.core.errors import EnvError

__all__ = ["EnvError", "Environment", "StepResult"]


@dataclass
class StepResult:
    observation: list[dict]               # new messages after the policy's action (may be empty)
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    tools: Optional[list[dict]]

    def reset(self, example) -> list[dict]: ...

    def step(self, action: str) -> StepResult: ...

    def close(self) -> None: ...


class BaseEnv:
    """Defaults for the optional parts of the protocol; subclass and implement reset / step."""

    tools: Optional[list[dict]] = None

    def reset(self, example) -> list[dict]:
        raise NotImplementedError

    def step(self, action: str) -> StepResult:
        raise NotImplementedError

    def finish(self) -> float:
        """Reward for an episode ended by the runner's limits rather than by the environment."""
        return 0.0

    def close(self) -> None:
        pass


def check_messages(messages, where: str) -> list[dict]:
    """`messages` as a list of {"role": str, "content": str} dicts, or EnvError saying what is wrong."""
    if not isinstance(messages, list):
        raise EnvError(f"{where}: messages must be a list of {{'role', 'content'}} objects, got "
                       f"{type(messages).__name__}.")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise EnvError(f"{where}: message {i} must be an object with string `role` and `content`, got {m!r:.200}.")
    return messages
