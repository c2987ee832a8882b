"""Sizes of the static decode loop's cache (rollout/static_step.py), without torch: the planner
(plan/rollout.py) sizes the captured KV cache with the same rounding the loop uses."""

from __future__ import annotations

# Bucketed caches are sized in steps of this many tokens, so prompts of varying lengths rarely need a
# longer cache (each new length is another graph capture).
STATIC_LENGTH_STEP = 128


def batch_bucket(b: int) -> int:
    """Rows the compiled step runs with for a batch of `b`: the next power of two (8 at least), so a
    few captured graphs serve every batch size."""
    return max(8, 1 << (b - 1).bit_length())
