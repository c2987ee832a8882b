"""Log-probabilities and entropies of tokens under logits, with bounded fp32 memory."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from trainfit.algos.core import _compute_dtype


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
        out, lse, ent = row_buffers(n, cdt, logits.device, want_entropy)
        scaled = temperature > 0 and temperature != 1.0
        for s in range(0, n, chunk_size):
            rows = slice(s, s + chunk_size)
            chunk_forward(logits[rows].to(cdt), targets[rows], temperature, out[rows], lse[rows],
                          ent[rows] if want_entropy else None)
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
            rows = slice(s, s + cs)
            # .to() may return the saved logits themselves (fp32 in): not in place.
            grad[rows] = chunk_logits_grad(logits[rows].to(lse.dtype), lse[rows], grad_out[rows], targets[rows],
                                           temp, inplace=False)
        return grad, None, None, None, None


def row_buffers(n: int, dtype: torch.dtype, device, want_entropy: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The per-row outputs of a chunked log-prob forward: log-probs `[N]`, log-sum-exps `[N]` (of
    logits / T, kept for backward) and entropies (`[N]`, or `[0]` when not wanted)."""
    return (torch.empty(n, dtype=dtype, device=device), torch.empty(n, dtype=dtype, device=device),
            torch.empty(n if want_entropy else 0, dtype=dtype, device=device))


def chunk_forward(raw: Tensor, targets: Tensor, temperature: float, out: Tensor, lse: Tensor,
                  ent: Optional[Tensor]) -> None:
    """One row chunk of `_RowLogprobs` / the fused head's forward: logits `raw [c, V]` (fp32 or fp64)
    -> `out [c]` = log softmax(raw / T)[target], `lse [c]` = logsumexp(raw / T) and, when `ent` is
    given, the untempered entropy `[c]`, each written into the caller's row slice."""
    scaled = temperature > 0 and temperature != 1.0
    x = raw / temperature if scaled else raw
    torch.logsumexp(x, dim=-1, out=lse)                                 # [c]
    out.copy_(x.gather(-1, targets[:, None]).squeeze(-1) - lse)
    del x  # one fp32 chunk at a time: drop it before the entropy's temporaries are made
    if ent is not None:
        ent.copy_(_entropy_given_lse(raw, torch.logsumexp(raw, dim=-1) if scaled else lse))


def chunk_logits_grad(x: Tensor, lse: Tensor, grad_out: Tensor, targets: Tensor, temperature: float,
                      inplace: bool) -> Tensor:
    """The gradient `[c, V]` (x's dtype) of log softmax(x / T)[target] weighted by `grad_out [c]`, for
    one chunk of logits `x [c, V]` (fp32 or fp64) with their saved `lse [c]` of x / T:
    d(x_t/T - lse)/dx = (onehot(t) - softmax(x/T)) / T. `inplace`: x is a temporary the caller
    gives up (its memory becomes the gradient)."""
    g = grad_out.to(lse.dtype)[:, None]                                 # [c, 1]
    if temperature != 1.0:
        x, g, inplace = x / temperature, g / temperature, True          # x / T is a fresh tensor
    # Not in place: (x - lse) and its exp are two temporaries, what the plain head's measured GPU
    # peaks (tests/test_plan_h100.py) were taken with; in place reuses x's memory for both.
    grad = x.sub_(lse[:, None]).exp_() if inplace else torch.exp(x - lse[:, None])
    return grad.mul_(-g).scatter_add_(-1, targets[:, None], g)


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
