"""The non-finite guard: a step whose loss or gradient norm is NaN or inf changes nothing, and a run of them stops.

One bad batch (a token sequence whose loss overflows, an fp16 activation past 65504) gives a NaN loss;
its backward makes every gradient NaN, and one optimizer step with them writes NaN into every weight,
every AdamW moment and so every later checkpoint. So the loop asks `NonFiniteGuard.check` after the
backward and before the optimizer: a non-finite step is skipped (its gradients zeroed; no parameter,
optimizer-state or learning-rate change), recorded in metrics.jsonl (`skipped_nonfinite: 1`,
`nonfinite`: which of loss / grad_norm) and said in one console line. After `train.max_bad_steps` such
steps in a row the run stops with `NonFiniteStop`: the data or the settings, not one batch, are at fault.

Under several ranks every rank must skip the same step. The gradient norm is global already (DDP
all-reduces the gradients, FSDP's clip reduces the shards' norms); the loss is each rank's share, so
its verdict is all-reduced. DeepSpeed steps inside the engine (train/loop.py `accumulate`): its ZeRO
optimizers (stages 1-3, any dtype) and its bf16 / fp16 optimizers check the gradient norm themselves and
skip a non-finite step (fp16's loss scaler lowers its scale there; DeepSpeed 0.19), so the guard reads
whether the engine applied the step and never steps again. fp16's overflow skips with a finite loss are the
loss scaler finding its scale, not bad batches: they are logged but not counted (DeepSpeed stops by itself
at its minimum scale). A non-finite step the engine applied (ZeRO stage 0 in fp32 has no such check)
cannot be undone: the run stops at once.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from trainfit.core.dist import Ranks, all_reduce_sum
from trainfit.train.parallel import clip_grad_norm


class NonFiniteStop(RuntimeError):
    """The run stopped on non-finite steps (or refused to save non-finite weights); `str()` is the paragraph."""

    exit_code = 1


def non_finite(values: dict[str, float], ranks: Ranks) -> list[str]:
    """The names in `values` that are NaN or inf on any rank (a collective under several ranks)."""
    flags = all_reduce_sum({k: float(not math.isfinite(v)) for k, v in values.items()}, ranks)
    return [k for k in values if flags[k] > 0]


def tensors_finite(tensors) -> bool:
    """Whether every floating-point tensor of `tensors` holds finite values only."""
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


def advice(max_bad: Optional[int] = None) -> str:
    """What to try, shared by the stop after bad steps and the refused save."""
    return ("Try a lower train.lr (or more train.warmup_steps); model.dtype=bf16 rather than fp16 (fp16 overflows "
            "past 65504); and look at the data around that step for an empty, huge or corrupt sample."
            + (f" train.max_bad_steps (now {max_bad}) is how many non-finite steps in a row are skipped before the "
               "run stops." if max_bad is not None else ""))


class NonFiniteGuard:
    """Counts the non-finite steps in a row; `check` says whether this step must be skipped."""

    def __init__(self, max_bad_steps: int, ranks: Ranks, console, logger):
        self.max_bad, self.ranks, self.console, self.logger = max_bad_steps, ranks, console, logger
        self.in_a_row = 0
        self.first: Optional[int] = None   # the first step of the current run of bad ones
        self.what: list[str] = []          # what was non-finite at the last checked step

    def optimizer_step(self, tr, batch, loss: float) -> tuple[float, bool]:
        """Clip and step `tr` (train/loop.py's _Training), unless the loss (this rank's share) or the gradient
        norm is non-finite: then the gradients are dropped and nothing steps. DeepSpeed stepped and clipped
        inside accumulate, at its accumulation boundary: only its norm and whether it applied the step are
        read. Returns (the gradient norm, whether the step was skipped)."""
        if tr.deepspeed:
            engine = tr.train_model
            norm = float(engine.get_global_grad_norm() or 0.0)
            return norm, self.deepspeed_skipped(loss, norm, engine.was_step_applied(), engine.fp16_enabled())
        if not batch.samples:
            # The stage left every sample out (their gradient is exactly zero, e.g. GRPO groups with
            # equal rewards): step on zero gradients, as a backward of those samples would have given,
            # so AdamW's moments and weight decay advance the same.
            for p in tr.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        clip = tr.t.grad_clip if tr.t.grad_clip > 0 else float("inf")
        grad_norm = float(clip_grad_norm(tr.model, tr.params, clip))
        skipped = self.check(loss, grad_norm)   # every rank: the same verdict
        if not skipped:
            tr.optimizer.step()
        tr.optimizer.zero_grad(set_to_none=True)
        return grad_norm, skipped

    def check(self, loss: float, grad_norm: float) -> bool:
        """Whether the step with this rank's loss share and the (global) gradient norm is non-finite on any rank."""
        self.what = non_finite({"loss": loss, "grad_norm": grad_norm}, self.ranks)
        return bool(self.what)

    def deepspeed_skipped(self, loss: float, grad_norm: float, applied: bool, fp16: bool) -> bool:
        """DeepSpeed stepped already: whether it skipped this step (then the schedule must not advance either).
        A non-finite step it applied is beyond repair: stop now."""
        bad = self.check(loss, grad_norm)
        if bad and applied:
            raise NonFiniteStop(
                f"a non-finite {' and '.join(self.what)} under DeepSpeed, whose optimizer applied the step (ZeRO "
                "stage 0 in fp32 does not check for it; ZeRO stages 1-3 and bf16 / fp16 skip it): the weights are no longer finite, so the "
                "run stops without saving them; the checkpoints written before are finite. "
                + advice(self.max_bad))
        if not applied and fp16 and "loss" not in self.what:
            self.what = ["loss_scale_overflow"]   # the fp16 loss scaler lowering its scale: not a bad batch
        elif not applied and not self.what:
            self.what = ["grad_norm"]   # its own overflow check found it; the norm it reports may not show it
        return not applied

    def record(self, done: int, skipped: bool) -> dict:
        """The step's verdict: metrics for its row of metrics.jsonl, one console line for a skip, and
        NonFiniteStop after train.max_bad_steps bad steps in a row (the row is logged by then: call `stop_if_due`)."""
        if not skipped:
            self.in_a_row, self.first = 0, None
            return {}
        counted = self.what != ["loss_scale_overflow"]
        if counted:
            self.in_a_row += 1
            self.first = self.first or done
        if self.ranks.main:
            self.console.print(f"[yellow]step {done}: non-finite {' and '.join(self.what)}; the optimizer step is "
                               f"skipped ({self.in_a_row} in a row of train.max_bad_steps={self.max_bad})[/]",
                               highlight=False)
        return {"skipped_nonfinite": 1, "nonfinite": ",".join(self.what)}

    def stop_if_due(self, done: int, latest_checkpoint) -> None:
        """Raise NonFiniteStop when train.max_bad_steps non-finite steps in a row ended at step `done`.
        `latest_checkpoint()` is looked up only then (a directory listing: not on every step)."""
        if self.in_a_row < self.max_bad:
            return
        checkpoint = latest_checkpoint()
        where = f"steps {self.first}-{done}" if self.first != done else f"step {done}"
        kept = (f"the latest checkpoint, {checkpoint}, holds finite weights" if checkpoint is not None
                else "no checkpoint was written")
        msg = (f"train.max_bad_steps={self.max_bad}: {where} in a row had a non-finite {' and '.join(self.what)} "
               f"(NaN or inf), so the run stops at step {done}. Each was skipped (no weight, optimizer-state or "
               f"learning-rate change: the weights are those before step {self.first}), and {kept}. "
               + advice(self.max_bad) + " To ride out more, resume with a higher one (--resume train.max_bad_steps=N); "
               "to change the lr, dtype or data, start a new run (another run_dir, or --overwrite).")
        self.logger.log(done, {"message": msg}, kind="stop")
        self.logger.close()
        raise NonFiniteStop(msg)
