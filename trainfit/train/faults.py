"""Fault injection for tests: kill the process at a chosen point to prove recovery works.

Spec strings (CLI `--fault`, comma-separated): `kill_after_step:N` (SIGKILL once step N finished
and any checkpoint at N is complete), `kill_in_checkpoint:N` (SIGKILL half-way through writing the
checkpoint of step N), `oom_at_micro:K` (raise torch.OutOfMemoryError, the real exception type,
before the K-th micro-step of the run, counted from 1, once), `nan_loss:N` or `nan_loss:N-M` (the loss of
step N, or of steps N to M, counted from 1, is NaN, and so its gradients), `nan_grad:N` / `nan_grad:N-M`
(the loss stays finite, its gradients are NaN).
"""

from __future__ import annotations

import os
import signal
from typing import Callable, Optional

import torch

from trainfit.config import ConfigError

KINDS = ("kill_after_step", "kill_in_checkpoint", "oom_at_micro")
NAN_KINDS = ("nan_loss", "nan_grad")   # these take a step or a range of steps


class Faults:
    def __init__(self, spec: Optional[str] = None):
        self.points: dict[str, int] = {}
        self.nan_steps: dict[str, range] = {}
        self.micro_steps = 0
        for part in filter(None, (spec or "").split(",")):
            kind, _, n = part.partition(":")
            first, _, last = n.partition("-") if kind in NAN_KINDS else (n, "", "")
            if kind not in KINDS + NAN_KINDS or not first.isdigit() or not (last or first).isdigit():
                raise ConfigError(f"--fault {part!r} is not understood; use one of "
                                  f"{', '.join([k + ':STEP' for k in KINDS] + [k + ':STEP[-STEP]' for k in NAN_KINDS])}.")
            if kind in NAN_KINDS:
                self.nan_steps[kind] = range(int(first), int(last or first) + 1)
            else:
                self.points[kind] = int(n)

    @staticmethod
    def _kill() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    def after_step(self, step: int) -> None:
        if self.points.get("kill_after_step") == step:
            self._kill()

    def before_micro(self) -> None:
        self.micro_steps += 1
        if self.points.get("oom_at_micro") == self.micro_steps:
            raise torch.OutOfMemoryError(f"injected out-of-memory at micro-step {self.micro_steps}")

    def hook(self, step: int) -> Optional[Callable[[str], None]]:
        if self.points.get("kill_in_checkpoint") != step:
            return None
        return lambda where: self._kill()

    def loss(self, step: int, loss_fn: Callable) -> Callable:
        """The stage's loss function for step `step` (counted from 1): poisoned with NaN when a nan_ fault names it."""
        if step in self.nan_steps.get("nan_loss", ()):
            return lambda *a: _poisoned(loss_fn(*a), lambda loss: loss * float("nan"))
        if step in self.nan_steps.get("nan_grad", ()):
            return lambda *a: _poisoned(loss_fn(*a), _NanGradient.apply)
        return loss_fn


def _poisoned(out: tuple, poison: Callable) -> tuple:
    loss, metrics = out
    return poison(loss), metrics


class _NanGradient(torch.autograd.Function):
    """The identity forward; the gradient through it is NaN (a finite loss with non-finite gradients)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")
