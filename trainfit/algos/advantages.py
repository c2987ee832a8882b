"""Advantages: how each sample's reward becomes the weight of its policy gradient."""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, group_size: int, scale: bool = True, eps: float = 1e-4,
                     valid: Optional[Tensor] = None) -> Tensor:
    """GRPO advantages: each reward minus its group's mean, over (group std + eps) when `scale`.

    `rewards` is `[N]`, group-major: group i is `rewards[i*G:(i+1)*G]`. The std is the unbiased one
    (`torch.std`, as TRL), so a group whose rewards are all equal gets advantage 0, never NaN.
    `valid` `[N]` (bool) leaves members out (e.g. episodes whose environment failed): mean and std are
    over the valid members only, and invalid members get advantage 0.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size={group_size}: a group needs at least 2 completions to have a baseline")
    n = rewards.numel()
    if n % group_size:
        raise ValueError(f"{n} rewards do not split into groups of {group_size} "
                         f"({n} % {group_size} = {n % group_size})")
    r = rewards if rewards.is_floating_point() else rewards.float()
    groups = r.view(-1, group_size)                                     # [N/G, G]
    if valid is not None:
        v = valid.reshape(-1, group_size).to(r.dtype)                     # [N/G, G]
        count = v.sum(dim=1, keepdim=True)                                # [N/G, 1]
        mean = (groups * v).sum(dim=1, keepdim=True) / count.clamp_min(1)
        adv = (groups - mean) * v
        if scale:
            var = (adv ** 2).sum(dim=1, keepdim=True) / (count - 1).clamp_min(1)
            adv = adv / (var.sqrt() + eps)
        return adv.reshape(n)
    adv = groups - groups.mean(dim=1, keepdim=True)
    if scale:
        adv = adv / (groups.std(dim=1, keepdim=True) + eps)
    return adv.reshape(n)


def _groups(rewards: Tensor, group_size: int, valid: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """Checked `[N/G, G]` views of the rewards (float) and of the valid members (float 0/1)."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size={group_size}: a group needs at least 2 completions to have a baseline")
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size} "
                         f"({rewards.numel()} % {group_size} = {rewards.numel() % group_size})")
    r = rewards if rewards.is_floating_point() else rewards.float()
    v = torch.ones_like(r) if valid is None else valid.to(r.dtype)
    return r.view(-1, group_size), v.view(-1, group_size)


def rloo_advantages(rewards: Tensor, group_size: int, valid: Optional[Tensor] = None) -> Tensor:
    """RLOO (REINFORCE Leave-One-Out; Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE
    Style Optimization for Learning from Human Feedback in LLMs"): each reward minus the mean of the
    OTHER rewards of its group, `r_i - (sum_j r_j - r_i) / (k - 1)` with k valid members. The
    baseline does not depend on the sample itself, so the estimate is unbiased; it equals
    `k / (k - 1)` times the group-centred reward, with no division by the std.

    `rewards` `[N]` group-major; invalid members (`valid` false) get 0 and are left out of the
    baseline; a group with fewer than 2 valid members gets 0 everywhere (no baseline).
    """
    g, v = _groups(rewards, group_size, valid)                           # [N/G, G] each
    k = v.sum(dim=1, keepdim=True)                                        # [N/G, 1]
    total = (g * v).sum(dim=1, keepdim=True)
    others = (total - g * v) / (k - 1).clamp_min(1)                       # mean of the other members
    adv = (g - others) * v * (k >= 2).to(g.dtype)
    return adv.reshape(-1)


def reinforce_pp_advantages(rewards: Tensor, group_size: int, valid: Optional[Tensor] = None,
                            baseline: str = "group", eps: float = 1e-4) -> Tensor:
    """REINFORCE++ (Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large
    Language Models"): advantages normalised over the whole BATCH, not per group, which the paper
    shows is more stable than GRPO's per-prompt std (a group of near-equal rewards is not blown up).

    `baseline="group"` (REINFORCE++-baseline, the paper's variant for several samples per prompt):
    subtract each group's mean, then divide by the std of those centred values over the batch.
    `baseline="batch"` (plain REINFORCE++): subtract the batch mean and divide by the batch std.
    Stds are unbiased, over valid members only; invalid members get 0. Pass the whole optimizer
    step's rewards (all ranks) so the statistics do not depend on how the step is split.
    """
    if baseline not in ("group", "batch"):
        raise ValueError(f"unknown baseline {baseline!r}; valid: 'group', 'batch'")
    g, v = _groups(rewards, group_size, valid)                           # [N/G, G] each
    if baseline == "group":
        mean = (g * v).sum(dim=1, keepdim=True) / v.sum(dim=1, keepdim=True).clamp_min(1)
    else:
        mean = (g * v).sum() / v.sum().clamp_min(1)
    centred = (g - mean) * v
    # Both baselines leave the centred values with mean 0 over the batch: their variance is a plain
    # sum of squares over (valid count - 1).
    var = (centred ** 2).sum() / (v.sum() - 1).clamp_min(1)
    return (centred / (var.sqrt() + eps)).reshape(-1)


# Estimators by name: config's grpo.advantage allows exactly these (tests/test_layers.py checks they agree).
ADVANTAGE_ESTIMATORS: dict[str, Callable[..., Tensor]] = {
    "group_norm": lambda r, g, valid, scale: group_advantages(r, g, scale=scale, valid=valid),
    "rloo": lambda r, g, valid, scale: rloo_advantages(r, g, valid=valid),
    "reinforce_pp": lambda r, g, valid, scale: reinforce_pp_advantages(r, g, valid=valid, baseline="group"),
    "reinforce_pp_batch": lambda r, g, valid, scale: reinforce_pp_advantages(r, g, valid=valid, baseline="batch"),
}
ADVANTAGES = tuple(ADVANTAGE_ESTIMATORS)


def advantages(rewards: Tensor, group_size: int, estimator: str, *, scale: bool = True,
               valid: Optional[Tensor] = None) -> Tensor:
    """The named advantage estimator over a step's group-major rewards `[N]` -> `[N]`:
    `group_norm` (GRPO: centred per group, divided by the group std when `scale`), `rloo`,
    `reinforce_pp` (REINFORCE++-baseline: group mean, batch std) or `reinforce_pp_batch`
    (REINFORCE++: batch mean and std)."""
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; valid: {', '.join(ADVANTAGES)}")
    return ADVANTAGE_ESTIMATORS[estimator](rewards, group_size, valid, scale)
