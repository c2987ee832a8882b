"""Offline preference losses (stage dpo): DPO and its variants on sequence log-probs, registered by name.

Inputs are per-sequence SUMS of token log-probs over the answer tokens (`[P]`, one per pair) and the
answer token counts (`[P]`); references the same sums under the frozen reference. With
  rc = logp_chosen - ref_chosen, rr = logp_rejected - ref_rejected   (log-ratios to the reference)
  h  = rc - rr                                                        (the DPO "logit")
the per-pair losses are:
  sigmoid  -(1-eps) logsig(beta h) - eps logsig(-beta h)      DPO (Rafailov et al. 2023); eps>0: cDPO
  robust   (-(1-eps) logsig(beta h) + eps logsig(-beta h)) / (1 - 2 eps)   robust DPO (Chowdhury et al. 2024)
  ipo      (h - 1/(2 beta))^2                                  IPO (Azar et al. 2023), sequence sums;
           ipo_normalize: every log-prob divided by its answer's length first (TRL's IPO); the logged
           rewards stay beta x the summed log-ratios, as TRL logs them
  hinge    max(0, 1 - beta h)                                  SLiC-style hinge
  simpo    -(1-eps) logsig(s) - eps logsig(-s), s = beta (lc/|yc| - lr/|yr|) - gamma   (Meng et al. 2024)
  orpo     nll_c - beta logsig(log odds(pc) - log odds(pr)), log p = l/|y| (Hong et al. 2024)
plus `sft_weight * nll_c` (RPO, Pang et al. 2024), nll_c = -logp_chosen / |yc| (the chosen answer's
token-mean NLL, `sft_mean="pair"`), or with `sft_mean="token"` sft_weight x the NLL summed over all the
step's chosen tokens / their count (TRL's token mean: longer answers weigh more). simpo and orpo are
reference-free. kto (Ethayarajh et al. 2024) is unpaired:
`kto_loss`. Each loss is summed over the micro-batch's pairs and divided by the step's pair count,
so micro-batch shares add up to the step loss. Metrics are detached sums over pairs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from trainfit.algos.core import Number


@dataclass(frozen=True)
class PairLogps:
    """One micro-batch's pairs: sums of answer-token log-probs `[P]` and answer lengths `[P]`."""

    chosen: Tensor
    rejected: Tensor
    chosen_tokens: Tensor
    rejected_tokens: Tensor
    ref_chosen: Optional[Tensor] = None     # None for the reference-free losses
    ref_rejected: Optional[Tensor] = None

    def log_ratios(self) -> tuple[Tensor, Tensor]:
        """(rc, rr) `[P]`: policy minus reference log-prob of each side."""
        return self.chosen - self.ref_chosen, self.rejected - self.ref_rejected

    def length_normalised(self) -> "PairLogps":
        """Every log-prob (policy and reference) divided by its answer's token count (TRL's IPO)."""
        nc, nr = (t.clamp_min(1).to(self.chosen.dtype) for t in (self.chosen_tokens, self.rejected_tokens))
        ref = (self.ref_chosen / nc, self.ref_rejected / nr) if self.ref_chosen is not None else (None, None)
        return PairLogps(*self.mean_logps(), self.chosen_tokens, self.rejected_tokens, *ref)

    def mean_logps(self) -> tuple[Tensor, Tensor]:
        """Length-normalised log-probs `[P]` (SimPO's and ORPO's average per token)."""
        return (self.chosen / self.chosen_tokens.clamp_min(1).to(self.chosen.dtype),
                self.rejected / self.rejected_tokens.clamp_min(1).to(self.rejected.dtype))


@dataclass(frozen=True)
class LossSpec:
    fn: Optional[Callable[..., Tensor]]   # (PairLogps, beta, label_smoothing, gamma) -> loss [P]; None: kto
    reference: bool             # needs reference log-probs
    paired: bool = True         # rows are (prompt, chosen, rejected); False: (prompt, completion, label)


PREFERENCE_LOSSES: dict[str, LossSpec] = {}


def register_preference_loss(name: str, *, reference: bool, paired: bool = True):
    def deco(fn):
        PREFERENCE_LOSSES[name] = LossSpec(fn, reference, paired)
        return fn
    return deco


