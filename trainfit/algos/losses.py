"""Losses: KL estimators, the clipped surrogate, loss aggregation, the GRPO and SFT losses."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from trainfit.algos.core import IGNORE_INDEX, Number, masked_mean, masked_sum
from trainfit.algos.logprobs import token_logprobs
from trainfit.algos.offpolicy import behaviour_weights, importance_stats


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(pi || ref) from tokens sampled from pi (Schulman's k1, k2, k3).

    With d = ref_logp - logp: k1 = -d, k2 = d^2 / 2, k3 = exp(d) - d - 1 (>= 0, unbiased, low variance).
    k3 is computed as expm1(d) - d, the same value with less cancellation near d = 0.
    """
    d = ref_logp - logp
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.expm1(d) - d
    raise ValueError(f"unknown kl_estimator {estimator!r}; valid: 'k1', 'k2', 'k3'")


def clipped_policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor,
                        eps_low: float, eps_high: float) -> tuple[Tensor, Tensor]:
    """PPO clipped surrogate per token: `-min(r*A, clamp(r, 1-eps_low, 1+eps_high)*A)`.

    `logp`, `old_logp` are `[B, T]`, `advantages` `[B]` (one per sequence, broadcast over T) or
    `[B, T]` (one per token, PPO with GAE), and r = exp(logp - old_logp). Returns the loss `[B, T]` and `clipped [B, T]` (bool): tokens where the
    clipped term is strictly the smaller, i.e. the ones that give no gradient.
    """
    ratio = torch.exp(logp - old_logp)                                  # [B, T]
    a = advantages.unsqueeze(-1) if advantages.dim() == 1 else advantages   # [B, 1] or [B, T]
    unclipped = ratio * a
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * a
    return -torch.minimum(unclipped, clipped), clipped < unclipped


def sequence_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """GSPO's length-normalised sequence log-ratio (Zheng et al. 2025, "Group Sequence Policy
    Optimization"): log s_i = mean over sequence i's mask tokens of (logp - old_logp), `[B, T]` -> `[B]`
    (0 for a sequence with no mask token). s_i is the geometric mean of its token ratios."""
    return masked_mean(logp - old_logp, mask, dim=-1)


LOSS_AGG: dict[str, str] = {
    "grpo": "seq-mean-token-mean",        # each sequence weighs the same, whatever its length
    "dapo": "token-mean",                 # each token weighs the same
    "dr_grpo": "seq-mean-token-sum-norm",  # token sum over a constant (sequences x max length)
}
AGG_MODES = tuple(LOSS_AGG.values())


def agg_loss(loss_mat: Tensor, mask: Tensor, mode: str, *, total_seqs: Optional[int] = None,
             total_tokens: Optional[Number] = None, max_len: Optional[int] = None,
             seq_tokens: Optional[Tensor] = None) -> Tensor:
    """Reduce a per-token loss `[B, T]` to a scalar; `mode` names the normalisation.

    - "token-mean":              sum(loss * mask) / total_tokens
    - "seq-mean-token-mean":     sum_i mean_t(loss_i over its mask) / total_seqs
    - "seq-mean-token-sum-norm": sum(loss * mask) / (total_seqs * max_len)     (Dr. GRPO)

    Every mode is a sum over sequences divided by a constant, so when a step's batch is split into
    micro-batches and each gets the WHOLE step's `total_seqs` / `total_tokens`, the micro-batch values
    add up to the whole-batch value (and so do the gradients). None means this batch: B and
    mask.sum(). (Under DDP the gradient all-reduce averages over ranks: pass per-device totals.)
    A sequence with no mask token contributes 0; it still counts in total_seqs.
    `seq_tokens` `[B]` (seq-mean-token-mean only): each row's divisor when a sequence's tokens span
    several rows (a multi-turn episode trained as one row per context): row i adds
    sum_t(loss_i over its mask) / seq_tokens_i, so the rows of one sequence add up to its token mean.
    """
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation {mode!r}; valid: {', '.join(AGG_MODES)}")
    if total_seqs is None:
        total_seqs = loss_mat.shape[0]
    if mode == "token-mean":
        if total_tokens is None:
            total_tokens = mask.bool().sum()
        if isinstance(total_tokens, Tensor):
            total_tokens = total_tokens.clamp_min(1).to(loss_mat.dtype)
        else:
            total_tokens = max(total_tokens, 1)
        return masked_sum(loss_mat, mask) / total_tokens
    if mode == "seq-mean-token-mean":
        if seq_tokens is not None:
            return (masked_sum(loss_mat, mask, dim=-1) / seq_tokens.clamp_min(1).to(loss_mat.dtype)).sum() / total_seqs
        return masked_mean(loss_mat, mask, dim=-1).sum() / total_seqs
    if max_len is None or max_len < 1:
        raise ValueError(f"mode {mode!r} divides by total_seqs x max_len: pass max_len "
                         f"(the generation length limit, e.g. rollout.max_new_tokens), got {max_len}")
    return masked_sum(loss_mat, mask) / (total_seqs * max_len)


