"""The trainer's GRPO LM head on real tensors, for the planner's head figures to be checked against
(tests/test_plan_trace.py: the plain head; tests/test_fused_head.py: the fused one)."""

import gc

import torch

from trainfit import algos
from trainfit.plan.tracker import LiveTracker


def real_grpo_head_peak(b, t, new, d, v, chunk, fused: bool) -> int:
    """Peak live bytes of the trainer's GRPO head on real tensors: hidden rows at the policy positions,
    the plain or the fused head, row log-probs with entropy, the loss, backward."""
    hidden = torch.randn(b, t, d, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(v, d) * 0.02, requires_grad=False)
    ids = torch.randint(0, v, (b, t))
    mask = torch.zeros(b, t - 1, dtype=torch.bool)
    mask[:, t - 1 - new:] = True
    tracker = LiveTracker({id(hidden.untyped_storage()), id(weight.untyped_storage())})
    gc.disable()
    try:
        with tracker.mode, torch.autograd.graph.saved_tensors_hooks(tracker.pack, lambda x: x):
            keep = torch.nn.functional.pad(mask, (0, 1))
            targets = ids[:, 1:][mask]
            if fused:
                logp_rows, _ = algos.linear_token_logprobs(hidden[keep], weight, targets, 1.0, chunk, True)
            else:
                rows = torch.nn.functional.linear(hidden[keep], weight)                      # [n, V]
                logp_rows, _ = algos.token_logprobs_rows(rows, targets, 1.0, chunk, True)
                del rows
            logp = torch.zeros(mask.shape).masked_scatter(mask, logp_rows)
            loss, _ = algos.grpo_loss(logp, logp.detach(), None, torch.ones(b), mask.float(), loss_type="dapo",
                                      eps_low=0.2, eps_high=0.2, beta=0.0, kl_estimator="k3", total_seqs=b,
                                      total_tokens=float(b * new), max_len=new)
            tracker.mark("forward")
            loss.backward()
    finally:
        gc.enable()
    return tracker.peak()
