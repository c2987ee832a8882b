"""The rollout-engine interface every generation backend implements (hf, vllm, openai).

The trainer only talks to an engine through this surface:
- `generate(prompts, seeds=..., greedy=..., max_new_tokens=..., logprobs=...)` completes token-id
  prompts (chat states are rendered to ids by the caller with the tokenizer's chat template, so the
  tokens the engine saw are exactly the tokens the trainer scores);
- `sync(model)` pushes the trainer's current weights (a LoRA adapter or the full state) to the engine;
- `sleep()` / `wake()` release and restore the engine's GPU memory between phases when it shares the card;
- `close()` frees what it holds (threads, HTTP clients, the vLLM instance).

An engine that samples from the very module the trainer updates (`hf`) has `shares_weights = True`:
its `sync` is a no-op and there is nothing to verify. Every other engine must prove after each sync that
it samples from the trained weights (see `trainfit.rollout.sync_check`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence, runtime_checkable


@dataclass
class Completion:
    token_ids: list[int]                     # generated ids, through the eos when one was produced
    text: str                                # decoded without special tokens
    finished: bool                           # ended by eos or a stop string (False = hit the token limit)
    logprobs: Optional[list[float]] = None   # the engine's log-prob of each token (at temperature 1 / T, see below)


@runtime_checkable
class RolloutEngine(Protocol):
    """What GRPO (and later PPO) needs from a generation backend.

    Log-probs, when asked for, are log softmax(logits / T)[token] with T the sampling temperature
    (T = 1 for greedy), i.e. the distribution the trainer's loss uses; top-k / top-p are not applied.
    """

    name: str
    shares_weights: bool
    processor: Optional[object]   # a VisionProcessor for a vision-language policy (set by the stage), else None

    def generate(self, prompts: list[list[int]], *, greedy: bool = False, seeds: Optional[Sequence[int]] = None,
                 max_new_tokens: Optional[int] = None, batch_size: Optional[int] = None,
                 logprobs: bool = False, temperature: Optional[float] = None) -> list[Completion]: ...

    def sync(self, model) -> None: ...

    def sleep(self) -> None: ...

    def wake(self) -> None: ...

    def close(self) -> None: ...


class EngineError(RuntimeError):
    """The engine cannot serve the trainer (unreachable server, failed weight load, stale weights)."""


class StaleEngineError(EngineError):
    """The engine's log-probs do not match the trainer's after a sync: it samples from other weights."""