def grpo_loss(logp: Tensor, old_logp: Tensor, ref_logp: Optional[Tensor], advantages: Tensor,
              mask: Tensor, *, loss_type: str, eps_low: float, eps_high: float, beta: float,
              kl_estimator: str, total_seqs: Optional[int] = None, total_tokens: Optional[Number] = None,
              max_len: Optional[int] = None, importance: str = "token",
              seq_tokens: Optional[Tensor] = None, behav_logp: Optional[Tensor] = None,
              off_policy: str = "tis", importance_cap: float = 2.0) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO / DAPO / Dr. GRPO / GSPO loss of one micro-batch: clipped surrogate + beta * KL, aggregated.

    `logp`, `old_logp`, `ref_logp`, `mask` are `[B, T]`, `advantages` `[B]`. With one optimizer step
    per rollout (num_iterations = 1) pass `old_logp = logp.detach()`: the ratio is 1 and the gradient is
    the plain policy gradient. The KL term is added only when beta > 0 and `ref_logp` is given.
    Aggregation is `LOSS_AGG[loss_type]`; totals and `seq_tokens` as in `agg_loss`. `importance` is the ratio's level:
    "token" (PPO/GRPO: one ratio per token) or "sequence" (GSPO: one length-normalised ratio per
    sequence, see `sequence_log_ratio`; the logged ratio is then the sequence's).

    Metrics are detached SUMS over this micro-batch's mask tokens, not means, so the trainer adds
    them over micro-batches (and ranks) and divides once, exactly:
    "clip_frac_sum" (clipped tokens), "kl_sum" (per-token KL, 0 without ref_logp), "ratio_sum"
    (importance ratios), and "tokens" (mask tokens, the divisor of the three others).

    `behav_logp` `[B, T]`: the log-probs of the policy version that sampled stale samples (asynchronous
    rollouts); `old_logp` is then the proximal policy, and each token's policy term is multiplied by the
    behaviour weight of `off_policy` with cap `importance_cap` (algos/offpolicy.py; the KL term is not).
    The metrics then add `importance_stats` ("iw_sum", "iw_cut_sum", "iw_max", "iw_min").
    """
    if loss_type not in LOSS_AGG:
        raise ValueError(f"unknown loss_type {loss_type!r}; valid: {', '.join(LOSS_AGG)}")
    prox_logp = old_logp
    if importance == "sequence":
        # GSPO-token: ratio_t = sg(s_i) * pi(y_t) / sg(pi(y_t)), so every token of sequence i has the
        # value s_i (clipped together) and the gradient of log pi(y_t); with per-sequence token means
        # (loss_type grpo) this is GSPO's sequence objective exactly.
        old_logp = logp.detach() - sequence_log_ratio(logp.detach(), old_logp, mask)[:, None]  # [B, T]
    elif importance != "token":
        raise ValueError(f"unknown importance level {importance!r}; valid: 'token', 'sequence'")
    per_token, clipped = clipped_policy_loss(logp, old_logp, advantages, eps_low, eps_high)
    cut = None
    if behav_logp is not None:   # decoupled objective: the surrogate against the proximal policy, reweighted
        weight, cut = behaviour_weights(off_policy, prox_logp, behav_logp, importance_cap)
        per_token = per_token * weight
    kl = None
    if ref_logp is not None:
        kl = kl_penalty(logp, ref_logp, kl_estimator)
        if beta > 0:
            per_token = per_token + beta * kl
    loss = agg_loss(per_token, mask, LOSS_AGG[loss_type], total_seqs=total_seqs,
                    total_tokens=total_tokens, max_len=max_len, seq_tokens=seq_tokens)
    with torch.no_grad():
        m = mask.bool()
        zero = torch.zeros((), dtype=per_token.dtype, device=per_token.device)
        metrics = {
            "clip_frac_sum": masked_sum(clipped.to(per_token.dtype), m),
            "kl_sum": masked_sum(kl.detach(), m) if kl is not None else zero,
            "ratio_sum": masked_sum(torch.exp(logp - old_logp), m),
            "tokens": m.sum().to(per_token.dtype),
        }
        if cut is not None:
            metrics.update(importance_stats(prox_logp, behav_logp, cut, m))
    return loss, metrics


def sft_loss(logits: Tensor, labels: Tensor, *, total_tokens: Optional[Number] = None,
             chunk_size: int = 0) -> tuple[Tensor, Tensor]:
    """Next-token cross-entropy: `logits[:, t]` predicts `labels[:, t+1]`; labels == -100 are skipped.

    `logits [B, T, V]`, `labels [B, T]`. Returns (sum of token NLL / total_tokens, this batch's label
    count). Pass the step's total label count as `total_tokens` for accumulation-invariant gradients.
    The labels are shifted left (and padded with -100) instead of slicing the logits, so the logits
    are not copied; the log-probs go through `token_logprobs`, so `chunk_size` applies.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree")
    pad = torch.full_like(labels[:, :1], IGNORE_INDEX)
    shifted = torch.cat([labels[:, 1:], pad], dim=1)                   # [B, T]; last position predicts nothing
    mask = shifted != IGNORE_INDEX
    logp = token_logprobs(logits, shifted.masked_fill(~mask, 0), chunk_size=chunk_size)  # [B, T]
    n_tokens = mask.sum()
    return nll_mean(masked_sum(logp, mask), n_tokens if total_tokens is None else total_tokens), n_tokens


def nll_mean(logp_sum: Tensor, total_tokens: Number) -> Tensor:
    """-sum(log p) / total_tokens, the token-mean NLL (a count of 0 divides by 1: the loss is 0)."""
    if isinstance(total_tokens, Tensor):
        return -logp_sum / total_tokens.clamp_min(1).to(logp_sum.dtype)
    return -logp_sum / max(total_tokens, 1)


def bradley_terry_loss(chosen: Tensor, rejected: Tensor, *, total_pairs: Optional[Number] = None
                       ) -> tuple[Tensor, dict[str, Tensor]]:
    """Reward-model loss on preference pairs (Bradley & Terry 1952; as in InstructGPT):
    -log sigmoid(r_chosen - r_rejected), summed over this micro-batch's pairs and divided by
    `total_pairs` (the whole step's count, so micro-batch shares add up; None = this batch).
    `chosen`, `rejected` are `[P]` scalar rewards. Metrics are detached sums over the pairs:
    "correct" (chosen scored strictly higher), "margin" (r_chosen - r_rejected) and "pairs"."""
    if chosen.shape != rejected.shape or chosen.dim() != 1:
        raise ValueError(f"chosen and rejected must be 1-D of one shape, got {tuple(chosen.shape)} and "
                         f"{tuple(rejected.shape)}")
    diff = chosen.float() - rejected.float()                             # [P]
    n = diff.numel() if total_pairs is None else total_pairs
    loss = -torch.nn.functional.logsigmoid(diff).sum() / max(n, 1)
    with torch.no_grad():
        metrics = {"correct": (diff > 0).sum().float(), "margin": diff.sum(), "pairs": torch.tensor(float(diff.numel()))}
    return loss, metrics
