"""The optimizer loop shared by every stage: accumulation, clipping, schedule, eval, checkpoints.

A stage (sft.py, grpo.py) supplies four plain things: `prepare(step)` returns the whole optimizer
step's samples with the totals its loss normalises by; `loss(model, micro, totals)` returns the
micro-batch's share of the step loss (so shares add up to the full-batch loss and micro-batch size
never changes the gradient); `evaluate(model)` and `state_dict()` / `load_state_dict()`.
"""

from __future__ import annotations

import math
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from trainfit.config import Config, ConfigError, TrainConfig, compact
from trainfit.config.stages import stage_spec
from trainfit.core.dist import Ranks, SINGLE, all_gather_objects, all_reduce_sum, barrier
from trainfit.core.heap import cpu_heap_for_decoding, limit_cpu_heap_growth
from trainfit.models.policy import LoadedModel, _require, count_parameters, trainable_parameters
from trainfit.train import checkpoint as ckpt, final_save, memstats, parallel, report_html, trackers as tracking
from trainfit.train.ckpt_manifest import resume_point
from trainfit.train.faults import Faults
from trainfit.train.interrupt import Interrupted, StopSignals
from trainfit.train.nonfinite import NonFiniteGuard
from trainfit.train.report import MetricsLogger, Progress
from trainfit.train.stage import Stage, StageResult, StepBatch, step_seed
from trainfit.train.zero import cpu_adam


def seed_step(seed: int, step: int) -> None:
    s = step_seed(seed, step)
    torch.manual_seed(s)
    random.seed(s)


def fused_adamw_applies(params: list[torch.nn.Parameter], deepspeed: bool = False) -> bool:
    """torch's fused AdamW kernel (one pass per parameter, no temporaries: the same update as the
    default foreach / for-loop implementations up to float rounding) for plain floating-point
    parameters on CPU or CUDA. Not under DeepSpeed (its ZeRO optimizer steps flat partitions) nor
    for FSDP's DTensor shards, which keep torch's default choice."""
    return (not deepspeed and bool(params)
            and all(type(p) is torch.nn.Parameter and p.is_floating_point() and p.device.type in ("cpu", "cuda")
                    for p in params))


def make_optimizer(params: list, t: TrainConfig, lr: Optional[float] = None,
                   deepspeed: bool = False, cpu_offload: bool = False) -> torch.optim.Optimizer:
    """AdamW over `params`: parameters, or param-group dicts (each may set its own "lr").
    `cpu_offload`: DeepSpeed's CPU Adam (ZeRO-Offload steps the optimizer partition in CPU RAM)."""
    kw = dict(lr=t.lr if lr is None else lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps, weight_decay=t.weight_decay)
    flat = [p for g in params for p in g["params"]] if params and isinstance(params[0], dict) else params
    if cpu_offload:  # runnable.py refuses offload with the bitsandbytes optimizers
        return cpu_adam(params, **kw)
    if t.optimizer == "adamw":
        return torch.optim.AdamW(params, **kw, fused=fused_adamw_applies(flat, deepspeed) or None)
    _require("bitsandbytes", "bnb", f"train.optimizer={t.optimizer}")
    import bitsandbytes as bnb
    cls = bnb.optim.AdamW8bit if t.optimizer == "adamw_8bit" else bnb.optim.PagedAdamW8bit
    return cls(params, **kw)


