"""Warnings a GRPO run gives once when it cannot learn, e.g. every group at zero advantage.

    watch = ZeroAdvantageWatch(max_steps=30, num_generations=8, temperature=1.0)
    msg = watch.update(step=12, zero_adv_frac=1.0)   # a message once, after enough steps in a row; else None
"""

from __future__ import annotations

from typing import Optional

import torch

# Consecutive optimizer steps with every group at zero advantage before the warning. Five steps
# rules out a few unlucky batches; a short run warns after a quarter of its steps (at least 2).
ZERO_ADVANTAGE_PATIENCE = 5


def zero_advantage_patience(max_steps: int) -> int:
    return min(ZERO_ADVANTAGE_PATIENCE, max(2, -(-max_steps // 4)))


def zero_signal_frac(rewards: torch.Tensor, valid: torch.Tensor, group_size: int) -> float:
    """The fraction of groups with no learning signal: their valid members' rewards `[N]` are all
    equal (or fewer than two are valid), so every advantage is zero whatever the scaling. Compared
    on rewards, not advantages, since the mean of equal floats need not cancel them exactly."""
    r, v = rewards.float().view(-1, group_size), valid.bool().view(-1, group_size)       # [N/G, G]
    hi = torch.where(v, r, float("-inf")).amax(dim=1)
    lo = torch.where(v, r, float("inf")).amin(dim=1)
    flat = ~(hi > lo)                                                                   # [N/G]
    return int(flat.sum()) / flat.numel()


class ZeroAdvantageWatch:
    """Counts consecutive steps whose groups all had zero advantage (`zero_adv_frac` = 1: within each
    group every completion got the same reward); returns the warning once, the step the run reaches
    `patience` such steps in a row. A step with any learning signal resets the count."""

    def __init__(self, max_steps: int, num_generations: int, temperature: float, patience: Optional[int] = None):
        self.patience = patience or zero_advantage_patience(max_steps)
        self.G, self.temperature = num_generations, temperature
        self.run, self.warned = 0, False

    def update(self, step: int, zero_adv_frac: float) -> Optional[str]:
        self.run = self.run + 1 if zero_adv_frac >= 1.0 else 0
        if self.warned or self.run < self.patience:
            return None
        self.warned = True
        return (f"GRPO has had no learning signal for {self.run} steps in a row (steps {step - self.run + 1}-{step}): "
                f"in every group all {self.G} completions of a prompt got the same reward, so every advantage is "
                "zero and the policy cannot improve (metric zero_adv_frac = 1). Usual fixes: add a partial-credit "
                "or format reward the model already earns sometimes (task.rewards, task.reward_weights); warm the "
                "model up with SFT first (stages: [{stage: sft}, {stage: grpo}]); sample more completions per "
                f"prompt (grpo.num_generations, now {self.G}); raise rollout.temperature (now {self.temperature:g}) "
                "for more varied completions.")
