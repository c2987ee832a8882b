"""Pure tensor math of the training stages: advantages, log-probs, policy losses, KL, loss aggregation.

No model, trainer or config imports: every function takes tensors and plain numbers, so each one is
tested on hand-computed values and against a slow loop (tests/test_algos.py).

Shapes: B sequences, T token positions, V vocabulary. `mask` is bool or 0/1 `[B, T]`; masked-out
positions never reach a sum (they are selected away, so a NaN or inf there does not leak in).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

IGNORE_INDEX = -100  # label value that sft_loss skips (the Hugging Face convention)

Number = Union[int, float, Tensor]


def masked_sum(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Sum of `x` where `mask` is true, over `dim` (all elements when None)."""
    kept = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: Optional[int] = None) -> Tensor:
    """Mean of `x` over the masked elements; 0 (not NaN) where no element is kept."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
    return masked_sum(x, mask, dim) / count.clamp_min(1).to(x.dtype)


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


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # bf16 / fp16 are upcast to fp32; fp64 stays fp64 (tests use it for precision).
    return torch.promote_types(dtype, torch.float32)


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """log_softmax(logits)[target] over row chunks, with a backward that recomputes softmax per chunk.

    Autograd through `chunk.float()` would keep an upcast copy of every chunk for backward (2x the
    logits for bf16). Here backward keeps only the logits as given plus one log-sum-exp per row, so
    the extra memory is one chunk in fp32 at a time, in forward and in backward.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, chunk_size: int) -> Tensor:
        n = logits.shape[0]                                             # logits [N, V], targets [N]
        cdt = _compute_dtype(logits.dtype)
        out = torch.empty(n, dtype=cdt, device=logits.device)          # [N]
        lse = torch.empty(n, dtype=cdt, device=logits.device)          # [N]
        for s in range(0, n, chunk_size):
            chunk = logits[s:s + chunk_size].to(cdt)                    # [c, V]
            lse[s:s + chunk_size] = torch.logsumexp(chunk, dim=-1)
            picked = chunk.gather(-1, targets[s:s + chunk_size, None]).squeeze(-1)
            out[s:s + chunk_size] = picked - lse[s:s + chunk_size]
        ctx.save_for_backward(logits, targets, lse)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        logits, targets, lse = ctx.saved_tensors
        cs = ctx.chunk_size
        grad = torch.empty_like(logits)                                 # [N, V], logits' dtype
        for s in range(0, logits.shape[0], cs):
            g = grad_out[s:s + cs].to(lse.dtype)[:, None]               # [c, 1]
            # d(x_t - lse)/dx = onehot(t) - softmax(x)
            gc = torch.exp(logits[s:s + cs].to(lse.dtype) - lse[s:s + cs, None]).mul_(-g)
            gc.scatter_add_(-1, targets[s:s + cs, None], g)
            grad[s:s + cs] = gc
        return grad, None, None


def token_logprobs(logits: Tensor, targets: Tensor, chunk_size: int = 0) -> Tensor:
    """log p(target) per position: `logits [B, T, V]`, `targets [B, T]` (valid ids) -> `[B, T]`.

    Computed as `logit[target] - logsumexp(logits)` in fp32 (fp64 input stays fp64). With
    `chunk_size > 0` the flattened `[B*T, V]` rows are processed `chunk_size` rows at a time, so no
    full-size fp32 copy of the logits exists in forward or backward.
    """
    if chunk_size < 0:
        raise ValueError(f"chunk_size must be >= 0 (0 = no chunking), got {chunk_size}")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree")
    if chunk_size == 0:
        x = logits.to(_compute_dtype(logits.dtype))
        return x.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(x, dim=-1)
    v = logits.shape[-1]
    flat = _ChunkedTokenLogprobs.apply(logits.reshape(-1, v), targets.reshape(-1), chunk_size)
    return flat.view(targets.shape)


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy of the next-token distribution, `[B, T, V] -> [B, T]`, in fp32 (fp64 stays fp64)."""
    x = logits.to(_compute_dtype(logits.dtype))
    logp = x - torch.logsumexp(x, dim=-1, keepdim=True)
    p = logp.exp()
    # p * logp is 0 where p == 0 (a -inf logit), not NaN.
    return -torch.where(p > 0, p * logp, torch.zeros((), dtype=x.dtype, device=x.device)).sum(-1)


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

    `logp`, `old_logp` are `[B, T]`, `advantages` `[B]` (one per sequence, broadcast over T), and
    r = exp(logp - old_logp). Returns the loss `[B, T]` and `clipped [B, T]` (bool): tokens where the
    clipped term is strictly the smaller, i.e. the ones that give no gradient.
    """
    ratio = torch.exp(logp - old_logp)                                  # [B, T]
    a = advantages.unsqueeze(-1)                                        # [B, 1]
    unclipped = ratio * a
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * a
    return -torch.minimum(unclipped, clipped), clipped < unclipped


LOSS_AGG: dict[str, str] = {
    "grpo": "seq-mean-token-mean",        # each sequence weighs the same, whatever its length
    "dapo": "token-mean",                 # each token weighs the same
    "dr_grpo": "seq-mean-token-sum-norm",  # token sum over a constant (sequences x max length)
}
AGG_MODES = tuple(LOSS_AGG.values())