def _smoothed_logsigmoid(x: Tensor, eps: float) -> Tensor:
    # cDPO: the expected loss when the label is flipped with probability eps.
    return -(1.0 - eps) * F.logsigmoid(x) - eps * F.logsigmoid(-x)


@register_preference_loss("sigmoid", reference=True)
def dpo_sigmoid(p: PairLogps, beta: float, eps: float = 0.0, gamma: float = 0.0) -> Tensor:
    rc, rr = p.log_ratios()
    return _smoothed_logsigmoid(beta * (rc - rr), eps)


@register_preference_loss("robust", reference=True)
def dpo_robust(p: PairLogps, beta: float, eps: float = 0.0, gamma: float = 0.0) -> Tensor:
    # Robust DPO: an unbiased estimate of the clean-label loss under labels flipped with probability eps
    # (Chowdhury et al. 2024, eq. 8); eps = 0 is DPO.
    rc, rr = p.log_ratios()
    x = beta * (rc - rr)
    return (-(1.0 - eps) * F.logsigmoid(x) + eps * F.logsigmoid(-x)) / (1.0 - 2.0 * eps)


@register_preference_loss("ipo", reference=True)
def dpo_ipo(p: PairLogps, beta: float, eps: float = 0.0, gamma: float = 0.0) -> Tensor:
    rc, rr = p.log_ratios()
    return (rc - rr - 1.0 / (2.0 * beta)) ** 2


@register_preference_loss("hinge", reference=True)
def dpo_hinge(p: PairLogps, beta: float, eps: float = 0.0, gamma: float = 0.0) -> Tensor:
    rc, rr = p.log_ratios()
    return torch.relu(1.0 - beta * (rc - rr))


@register_preference_loss("simpo", reference=False)
def simpo(p: PairLogps, beta: float, eps: float = 0.0, gamma: float = 0.0) -> Tensor:
    mc, mr = p.mean_logps()
    return _smoothed_logsigmoid(beta * (mc - mr) - gamma, eps)


