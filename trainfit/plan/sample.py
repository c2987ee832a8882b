"""Which rows the planner measures: every row of a set, or a seeded sample of SAMPLE rows of larger sets,
and how many examples a generated task hands the run."""

from __future__ import annotations

import random

from trainfit.config.stages import stage_spec

SAMPLE = 2048  # rows measured at most; larger sets are sampled with a fixed seed


def population_size(cfg) -> int:
    """Examples a generated task hands the run: prompts of every rollout (RL), items of every step (SFT)."""
    bp = cfg.batch_plan()
    steps = max(1, cfg.train.max_steps)
    spec = stage_spec(cfg.stage)
    if spec.rollout:
        rounds = -(-steps // spec.iterations(cfg))
        return rounds * bp.prompts_per_step
    return steps * bp.global_batch


def sample_indices(n: int) -> tuple[list[int], bool]:
    if n <= SAMPLE:
        return list(range(n)), False
    return sorted(random.Random(f"trainfit-lengths|{n}").sample(range(n), SAMPLE)), True