def agg_loss(loss_mat: Tensor, mask: Tensor, mode: str, *, total_seqs: Optional[int] = None,
             total_tokens: Optional[Number] = None, max_len: Optional[int] = None) -> Tensor:
    """Reduce a per-token loss `[B, T]` to a scalar; `mode` names the normalisation.

    - "token-mean":              sum(loss * mask) / total_tokens
    - "seq-mean-token-mean":     sum_i mean_t(loss_i over its mask) / total_seqs
    - "seq-mean-token-sum-norm": sum(loss * mask) / (total_seqs * max_len)     (Dr. GRPO)

    Every mode is a sum over sequences divided by a constant, so when a step's batch is split into
    micro-batches and each gets the WHOLE step's `total_seqs` / `total_tokens`, the micro-batch values
    add up to the whole-batch value (and so do the gradients). None means this batch: B and
    mask.sum(). (Under DDP the gradient all-reduce averages over ranks: pass per-device totals.)
    A sequence with no mask token contributes 0; it still counts in total_seqs.
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
        return masked_mean(loss_mat, mask, dim=-1).sum() / total_seqs
    if max_len is None or max_len < 1:
        raise ValueError(f"mode {mode!r} divides by total_seqs x max_len: pass max_len "
                         f"(the generation length limit, e.g. rollout.max_new_tokens), got {max_len}")
    return masked_sum(loss_mat, mask) / (total_seqs * max_len)


def grpo_loss(logp: Tensor, old_logp: Tensor, ref_logp: Optional[Tensor], advantages: Tensor,
              mask: Tensor, *, loss_type: str, eps_low: float, eps_high: float, beta: float,
              kl_estimator: str, total_seqs: Optional[int] = None, total_tokens: Optional[Number] = None,
              max_len: Optional[int] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO / DAPO / Dr. GRPO loss of one micro-batch: clipped surrogate + beta * KL, aggregated.

    `logp`, `old_logp`, `ref_logp`, `mask` are `[B, T]`, `advantages` `[B]`. With one optimizer step
    per rollout (num_iterations = 1) pass `old_logp = logp.detach()`: the ratio is 1 and the gradient is
    the plain policy gradient. The KL term is added only when beta > 0 and `ref_logp` is given.
    Aggregation is `LOSS_AGG[loss_type]`; totals as in `agg_loss`.

    Metrics are detached SUMS over this micro-batch's mask tokens, not means, so the trainer adds
    them over micro-batches (and ranks) and divides once, exactly:
    "clip_frac_sum" (clipped tokens), "kl_sum" (per-token KL, 0 without ref_logp), "ratio_sum"
    (importance ratios), and "tokens" (mask tokens, the divisor of the three others).
    """
    if loss_type not in LOSS_AGG:
        raise ValueError(f"unknown loss_type {loss_type!r}; valid: {', '.join(LOSS_AGG)}")
    per_token, clipped = clipped_policy_loss(logp, old_logp, advantages, eps_low, eps_high)
    kl = None
    if ref_logp is not None:
        kl = kl_penalty(logp, ref_logp, kl_estimator)
        if beta > 0:
            per_token = per_token + beta * kl
    loss = agg_loss(per_token, mask, LOSS_AGG[loss_type], total_seqs=total_seqs,
                    total_tokens=total_tokens, max_len=max_len)
    with torch.no_grad():
        m = mask.bool()
        zero = torch.zeros((), dtype=per_token.dtype, device=per_token.device)
        metrics = {
            "clip_frac_sum": masked_sum(clipped.to(per_token.dtype), m),
            "kl_sum": masked_sum(kl.detach(), m) if kl is not None else zero,
            "ratio_sum": masked_sum(torch.exp(logp - old_logp), m),
            "tokens": m.sum().to(per_token.dtype),
        }
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


def shifted_logprobs(logits: Tensor, input_ids: Tensor, temperature: float = 1.0,
                     chunk_size: int = 0) -> Tensor:
    """Log-prob of each next input token, at a sampling temperature: `[B, T, V]`, `[B, T]` -> `[B, T-1]`.

    Position t holds log p(input t+1 | tokens <= t). The targets are shifted (last column padded)
    rather than the logits sliced, so no `[B, T, V]` copy is made before `token_logprobs`.
    """
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    targets = torch.cat([input_ids[:, 1:], input_ids[:, :1]], dim=1)                # [B, T]
    return token_logprobs(logits, targets, chunk_size=chunk_size)[:, :-1]


