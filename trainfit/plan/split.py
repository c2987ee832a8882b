"""Sync against async splits of a node's GPUs for an RL stage: `fit` and `hardware` time each and suggest one.

Sync: all n GPUs train and roll out in turn, a step is rollout + train + comm (steptime.estimate of the
config planned on n GPUs). Async with k rollout GPUs (distributed.rollout_gpus=k, config/devices.py): the
worker samples the next rollout on k GPUs while n - k GPUs train, so with rollout.max_staleness >= 1 a
step takes the longer of the two, max(rollout, train + comm + the weight push), and samples are up to
max_staleness policy versions old (corrected by rollout.off_policy); with max_staleness = 0 the two run
in turn. A split `train` accepts (the config rules, trainfit/config/rules.py `rollout_gpu_errors`) is
planned as it runs (plan/memory.py sizes the rollout and the training GPU apart) and timed from that plan;
a split it does not accept yet is timed from the same config planned on k GPUs (its rollout) and on
n - k GPUs (its training), shown for comparison and never suggested.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from trainfit.config import Config, ConfigError, apply_override, validate
from trainfit.config.stages import stage_spec
from trainfit.plan.hardware import GPU, StepTime, replan_as
from trainfit.plan.memory import plan
from trainfit.plan.steptime import estimate

TIE = 0.01   # an async split must be faster by more than 1% of the estimated step to be suggested


@dataclass
class SplitOption:
    rollout_gpus: int              # 0 = sync: every GPU trains and rolls out in turn
    train_gpus: int
    step: Optional[StepTime]       # None when it could not be planned
    fits: Optional[bool]           # both devices within the budget (None: not planned as it runs)
    runs: bool                     # `trainfit train` accepts it
    why: str = ""                  # when it does not run (or could not be planned): the reason
    overrides: dict[str, Any] = field(default_factory=dict)
    peak: Optional[int] = None     # bytes on the fuller device, and the budget (planned as it runs)
    budget: Optional[int] = None

    @property
    def label(self) -> str:
        if not self.rollout_gpus:
            return f"sync: {self.train_gpus} GPU(s) roll out and train in turn"
        return f"async: {self.rollout_gpus} rollout GPU(s) + {self.train_gpus} training GPU(s)"

    def to_dict(self) -> dict:
        st = self.step
        return {"setup": self.label, "rollout_gpus": self.rollout_gpus, "train_gpus": self.train_gpus,
                "step_s": st.total if st else None, "rollout_s": st.rollout if st else None,
                "train_s": (st.train + st.comm) if st else None, "overlapped": bool(st and st.overlapped),
                "fits": self.fits, "runs": self.runs, "why": self.why,
                "overrides": [f"{k}={v}" for k, v in self.overrides.items()]}


def applies(cfg: Config, num_gpus: Optional[int] = None) -> bool:
    """An RL stage whose rollouts can run asynchronously, on nodes of 2 or more GPUs (a split is of each
    node's GPUs: distributed.rollout_gpus; which splits `train` runs is the config rules' say)."""
    d = cfg.distributed
    return stage_spec(cfg.stage).async_rollout and (num_gpus or d.num_gpus) >= 2


def _with(cfg: Config, ovs: dict[str, Any]) -> Config:
    """`cfg` with dotted overrides, the micro-batch lowered to a divisor of the new per-GPU batch (as fit
    frees it anyway). Raises ConfigError when the config refuses them."""
    raw = cfg.model_dump()
    for k, v in ovs.items():
        raw = apply_override(raw, f"{k}={v}")
    t, d = raw["train"], raw["distributed"]
    world = max(1, d["num_gpus"] - d["rollout_gpus"]) * d["num_nodes"]
    if t["global_batch_size"] % world == 0:
        per = t["global_batch_size"] // world
        t["micro_batch_size"] = max(x for x in range(1, per + 1) if per % x == 0 and x <= t["micro_batch_size"])
    return validate(raw)


def _timed(cfg: Config, card: GPU, margin) -> tuple[StepTime, Any]:
    p = plan(cfg, gpu=replan_as(card), margin=margin)
    return estimate(p.work, card, cfg.world_size), p


def compare_splits(cfg: Config, card: GPU, margin: Optional[float] = None, num_gpus: Optional[int] = None,
                   runnable_only: bool = False) -> list[SplitOption]:
    """Sync and every async split of `cfg`'s GPUs (`num_gpus` of them when given; see the module docstring),
    sync first; with `runnable_only` the async splits `train` accepts and nothing else."""
    if not applies(cfg, num_gpus):
        return []
    n = num_gpus or cfg.distributed.num_gpus
    sync_ovs = {"distributed.num_gpus": n, "rollout.mode": "sync", "distributed.rollout_gpus": 0}
    out = []
    if not runnable_only:
        try:
            st, p = _timed(_with(cfg, sync_ovs), card, margin)
            out.append(SplitOption(0, n, st, p.fits, True, overrides=sync_ovs, peak=p.peak, budget=p.budget))
        except ConfigError as e:
            out.append(SplitOption(0, n, None, None, False, why=str(e), overrides=sync_ovs))
    for k in range(1, n):
        ovs = {"distributed.num_gpus": n, "rollout.mode": "async", "distributed.rollout_gpus": k}
        try:
            split = _with(cfg, ovs)
        except ConfigError as e:
            refused = str(e)
        else:   # accepted: planned and timed as it runs
            st, p = _timed(split, card, margin)
            out.append(SplitOption(k, n - k, st, p.fits, True, overrides=ovs, peak=p.peak, budget=p.budget))
            continue
        if runnable_only:
            continue
        try:   # not run yet: its rollout on k GPUs and its training on n - k, each planned as sync
            roll, _ = _timed(_with(cfg, {**sync_ovs, "distributed.num_gpus": k}), card, margin)
            train, _ = _timed(_with(cfg, {**sync_ovs, "distributed.num_gpus": n - k}), card, margin)
            st = StepTime(roll.rollout, train.train, train.comm, basis=train.basis,
                          overlapped=cfg.rollout.max_staleness >= 1)
        except ConfigError:
            st = None
        out.append(SplitOption(k, n - k, st, None, False, why=refused, overrides=ovs))
    return out


def suggest_split(options: list[SplitOption], current: int = 0) -> Optional[SplitOption]:
    """The option to switch to from the config's own (`current`: its rollout GPUs, 0 = sync): the fastest
    that `train` runs and that fits, when it is another option and faster than the config's own by more
    than TIE (or the config's own does not fit); else None (the config stays as it is)."""
    ok = [o for o in options if o.runs and o.fits and o.step is not None]
    mine = next((o for o in ok if o.rollout_gpus == current), None)
    best = min(ok, key=lambda o: o.step.total, default=None)
    if best is None or best is mine:
        return None
    if mine is not None and best.step.total * (1 + TIE) >= mine.step.total:
        return None
    return best


def describe_splits(options: list[SplitOption]) -> list[str]:
    """Lines for `fit`: each option's estimated step and whether `train` runs it (the one to switch to, if
    any, is said by `split_advice`, so the table and the advice are one voice)."""
    if not options:
        return []
    lines = [f"Sync against async splits of the {options[0].train_gpus} GPUs (estimated step; async with "
             "rollout.max_staleness >= 1 takes the longer of rollout and training, not their sum):"]
    for o in options:
        st = o.step
        time = "could not be planned" if st is None else (
            f"{_sec(st.total)} s (rollout {_sec(st.rollout)}, train + comm {_sec(st.train + st.comm)}"
            + (", overlapped" if st.overlapped else "") + ")")
        fit = "" if o.fits is None else ("; fits" if o.fits else "; does NOT fit")
        runs = "" if o.runs else " - `trainfit train` does not run it yet"
        lines.append(f"  {o.label}: {time}{fit}{runs}")
    return lines


def split_advice(pick: SplitOption, mine: float, again: str) -> str:
    """The split to switch to (suggest_split's pick: planned as it runs, fits, `train` runs it), beside a
    config whose estimated step is `mine` s; `again`: the command that fits the config with it."""
    how = ("rollouts sampled up to rollout.max_staleness policy versions old, corrected by rollout.off_policy"
           if pick.rollout_gpus else "rollouts sampled on-policy, in turn with training")
    return (f"Faster with another split of the GPUs, which changes how rollouts are sampled ({how}): {pick.label}, "
            f"estimated step {_sec(pick.step.total)} s vs {_sec(mine)} s; planned as it runs, it fits "
            f"({pick.peak / 2**30:.1f} GiB on the fuller GPU). fit keeps your rollout mode; to fit that instead: "
            f"{again} " + " ".join(f"{k}={v}" for k, v in pick.overrides.items()))


def _sec(x: float) -> str:
    """Seconds to read: tenths from 1 s, three decimals below (small models' steps)."""
    return f"{x:.1f}" if x >= 1 else f"{x:.3f}"
