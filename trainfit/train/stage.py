"""The stage interface the optimizer loop (loop.py) drives: a stage prepares each step's batch, computes
the loss of a micro-batch, summarizes, evaluates and saves its own state; and the batch it hands over."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch


@dataclass
class StepBatch:
    samples: list                           # one optimizer step's samples, in order
    totals: dict[str, float]                # whole-step normalisers (tokens, sequences) for the loss
    metrics: dict[str, float] = field(default_factory=dict)   # e.g. rollout rewards, lengths


class Stage(Protocol):
    def prepare(self, step: int) -> StepBatch: ...
    def loss(self, model, micro: list, totals: dict) -> tuple[torch.Tensor, dict[str, float]]: ...
    def summarize(self, batch: StepBatch, sums: dict[str, float]) -> dict[str, float]: ...
    def evaluate(self, model) -> dict[str, float]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class StageResult:
    stage_dir: Path
    final_dir: Path
    first_eval: dict[str, float]
    last_eval: dict[str, float]
    steps: int
    seconds: float


def step_seed(seed: int, step) -> int:
    """Every step reseeds from (seed, step), so a resumed run samples exactly what it would have."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{step}".encode()).digest()[:4], "little")