class _RowLogprobs(torch.autograd.Function):
    """log softmax(logits / T)[target] of rows `[N, V]`, chunk by chunk, plus (no-grad) their entropy.

    The same math as `token_logprobs` (`logit[target] - logsumexp`, fp32 or fp64), with the
    temperature folded in: backward keeps only the logits as given and one log-sum-exp per row and
    recomputes softmax per chunk, so no `[N, V]` fp32 copy (of `logits / T` or of the softmax)
    outlives the chunk being processed, in forward or in backward. The entropy is of the untempered
    distribution softmax(logits) (what GRPO logs); it reuses the chunk's log-sum-exp when T = 1.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float, chunk_size: int,
                want_entropy: bool):
        n = logits.shape[0]                                             # logits [N, V], targets [N]
        cdt = _compute_dtype(logits.dtype)
        out = torch.empty(n, dtype=cdt, device=logits.device)          # [N]
        lse = torch.empty(n, dtype=cdt, device=logits.device)          # [N], of logits / T
        ent = torch.empty(n if want_entropy else 0, dtype=cdt, device=logits.device)
        scaled = temperature > 0 and temperature != 1.0
        for s in range(0, n, chunk_size):
            raw = logits[s:s + chunk_size].to(cdt)                      # [c, V]
            x = raw / temperature if scaled else raw
            lse_c = torch.logsumexp(x, dim=-1)                          # [c]
            lse[s:s + chunk_size] = lse_c
            out[s:s + chunk_size] = x.gather(-1, targets[s:s + chunk_size, None]).squeeze(-1) - lse_c
            del x  # one fp32 chunk at a time: drop it before the next one is made
            if want_entropy:
                raw_lse = torch.logsumexp(raw, dim=-1) if scaled else lse_c
                ent[s:s + chunk_size] = _entropy_given_lse(raw, raw_lse)
            del raw
        ctx.save_for_backward(logits, targets, lse)
        ctx.chunk_size, ctx.temperature = chunk_size, (temperature if scaled else 1.0)
        ctx.mark_non_differentiable(ent)
        return out, ent

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor, _grad_ent):
        logits, targets, lse = ctx.saved_tensors
        cs, temp = ctx.chunk_size, ctx.temperature
        grad = torch.empty_like(logits)                                 # [N, V], logits' dtype
        for s in range(0, logits.shape[0], cs):
            g = grad_out[s:s + cs].to(lse.dtype)[:, None]               # [c, 1]
            x = logits[s:s + cs].to(lse.dtype)
            if temp != 1.0:
                x = x / temp
                g = g / temp
            # d(x_t/T - lse)/dx = (onehot(t) - softmax(x/T)) / T
            gc = torch.exp(x - lse[s:s + cs, None]).mul_(-g)
            del x
            gc.scatter_add_(-1, targets[s:s + cs, None], g)
            grad[s:s + cs] = gc
            del gc
        return grad, None, None, None, None


def _entropy_given_lse(x: Tensor, lse: Tensor, rows: int = 1024) -> Tensor:
    """Entropy of softmax(x) per row, `[c, V]` with its log-sum-exp `[c]` -> `[c]`, no grad,
    `rows` rows at a time (its temporaries are a few `[rows, V]`)."""
    with torch.no_grad():
        h = torch.empty(x.shape[0], dtype=x.dtype, device=x.device)
        for s in range(0, x.shape[0], rows):
            z = x[s:s + rows] - lse[s:s + rows, None]                   # log-probs [r, V]
            p = z.exp()
            z.masked_fill_(p == 0, 0)   # p log p is 0 there; a -inf logit would give 0 * -inf = NaN
            h[s:s + rows] = -p.mul_(z).sum(-1)
        return h


def token_logprobs_rows(logits: Tensor, targets: Tensor, temperature: float = 1.0, chunk_size: int = 0,
                        entropy: bool = False) -> tuple[Tensor, Optional[Tensor]]:
    """log softmax(logits / T)[target] for selected rows: `logits [N, V]`, `targets [N]` -> `[N]`.

    The rows are the positions whose next token is scored (e.g. only the policy's tokens, the LM
    head applied to those positions alone). `chunk_size` rows at a time (0 = all at once); no fp32
    copy of the logits is kept for backward. With `entropy`, also returns the detached entropy of
    softmax(logits) per row `[N]` (untempered, as GRPO logs it), else None. T <= 0 means 1 (greedy).
    Equals `token_logprobs(logits / T, targets)` and `token_entropy(logits)` row by row.
    """
    if chunk_size < 0:
        raise ValueError(f"chunk_size must be >= 0 (0 = no chunking), got {chunk_size}")
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"logits must be [N, V] and targets [N], got {tuple(logits.shape)} and {tuple(targets.shape)}")
    n = logits.shape[0]
    if n == 0:
        cdt = _compute_dtype(logits.dtype)
        empty = logits.new_zeros(0, dtype=cdt) + logits.sum() * 0      # keeps the graph for backward
        return empty, (empty.detach() if entropy else None)
    logp, ent = _RowLogprobs.apply(logits, targets, float(temperature), chunk_size or n, entropy)
    return logp, (ent if entropy else None)


def entropy_sum(rows: Tensor, chunk_rows: int = 1024) -> Tensor:
    """Sum of token entropies over `rows` `[N, V]`, `chunk_rows` at a time (bounded fp32 memory)."""
    total = torch.zeros((), dtype=torch.float32, device=rows.device)
    for i in range(0, rows.shape[0], max(chunk_rows, 1)):
        total = total + token_entropy(rows[i:i + chunk_rows]).sum()
    return total
