"""Off-policy correction of stale samples: the behaviour importance weight per policy token.

Asynchronous RL trains on samples drawn by an older policy version (the behaviour policy, pi_behav)
than the one being updated. With pi_prox the trainer's policy at the start of the optimizer step (the
proximal policy of AReaL's decoupled PPO; with one optimizer step per rollout it is `logp.detach()`),
the policy loss per token becomes

    w_t * -min(r_t * A, clip(r_t, 1 - eps_low, 1 + eps_high) * A),   r_t = pi / pi_prox,
    w_t = pi_prox(y_t) / pi_behav(y_t) = exp(prox_logp - behav_logp)

and the corrections differ in what they do with a large w (registered by name in OFF_POLICY):
- `tis`: truncated importance sampling, w = min(w, C) (Ionides 2008; verl's rollout correction and
  the "truncated importance sampling" of Yao et al. 2025);
- `decoupled`: AReaL's decoupled PPO objective (Fu et al. 2025): w kept as is, and tokens with
  w > C left out (weight 0, its behav_imp_weight_cap);
- `none`: w = 1, stale samples trained as if the proximal policy had drawn them.

Where the two policies are the same, prox_logp == behav_logp, so w = exp(0) = 1 exactly and the
loss is bit for bit the on-policy one (C >= 1 for every correction). Pure tensor math: no trainer or
config import.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from trainfit.algos.core import masked_sum


def truncated_importance(prox_logp: Tensor, behav_logp: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    """`tis`: (w = min(exp(prox - behav), cap), cut = w was above cap), both `[B, T]`."""
    raw = torch.exp(prox_logp - behav_logp)
    cut = raw > cap
    return torch.clamp(raw, max=cap), cut


def decoupled_importance(prox_logp: Tensor, behav_logp: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    """`decoupled` (AReaL): (w = exp(prox - behav), 0 where it is above cap; cut = left out), `[B, T]`."""
    raw = torch.exp(prox_logp - behav_logp)
    cut = raw > cap
    return torch.where(cut, torch.zeros_like(raw), raw), cut


def no_importance(prox_logp: Tensor, behav_logp: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    """`none`: w = 1 everywhere, nothing cut."""
    return torch.ones_like(prox_logp), torch.zeros_like(prox_logp, dtype=torch.bool)


OFF_POLICY: dict[str, Callable[[Tensor, Tensor, float], tuple[Tensor, Tensor]]] = {
    "tis": truncated_importance,
    "decoupled": decoupled_importance,
    "none": no_importance,
}


def behaviour_weights(name: str, prox_logp: Tensor, behav_logp: Tensor, cap: float) -> tuple[Tensor, Tensor]:
    """The correction `name` of OFF_POLICY: (weight [B, T], cut [B, T] bool), no gradient through either
    (the weight is a constant of the step: both log-probs were computed before it)."""
    if name not in OFF_POLICY:
        raise ValueError(f"unknown off-policy correction {name!r}; valid: {', '.join(OFF_POLICY)}")
    if cap < 1.0:
        raise ValueError(f"importance cap {cap} is below 1: an on-policy token (w = 1) would be corrected")
    with torch.no_grad():
        return OFF_POLICY[name](prox_logp.detach(), behav_logp.detach(), cap)


def importance_stats(prox_logp: Tensor, behav_logp: Tensor, cut: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Spread of the raw weights exp(prox - behav) over the mask tokens, as exact partial results a
    trainer combines over micro-batches: "iw_sum" and "iw_cut_sum" (sums; divide by the token count),
    "iw_max" and "iw_min" (take the max / min of the parts; +-inf when no token is masked in)."""
    m = mask.bool()
    with torch.no_grad():
        raw = torch.exp(prox_logp.detach() - behav_logp.detach())[m]
        return {"iw_sum": raw.sum(), "iw_cut_sum": masked_sum(cut.to(raw.dtype), m),
                "iw_max": raw.max() if raw.numel() else torch.tensor(float("-inf")),
                "iw_min": raw.min() if raw.numel() else torch.tensor(float("inf"))}


def staleness_stats(versions: list[int], trainer_version: int) -> dict[str, float]:
    """Staleness of a step's samples: the trainer's version minus the version each was sampled with."""
    lag = [trainer_version - v for v in versions] or [0]
    return {"staleness_mean": sum(lag) / len(lag), "staleness_max": float(max(lag))}
