"""PPO's pieces beyond the clipped surrogate: per-token rewards with a KL penalty, GAE, whitening,
the clipped value loss and the adaptive KL controller.

Shapes: `[B, T]` per-token frames with a `mask` of the policy's tokens (bool or 0/1). Positions
outside the mask (padding, or environment tokens between a multi-turn episode's policy turns) are
skipped by the recursions: the next policy token is the "next step", as if the others were not there.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from trainfit.algos.core import masked_mean, masked_sum


def last_positions(mask: Tensor) -> Tensor:
    """Index of each row's last mask position `[B, T]` -> `[B]` (-1 for an empty row)."""
    m = mask.bool()
    idx = torch.arange(m.shape[1], device=m.device).expand_as(m)
    return torch.where(m, idx, torch.full_like(idx, -1)).max(dim=1).values


def token_rewards(scores: Tensor, kl: Optional[Tensor], mask: Tensor, kl_coef: float) -> Tensor:
    """Per-token rewards `[B, T]`: `-kl_coef * kl` at every policy token, plus the sequence's score
    `[B]` at its last policy token (the RLHF convention of Ziegler et al. 2019 / InstructGPT).
    `kl` `[B, T]` is a per-token KL estimate to the reference (None: no penalty)."""
    m = mask.bool()
    out = torch.zeros(m.shape, dtype=scores.dtype if scores.is_floating_point() else torch.float32,
                      device=m.device)
    if kl is not None and kl_coef:
        out = torch.where(m, -kl_coef * kl.to(out.dtype), out)
    last = last_positions(m)                                              # [B]
    rows = torch.nonzero(last >= 0).squeeze(-1)
    out[rows, last[rows]] += scores[rows].to(out.dtype)
    return out


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) over each row's policy tokens.

    delta_t = r_t + gamma * V_next - V_t and A_t = delta_t + gamma * lam * A_next, where "next" is
    the next mask position of the row (V_next = 0 and A_next = 0 after the last: the episode ends).
    Returns (advantages, returns = advantages + values), both `[B, T]`, 0 outside the mask.
    `values` are the critic's (detached) estimates at the same positions.
    """
    m = mask.bool()
    r, v = rewards.to(values.dtype), values.detach()
    adv = torch.zeros_like(v)
    next_v = torch.zeros_like(v[:, 0])                                     # [B]
    next_a = torch.zeros_like(v[:, 0])
    for t in range(v.shape[1] - 1, -1, -1):
        delta = r[:, t] + gamma * next_v - v[:, t]
        a = delta + gamma * lam * next_a
        keep = m[:, t]
        adv[:, t] = torch.where(keep, a, torch.zeros_like(a))
        # Off-mask positions pass the next policy token's value and advantage through unchanged.
        next_v = torch.where(keep, v[:, t], next_v)
        next_a = torch.where(keep, a, next_a)
    return adv, torch.where(m, adv + v, torch.zeros_like(v))


def whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x - mean) / std over the mask positions (unbiased std); with `shift_mean=False` the mean is
    added back (only the scale changes, as TRL/OpenRLHF do for advantages). 0 outside the mask."""
    m = mask.bool()
    mean = masked_mean(x, m)
    n = m.sum()
    var = masked_sum((x - mean) ** 2, m) / (n - 1).clamp_min(1).to(x.dtype)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(m, out, torch.zeros_like(out))


def clipped_value_loss(values: Tensor, old_values: Tensor, returns: Tensor, clip: Optional[float]) -> tuple[Tensor, Tensor]:
    """PPO's value loss per token `[B, T]`: 0.5 * max((V - R)^2, (V_clip - R)^2) with
    V_clip = V_old + clamp(V - V_old, -clip, clip); no clipping when `clip` is None or <= 0. Returns
    (loss, clipped), `clipped` where the clipped term is strictly the larger (no gradient there)."""
    unclipped = (values - returns) ** 2
    if clip is None or clip <= 0:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    v_clip = old_values + torch.clamp(values - old_values, -clip, clip)
    clipped = (v_clip - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped


class AdaptiveKL:
    """The adaptive KL coefficient of Ziegler et al. 2019: after each step with observed KL `kl`,
    coef *= 1 + clip(kl / target - 1, -0.2, 0.2) * samples / horizon. Plain numbers, so it is saved
    and restored with the stage state."""

    def __init__(self, coef: float, target: float, horizon: int):
        if target <= 0 or horizon <= 0:
            raise ValueError(f"target ({target}) and horizon ({horizon}) must be positive")
        self.coef, self.target, self.horizon = float(coef), float(target), int(horizon)

    def update(self, kl: float, samples: int) -> float:
        if math.isfinite(kl):
            error = min(max(kl / self.target - 1.0, -0.2), 0.2)
            self.coef *= 1.0 + error * samples / self.horizon
        return self.coef