def log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x < 0, accurate everywhere (Maechler 2012): log(-expm1(x)) near 0, where
    1 - exp(x) cancels (in fp32 at x = -1e-6 it loses ~6% of its value), log1p(-exp(x)) below -ln 2."""
    near = x > -math.log(2.0)
    return torch.where(near, torch.log(-torch.expm1(torch.where(near, x, -1.0))),
                       torch.log1p(-torch.exp(torch.where(near, -1.0, x))))


def _log_odds(mean_logp: Tensor) -> Tensor:
    # log(p / (1 - p)) with log p = mean_logp < 0. The clamp keeps p = 1 (mean_logp 0) finite.
    return mean_logp - log1mexp(mean_logp.clamp_max(-1e-7))


@register_preference_loss("orpo", reference=False)
def orpo(p: PairLogps, beta: float, eps: float = 0.0, gamma: float = 0.0) -> Tensor:
    mc, mr = p.mean_logps()
    return -mc - beta * F.logsigmoid(_log_odds(mc) - _log_odds(mr))


# KTO's rows are unpaired: its math is `kto_loss`, the entry says what the stage must feed it.
PREFERENCE_LOSSES["kto"] = LossSpec(fn=None, reference=True, paired=False)


def implicit_rewards(loss_type: str, p: PairLogps, beta: float) -> tuple[Tensor, Tensor]:
    """(chosen, rejected) implicit rewards `[P]`, detached: beta x log-ratio to the reference, or
    beta x mean log-prob for the reference-free losses (as SimPO and ORPO report them)."""
    with torch.no_grad():
        if PREFERENCE_LOSSES[loss_type].reference:
            rc, rr = p.log_ratios()
        else:
            rc, rr = p.mean_logps()
        return beta * rc, beta * rr


def preference_loss(loss_type: str, p: PairLogps, *, beta: float, label_smoothing: float = 0.0,
                    simpo_gamma: float = 0.0, sft_weight: float = 0.0, sft_mean: str = "pair",
                    ipo_normalize: bool = False, total_pairs: Optional[Number] = None,
                    total_chosen_tokens: Optional[Number] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """The micro-batch's share of the step loss: sum over pairs of (loss + sft_weight x nll_c) divided
    by `total_pairs` (None = this batch's P); with sft_mean="token" the SFT term is instead
    sft_weight x (-sum of the chosen log-probs) / `total_chosen_tokens` (the step's; None = this
    batch's). `ipo_normalize`: ipo on length-normalised log-probs; the rewards stay beta x the summed
    log-ratios (what every reference loss logs, and TRL's `rewards/*` for its length-normalised IPO).
    Metrics (detached sums over the P pairs): "pairs", "correct" (chosen reward strictly higher),
    "margin", "chosen_reward", "rejected_reward", "nll"."""
    spec = PREFERENCE_LOSSES.get(loss_type)
    if spec is None or not spec.paired:
        raise ValueError(f"unknown paired loss_type {loss_type!r}; valid: "
                         f"{', '.join(k for k, s in PREFERENCE_LOSSES.items() if s.paired)}")
    if spec.reference and (p.ref_chosen is None or p.ref_rejected is None):
        raise ValueError(f"loss_type {loss_type!r} needs reference log-probs")
    if sft_mean not in ("pair", "token"):
        raise ValueError(f"unknown sft_mean {sft_mean!r}; valid: pair, token")
    nll = -p.mean_logps()[0]                                                        # [P]
    scored = p.length_normalised() if ipo_normalize and loss_type == "ipo" else p
    per_pair = spec.fn(scored, beta, label_smoothing, simpo_gamma)                 # [P]
    if sft_weight and sft_mean == "pair":
        per_pair = per_pair + sft_weight * nll
    n = per_pair.numel() if total_pairs is None else total_pairs
    loss = per_pair.sum() / max(n, 1)
    if sft_weight and sft_mean == "token":
        tokens = p.chosen_tokens.sum() if total_chosen_tokens is None else total_chosen_tokens
        loss = loss + sft_weight * -p.chosen.sum() / max(float(tokens), 1.0)
    cr, rr = implicit_rewards(loss_type, p, beta)
    with torch.no_grad():
        metrics = {"pairs": torch.tensor(float(per_pair.numel())), "correct": (cr > rr).sum().float(),
                   "margin": (cr - rr).sum(), "chosen_reward": cr.sum(), "rejected_reward": rr.sum(),
                   "nll": nll.detach().sum()}
    return loss, metrics


def kto_reference_point(kl_logps: Tensor, kl_ref_logps: Tensor) -> Tensor:
    """KTO's z0: the mean log-ratio of mismatched (prompt, completion) rows (a batch estimate of
    KL(pi || ref)), clamped at 0 and detached, as in the paper and TRL. `[M]`, `[M]` -> scalar."""
    with torch.no_grad():
        return (kl_logps - kl_ref_logps).mean().clamp_min(0)


def kto_loss(logps: Tensor, ref_logps: Tensor, desirable: Tensor, z0: Number, *, beta: float,
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0,
             total_rows: Optional[Number] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """KTO on unpaired rows `[N]`: r = logps - ref_logps; desirable rows lose
    w_d (1 - sig(beta (r - z0))), undesirable rows w_u (1 - sig(beta (z0 - r))); summed and divided by
    `total_rows`. Metrics: detached sums "rows", "desirable", "reward_desirable", "reward_undesirable"."""
    r = logps - ref_logps                                                           # [N]
    d = desirable.bool()
    z0 = torch.as_tensor(z0, dtype=r.dtype, device=r.device)
    per_row = torch.where(d, desirable_weight * (1 - torch.sigmoid(beta * (r - z0))),
                          undesirable_weight * (1 - torch.sigmoid(beta * (z0 - r))))
    n = per_row.numel() if total_rows is None else total_rows
    loss = per_row.sum() / max(n, 1)
    with torch.no_grad():
        reward = beta * r
        metrics = {"rows": torch.tensor(float(r.numel())), "desirable": d.sum().float(),
                   "reward_desirable": reward[d].sum(), "reward_undesirable": reward[~d].sum()}
    return loss, metrics