def lr_factor(step: int, t: TrainConfig) -> float:
    """Linear warmup to 1, then cosine down to min_lr_ratio at max_steps (or constant)."""
    if t.warmup_steps and step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    if t.schedule == "constant":
        return 1.0
    span = max(1, t.max_steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def accumulate(model, batch: StepBatch, micro_size: int, loss_fn: Callable,
               before_micro: Optional[Callable[[], None]] = None, world: int = 1) -> dict[str, float]:
    """Forward/backward every micro-batch of this rank's share of the step; return summed metrics.

    Each rank's loss is its share of the whole step's loss (normalised by global totals). DDP
    averages gradients over ranks, so the backward is scaled by the rank count to make the result
    the gradient of the step's loss: the same on 1 or N ranks. DDP syncs only after the last micro.
    """
    sums: dict[str, float] = {}
    starts = list(range(0, len(batch.samples), micro_size))
    deepspeed = parallel.is_deepspeed(model)
    for i in starts:
        if before_micro is not None:
            before_micro()
        with parallel.gradient_sync(model, sync=i == starts[-1]):
            loss, metrics = loss_fn(model, batch.samples[i:i + micro_size], batch.totals)
            if deepspeed:
                # DeepSpeed divides by its accumulation steps and averages ranks: undo both, then let
                # it step (it applies the optimizer only at the accumulation boundary).
                model.backward(loss * world * len(starts))
                model.step()
            else:
                (loss * world if world > 1 else loss).backward()
        for k, v in {"loss": loss.item(), **metrics}.items():
            sums[k] = sums.get(k, 0.0) + float(v)
    return sums


class OutOfMemoryAtMicroBatchOne(RuntimeError):
    """Even one sample per forward does not fit: the config itself must change."""


def smaller_micro(micro: int, per_device: int) -> Optional[int]:
    """The largest divisor of the per-device batch at most half of `micro` (None below 1)."""
    for d in range(micro // 2, 0, -1):
        if per_device % d == 0:
            return d
    return None


def accumulate_recovering(model, optimizer, batch: StepBatch, micro: int, loss_fn: Callable, *,
                          faults: Faults, on_change: Callable[[int, int], None], world: int = 1,
                          per_device: Optional[int] = None) -> tuple[dict, int]:
    """`accumulate`, retrying the same step with a smaller micro-batch after an out-of-memory error.

    The step's samples, their order and the loss normalisers are unchanged, so the retried step has
    the same gradient (and GRPO groups stay in the same optimizer step); only how many samples go
    through one forward changes. The new size divides `per_device` (the full per-device batch; a
    stage may train fewer samples in a step, e.g. GRPO leaving out zero-advantage ones). Returns
    (metric sums, the micro-batch size that worked).
    """
    while True:
        try:
            return accumulate(model, batch, micro, loss_fn, faults.before_micro, world), micro
        except torch.OutOfMemoryError:
            if parallel.is_deepspeed(model):  # its micro-batch is fixed at initialise: no retry
                raise OutOfMemoryAtMicroBatchOne(micro) from None
        # Past the except block the error's traceback, which pins the failed forward's activations,
        # is gone: only now can the memory be returned.
        optimizer.zero_grad(set_to_none=True)  # drop the partial step; it is redone whole
        _free_memory()
        new = smaller_micro(micro, per_device or len(batch.samples))
        if new is None:
            raise OutOfMemoryAtMicroBatchOne(micro)
        on_change(micro, new)
        micro = new


def _free_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def train_stage(cfg: Config, loaded: LoadedModel, stage: Stage, stage_dir: Path, *, resume: bool,
                console, faults: Faults, save_final: Callable[..., Path], ranks: Ranks = SINGLE,
                stop: Optional[StopSignals] = None) -> StageResult:
    """Run one stage's optimizer steps. `save_final(dir)` writes the final model on rank 0; for a
    sharded model it also gets `state_dict=`, the model's whole tensors read one at a time (final_save.py).
    `stop`: a SIGINT / SIGTERM asks the stage to checkpoint the step reached and raise Interrupted
    (train/interrupt.py)."""
    t = cfg.train
    if next(loaded.model.parameters()).device.type == "cpu":
        limit_cpu_heap_growth()
    tr = _training(cfg, loaded, ranks)
    ckpt_root = stage_dir / "checkpoints"
    if ranks.main:
        ckpt.clean_partial(ckpt_root)
    # Verified against its manifest; a damaged one falls back to the one before, said on the console.
    latest = resume_point(ckpt_root, ranks, console) if resume else None
    logger = MetricsLogger(stage_dir, _start_trackers(cfg, stage_dir, latest is not None, ranks), enabled=ranks.main)
    # The plan this stage is measured against (rank 0 reports; a planner failure only loses the comparison).
    planned, plan_failed = memstats.plan_stage(cfg) if ranks.main else ({}, None)
    run = _StageRun(tr, stage, logger, memstats.StepMeter(next(tr.model.parameters()).device), console, faults,
                    ranks, ckpt_root, cfg.batch_plan().per_device_batch, report=cfg.logging.plot, stop=stop,
                    name=cfg.stage if stage_dir == Path(cfg.run_dir) else stage_dir.name)
    start = run.resume_or_evaluate(latest)
    if planned:   # the plan as a row of its own, so a report drawn mid-stage has it (the memory row comes at the end)
        logger.log(start, {**{f"planned_{ph}_gib": v for ph, v in planned.items()}, **run.meter.capacity()},
                   kind="plan")
    tr.model.train()
    began = time.time()
    run.steps(start, Progress(console, total=t.max_steps, start=start, enabled=cfg.logging.progress and ranks.main))
    last_eval = run.evaluate_last(planned, plan_failed)
    final_dir = run.save_final(stage_dir / "final", save_final)
    # The stage's steps (a resumed stage counts those before its checkpoint too); the seconds are this process's.
    return StageResult(stage_dir, final_dir, run.first_eval, last_eval, run.done, time.time() - began)


@dataclass
class _Training:
    """The model as it trains and what steps it."""

    t: TrainConfig
    model: Any                # the model itself: checkpoints, evaluation and the final save read it
    train_model: Any          # what the micro-batches run through: the parallel wrapper, or DeepSpeed's engine
    is_peft: bool
    params: list
    optimizer: torch.optim.Optimizer
    scheduler: Any
    deepspeed: bool
    collective: bool          # sharded weights: every forward is a collective, so all ranks evaluate

    @property
    def engine(self) -> Any:
        """DeepSpeed's engine (its checkpoints hold the ZeRO partitions), else None."""
        return self.train_model if self.deepspeed else None


def _training(cfg: Config, loaded: LoadedModel, ranks: Ranks) -> _Training:
    """Wrap the model for its ranks, then build its optimizer, schedule and (DeepSpeed) engine."""
    t, model = cfg.train, loaded.model
    # Shard or replicate before the optimizer sees the parameters (FSDP2 replaces them with shards).
    train_model = parallel.wrap(model, cfg, ranks, loaded.is_peft)
    collective = parallel.collective_forward(model)
    params = trainable_parameters(model)
    # PPO's policy + critic (value_model.PolicyCritic): one param group each, the critic at ppo.value_lr.
    groups = model.param_groups(cfg.effective_lr(), cfg.ppo.value_lr) if hasattr(model, "param_groups") else params
    optimizer = make_optimizer(groups, t, lr=cfg.effective_lr(), deepspeed=cfg.engine() == "deepspeed",
                               cpu_offload=cfg.engine() == "deepspeed" and cfg.distributed.offload_optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, t))
    if cfg.engine() == "deepspeed":  # its ZeRO optimizer steps our AdamW's param groups (lr from scheduler)
        train_model = parallel.deepspeed_initialize(model, optimizer, cfg)
    return _Training(t, model, train_model, loaded.is_peft, params, optimizer, scheduler,
                     parallel.is_deepspeed(train_model), collective)


class _StageRun:
    """One stage's steps on `tr`: resumed or evaluated first, each step logged, evaluated and checkpointed
    on train's schedule, then evaluated last and saved."""

    def __init__(self, tr: _Training, stage: Stage, logger: MetricsLogger, meter: memstats.StepMeter, console,
                 faults: Faults, ranks: Ranks, ckpt_root: Path, per_device: int, report: bool = False,
                 stop: Optional[StopSignals] = None, name: str = ""):
        self.tr, self.stage, self.logger, self.meter, self.console = tr, stage, logger, meter, console
        self.report = report   # logging.plot: report.html rewritten at each evaluation
        self.faults, self.ranks, self.ckpt_root, self.per_device = faults, ranks, ckpt_root, per_device
        self.first_eval: dict = {}
        self.micro = tr.t.micro_batch_size
        self.done = tr.t.max_steps   # the last step run: max_steps, or where train.stop_at_accuracy ended it
        self.stop_eval: Optional[dict] = None   # the evaluation that ended it
        self.stop, self.name = stop, name   # a signal's request to stop; the stage as the resume message names it
        self.guard = NonFiniteGuard(tr.t.max_bad_steps, ranks, console, logger)   # skips NaN / inf steps

    def resume_or_evaluate(self, latest: Optional[Path]) -> int:
        """Load the latest checkpoint, if any, else start the metrics afresh; a stage starting at step 0 is
        evaluated first. Returns the first step."""
        tr, start = self.tr, 0
        if latest is not None:
            start, state = ckpt.load_checkpoint(latest, model=tr.model, is_peft=tr.is_peft, optimizer=tr.optimizer,
                                                scheduler=tr.scheduler, ranks=self.ranks, engine=tr.engine)
            if start > tr.t.max_steps:   # a resume may shorten a constant schedule's stage (train/resume.py)
                raise ConfigError(f"--resume: the latest checkpoint, {latest}, is at step {start}, past "
                                  f"train.max_steps={tr.t.max_steps}; set train.max_steps to {start} or more.")
            self.stage.load_state_dict(state["stage"] | {"world_changed": state.get("world_changed", False)})
            self.first_eval = state.get("first_eval", {})
            # The micro-batch can shrink after an out-of-memory error; the smaller one is kept from then on.
            self.micro = state.get("micro_batch_size", self.micro)
            # At the last step, the final evaluation and memory rows came after the checkpoint: written again.
            self.logger.truncate_after(start, redone=("eval", "memory") if start >= tr.t.max_steps else ())
            self.logger.log(start, {"checkpoint": str(latest)}, kind="resume")   # a marker in report.html
            self.console.print(f"resumed from {latest} at step {start}")
        else:
            self.logger.reset()
        if start == 0:
            self.first_eval = _evaluate(self.stage, tr.model, self.ranks, tr.collective)
            self.logger.log(0, self.first_eval, kind="eval")
        return start

    def steps(self, start: int, progress: Progress) -> None:
        t = self.tr.t
        with progress:
            self.stop_if_asked(start, saved=True)   # asked while loading: the state is the latest checkpoint's
            for step in range(start, t.max_steps):
                seed_step(t.seed, step)
                tick = time.time()
                batch, sums, grad_norm, skipped = self.step(step)
                done = step + 1
                self.log_step(done, batch, sums, grad_norm, tick, progress, self.guard.record(done, skipped))
                self.guard.stop_if_due(done, lambda: ckpt.latest_checkpoint(self.ckpt_root))
                evaluated = self.evaluate_and_save(done)
                self.faults.after_step(done)
                if self.reached_target(evaluated, done):
                    self.done, self.stop_eval = done, evaluated
                    break
                if done < t.max_steps:   # after the last step the stage ends as usual: evaluated and saved
                    self.stop_if_asked(done, saved=bool(t.save_every) and done % t.save_every == 0)

    def stop_if_asked(self, done: int, saved: bool) -> None:
        """Raise Interrupted when a signal asked the run to stop (every rank agrees, at the same step), after
        checkpointing step `done` unless `saved` (a checkpoint of that very state exists, or none is needed)."""
        signum = self.stop.requested() if self.stop is not None else None
        if signum is None:
            return
        path = ckpt.latest_checkpoint(self.ckpt_root) if saved else self.save(done)
        self.logger.log(done, {"message": f"stopped on {signal.Signals(signum).name} after step {done}"}, kind="stop")
        self.logger.close()
        raise Interrupted(signum, done, path, self.name)

    def step(self, step: int) -> tuple[StepBatch, dict, float, bool]:
        """One optimizer step: the stage's samples through every micro-batch (a smaller micro-batch after an
        out-of-memory error), then clip and step unless it is non-finite. Returns (the batch, its metric sums,
        the gradient norm, whether the step was skipped as non-finite)."""
        tr = self.tr
        with self.meter.step():  # stages mark their own phases inside prepare (rollout, scoring)
            batch = self.stage.prepare(step)
            with memstats.phase("train", "forward_backward"):
                sums, self.micro = accumulate_recovering(
                    tr.train_model, tr.optimizer, batch, self.micro, self.faults.loss(step + 1, self.stage.loss),
                    faults=self.faults, world=self.ranks.world, per_device=self.per_device,
                    on_change=lambda a, b: self.report_oom(a, b, done_so_far=step))
            with memstats.phase("train", "optimizer"):
                grad_norm, skipped = self.guard.optimizer_step(tr, batch, sums.get("loss", 0.0))
            if not skipped:   # a skipped step leaves the schedule where it was, as the weights
                tr.scheduler.step()
        return batch, sums, grad_norm, skipped

    def report_oom(self, old: int, new: int, done_so_far: int) -> None:
        per_device = self.per_device
        msg = (f"out of memory at step {done_so_far + 1} with micro-batch {old}: retrying the step with "
               f"micro-batch {new} x accumulation {per_device // new} (same global batch, same gradient)")
        self.console.print(f"[yellow]{msg}[/]", highlight=False)
        self.logger.log(done_so_far, {"micro_batch_size": new, "accumulation": per_device // new, "message": msg},
                        kind="oom")

    def log_step(self, done: int, batch: StepBatch, sums: dict, grad_norm: float, tick: float,
                 progress: Progress, skip: dict) -> None:
        """The step's metrics, summed over ranks, to the log (every train.log_every steps, and a step skipped
        as non-finite with `skip`'s fields) and the progress bar; the stage's notices as warnings."""
        t = self.tr.t
        sums = all_reduce_sum(sums, self.ranks)  # every metric is a sum over samples: add the ranks' up
        metrics = self.stage.summarize(batch, sums)
        elapsed = time.time() - tick
        metrics.update(lr=self.tr.scheduler.get_last_lr()[0], grad_norm=float(grad_norm), step_time=elapsed,
                       **self.meter.step_metrics(), **skip)
        if "seq_tokens" in sums:  # every token through the training forward (prompt included)
            metrics["tokens_per_s"] = sums["seq_tokens"] / max(elapsed, 1e-9)
        if done % t.log_every == 0 or done == t.max_steps or skip:
            self.logger.log(done, metrics)
        progress.update(done, metrics)
        for msg in self.stage.notices():  # e.g. GRPO: no learning signal
            if self.ranks.main:
                self.console.print(f"warning: {msg}", style="yellow", markup=False, highlight=False)
            self.logger.log(done, {"message": msg}, kind="warning")

    def reached_target(self, evaluated: Optional[dict], done: int) -> bool:
        """Whether train.stop_at_accuracy ends the stage at this step: rank 0 judged its evaluation, every
        rank leaves the loop together."""
        target = self.tr.t.stop_at_accuracy
        if target is None or evaluated is None:
            return False
        acc = evaluated.get("accuracy")
        hit = acc is not None and acc >= target
        if all_reduce_sum({"stop": float(hit)}, self.ranks)["stop"] == 0:
            return False
        if self.ranks.main:
            msg = (f"held-out accuracy {100 * acc:.1f}% reached train.stop_at_accuracy={target} at step {done}: "
                   f"the stage ends there (of train.max_steps={self.tr.t.max_steps})")
            self.console.print(msg, highlight=False)
            self.logger.log(done, {"message": msg}, kind="stop")
        return True

    def evaluate_and_save(self, done: int) -> Optional[dict]:
        """The held-out evaluation every train.eval_every steps (its metrics returned), a checkpoint every
        train.save_every."""
        tr, t = self.tr, self.tr.t
        evaluated = None
        if t.eval_every and done % t.eval_every == 0 and done < t.max_steps:
            evaluated = _evaluate(self.stage, tr.model, self.ranks, tr.collective)
            self.logger.log(done, evaluated, kind="eval")
            tr.model.train()
            if self.ranks.main and self.report:
                report_html.refresh(self.logger.path.parent, self.console)
        if t.save_every and done % t.save_every == 0:
            self.save(done)
        return evaluated

    def save(self, done: int) -> Path:
        """Checkpoint the state after step `done` (every rank calls it)."""
        tr = self.tr
        return ckpt.save_checkpoint(self.ckpt_root, done, model=tr.model, is_peft=tr.is_peft, optimizer=tr.optimizer,
                                    engine=tr.engine, scheduler=tr.scheduler, keep=tr.t.keep_checkpoints,
                                    ranks=self.ranks, stage_state={"stage": self.stage.state_dict(),
                                                                   "first_eval": self.first_eval,
                                                                   "micro_batch_size": self.micro},
                                    fault=self.faults.hook(done))

    def evaluate_last(self, planned: dict, plan_failed: Optional[str]) -> dict[str, float]:
        """The final evaluation, and the stage's measured memory against its plan, logged."""
        if self.stop_eval is not None:   # the stage ended at an evaluation of these very weights
            last_eval = self.stop_eval
        else:
            last_eval = _evaluate(self.stage, self.tr.model, self.ranks, self.tr.collective)
            self.logger.log(self.done, last_eval, kind="eval")
        self.logger.log(self.done, memstats.memory_row(self.meter.stage_report(planned), plan_failed), kind="memory")
        return last_eval

    def save_final(self, final_dir: Path, save_final: Callable[..., Path]) -> Path:
        """Rank 0 writes the final model (final_save.py: sharded weights gathered a tensor at a time as it
        writes them); the log closes."""
        final_save.save_final_model(self.tr.model, self.tr.is_peft, self.ranks, final_dir, self.ckpt_root,
                                    save_final, self.console, getattr(self.stage, "saves_from_module", False))
        barrier(self.ranks)
        self.logger.close()
        return final_dir


def _start_trackers(cfg: Config, stage_dir: Path, resumed: bool, ranks: Ranks) -> list:
    """Rank 0 starts the trackers; every rank learns whether that failed, so all stop together with
    the same ConfigError instead of waiting at the next collective."""
    out, error = [], None
    if ranks.main:
        try:
            out = tracking.build(cfg, stage_dir, resume=resumed)
        except ConfigError as e:
            error = str(e)
    errors = [e for e in all_gather_objects(error, ranks) if e]
    if errors:
        raise ConfigError(errors[0])
    return out


def _evaluate(stage: Stage, model, ranks: Ranks, collective: bool) -> dict[str, float]:
    """Held-out evaluation, reported by rank 0. Replicated weights: rank 0 alone evaluates while the
    others wait. Sharded weights: every forward is a collective, so all ranks run the same evaluation."""
    # ZeRO-3: the weights gathered whole (every rank joins) and forwards local, so rank 0 alone evaluates.
    # A tensor-parallel vLLM engine generates with every rank of its group (rollout/vllm_engine.py).
    collective = collective or getattr(getattr(stage, "engine", None), "collective", False)
    with cpu_heap_for_decoding(), parallel.full_weights(model):  # evaluation decodes (GRPO's task accuracy)
        out = stage.evaluate(model) if ranks.main or collective else {}
    barrier(ranks)
    return out if ranks.main else {}


def describe_start(cfg: Config, loaded: LoadedModel, device: Any) -> str:
    total, trainable = count_parameters(loaded.model)
    # What the count covers, in the plan's words (plan/counts.py): PPO trains policy and critic as one module.
    spec = stage_spec(cfg.stage)
    what = spec.trained_label
    # Preference stages count pairs: each puts its chosen and rejected sides through the forward.
    unit = f" (samples are pairs: {spec.pairs_per_forward} sequences each)" if spec.reads_pairs else ""
    return (f"[bold]{cfg.stage}[/] on {device} | {cfg.model.name} ({what}{total / 1e6:.2f}M params, "
            f"{trainable / 1e6:.2f}M trainable, {cfg.model.dtype}) | {cfg.batch_plan().describe()}{unit}\n"
            f"[dim]config: {compact(cfg)}[/]")
