"""The LM head fused with the token log-probs: hidden rows and the head weight in, log-probs out,
with no `[N, V]` logits outside one row chunk in forward or in backward."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from trainfit.algos.core import _compute_dtype
from trainfit.algos.logprobs import chunk_forward, chunk_logits_grad, row_buffers

# Rows per chunk when train.logits_chunk_rows is 0: a chunk must bound the logits. 256 rows of a
# 152k vocabulary are ~150 MiB per fp32 copy, and the [256, d] x [d, V] matmul still fills a GPU.
FUSED_CHUNK_ROWS = 256


class _LinearRowLogprobs(torch.autograd.Function):
    """log softmax((h W^T + b) / T)[target] of hidden rows `h [N, d]`, a chunk of rows at a time.

    Forward computes each chunk's logits `[c, V]` in the model dtype (as the model's own head does),
    then `_RowLogprobs`'s math in fp32 (fp64 stays fp64), and keeps one log-sum-exp per row. Backward
    recomputes each chunk's logits and gives the gradients of `h` and, when they need one, of `W`
    and `b`; the logits' gradient is cast to the model dtype before the two matmuls, as the plain
    head's backward receives it. The entropy is of the untempered softmax, detached (what GRPO logs).
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, temperature: float,
                chunk_size: int, want_entropy: bool):
        n = hidden.shape[0]                                             # hidden [N, d], weight [V, d]
        cdt = _compute_dtype(weight.dtype)
        out, lse, ent = row_buffers(n, cdt, hidden.device, want_entropy)
        scaled = temperature > 0 and temperature != 1.0
        for s in range(0, n, chunk_size):
            rows = slice(s, s + chunk_size)
            raw = torch.nn.functional.linear(hidden[rows], weight, bias).to(cdt)          # [c, V]
            chunk_forward(raw, targets[rows], temperature, out[rows], lse[rows], ent[rows] if want_entropy else None)
            del raw
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.chunk_size, ctx.temperature = chunk_size, (temperature if scaled else 1.0)
        ctx.mark_non_differentiable(ent)
        return out, ent

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor, _grad_ent):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        cs, temp = ctx.chunk_size, ctx.temperature
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty_like(hidden) if need_h else None           # [N, d]
        # Accumulated in the weight's dtype over chunks (each matmul accumulates in fp32 inside).
        grad_w = torch.zeros_like(weight) if need_w else None           # [V, d]
        grad_b = torch.zeros_like(bias) if need_b else None             # [V]
        for s in range(0, hidden.shape[0], cs):
            rows = slice(s, s + cs)
            h = hidden[rows]                                            # [c, d]
            x = torch.nn.functional.linear(h, weight, bias).to(lse.dtype)   # [c, V], a fresh tensor
            # In place: one fp32 [c, V] at a time, then in the weight's dtype as the plain head's grad.
            gl = chunk_logits_grad(x, lse[rows], grad_out[rows], targets[rows], temp, inplace=True)
            del x
            gl = gl.to(weight.dtype)                                    # [c, V]
            if need_h:
                grad_h[rows] = gl @ weight
            if need_w:
                grad_w.addmm_(gl.t(), h.to(weight.dtype))
            if need_b:
                grad_b += gl.sum(0)
            del gl
        return grad_h, grad_w, grad_b, None, None, None, None


def linear_token_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0,
                          chunk_size: int = 0, entropy: bool = False, bias: Optional[Tensor] = None
                          ) -> tuple[Tensor, Optional[Tensor]]:
    """`token_logprobs_rows(linear(hidden, weight, bias), targets, ...)` without the `[N, V]` logits.

    `hidden [N, d]` (the final hidden states at the scored positions), `weight [V, d]` (the LM head),
    `targets [N]` -> log-probs `[N]` in fp32 (fp64 stays fp64) and, with `entropy`, the detached
    untempered entropy per row `[N]` (else None). `chunk_size` rows at a time (0 = FUSED_CHUNK_ROWS);
    forward and backward hold one chunk's logits, its fp32 copy and its gradient at a time, and
    backward recomputes the chunk's logits (one more head matmul). T <= 0 means 1 (greedy).
    """
    if chunk_size < 0:
        raise ValueError(f"chunk_size must be >= 0 (0 = {FUSED_CHUNK_ROWS} rows), got {chunk_size}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1] or targets.shape != hidden.shape[:1]:
        raise ValueError(f"hidden must be [N, d], weight [V, d] and targets [N], got {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)} and {tuple(targets.shape)}")
    if hidden.dtype != weight.dtype:   # e.g. a model that upcasts its last hidden states: the head's dtype rules
        hidden = hidden.to(weight.dtype)
    n = hidden.shape[0]
    if n == 0:
        cdt = _compute_dtype(weight.dtype)
        empty = hidden.new_zeros(0, dtype=cdt) + hidden.sum() * 0 + weight.sum() * 0   # keeps the graph
        return empty, (empty.detach() if entropy else None)
    logp, ent = _LinearRowLogprobs.apply(hidden, weight, bias, targets, float(temperature),
                                         chunk_size or FUSED_CHUNK_ROWS, entropy)
    return logp, (ent if entropy else None)
