"""Where a step's memory and time went: per-phase peaks and seconds, and the plan they compare with.

The loop opens one `StepMeter.step()` per optimizer step; stages mark their phases with the
module-level `phase(memory, time)` context manager (a no-op outside a step, e.g. in evaluation):

    with memstats.phase("rollout", "generate"):   # memory phase, time bucket
        outs = engine.generate(prompts)

Memory phases are the planner's: `rollout` (generation), `scoring` (rewards, reference / behaviour
log-prob forwards) and `train` (forward/backward and the optimizer step). Each phase's peak is
measured from its own start:
- CUDA: `torch.cuda.max_memory_allocated` after `reset_peak_memory_stats` (what the plan's
  `allocated` predicts), and the peak reserved by the caching allocator.
- CPU: the process's resident set (VmRSS), sampled every 5 ms by a thread while a step runs and
  at every phase boundary (`cpu_rss_sampled_*`; a spike shorter than the interval can be missed).
  RSS counts the interpreter, libraries and allocator caches, not only live tensors, so it is
  reported as RSS and never turned into an error against the plan's tensor bytes. Resetting the
  kernel's high-water mark (VmHWM, via /proc/self/clear_refs) would give exact per-phase peaks, but
  it also resets what getrusage's ru_maxrss reports for the process (and to its parent at exit),
  which the benchmarks and `/usr/bin/time` rely on; the stage report adds the untouched VmHWM as
  the process's peak so far.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from typing import Iterator, Optional

import torch

from trainfit.plan import plan

GiB = 1024 ** 3
PHASES = ("rollout", "scoring", "train")
TRAIN_SUBSTEPS = ("policy forward/backward", "optimizer step", "policy + value forward/backward")  # the last: PPO

_ACTIVE: Optional["StepMeter"] = None


@contextlib.contextmanager
def phase(memory: Optional[str], time_key: Optional[str] = None) -> Iterator[None]:
    """Attribute what runs inside to memory phase `memory` and time bucket `time_key` (either may be
    None) of the current step; does nothing when no step is being measured."""
    meter = _ACTIVE
    if meter is None or meter.thread is not threading.current_thread():
        yield   # also in another thread (the async rollout worker): the step's phases are the trainer's
        return
    with meter.phase(memory, time_key):
        yield


def _status_kib(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    except OSError:
        return None
    return int(m.group(1)) if m else None


class _RssSampler:
    """The largest VmRSS seen since `reset`, from /proc/self/statm read every `interval` seconds."""

    def __init__(self, interval: float = 0.005):
        self.interval = interval
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.fd = os.open("/proc/self/statm", os.O_RDONLY)
        self.peak = self.rss()
        self._lock = threading.Lock()  # a sample taken before a reset must not land after it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainfit-rss", daemon=True)
        self._thread.start()

    def rss(self) -> int:
        return int(os.pread(self.fd, 128, 0).split()[1]) * self.page   # statm: size resident ...

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                self.peak = max(self.peak, self.rss())

    def reset(self) -> None:
        with self._lock:
            self.peak = self.rss()

    def read(self) -> int:
        with self._lock:
            self.peak = max(self.peak, self.rss())
            return self.peak

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        os.close(self.fd)


class StepMeter:
    """Per-step and per-stage peaks (bytes) by memory phase, and seconds by time bucket."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda" and torch.cuda.is_available()
        self.device = torch.device(device)
        self.sampler: Optional[_RssSampler] = None
        self.measured = self.cuda or os.path.exists("/proc/self/statm")  # Linux; elsewhere times only
        if self.cuda:
            self.basis, self.prefix = "cuda max_memory_allocated", "gpu_mem"
        else:
            self.basis, self.prefix = "cpu RSS sampled every 5 ms (process, not tensors)", "cpu_rss_sampled"
        self.stage_peak: dict[str, int] = {}      # phase -> max over the stage's steps
        self.stage_reserved = 0
        self.stage_time: dict[str, float] = {}    # time bucket -> seconds over the stage
        self.thread = threading.current_thread()  # the one whose phases count (step() sets it)
        self._begin()

    def _begin(self) -> None:
        self.peak: dict[str, int] = {}
        self.time: dict[str, float] = {}
        self.step_peak = 0
        self.reserved = 0

    # ---- raw readings --------------------------------------------------------------------------
    def _reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.sampler is not None:
            self.sampler.reset()

    def _read(self) -> int:
        """Peak bytes since the last reset."""
        if self.cuda:
            self.reserved = max(self.reserved, torch.cuda.max_memory_reserved(self.device))
            return torch.cuda.max_memory_allocated(self.device)
        return self.sampler.read() if self.sampler is not None else 0

    def _fold(self) -> int:
        """Read the peak since the last reset into the step's peak (phases reset it, so the gaps
        between them are read too); returns the reading."""
        v = self._read()
        self.step_peak = max(self.step_peak, v)
        return v

    # ---- context managers ----------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self) -> Iterator["StepMeter"]:
        """Measure one optimizer step; phases marked inside attribute to it."""
        global _ACTIVE
        self.thread = threading.current_thread()
        self._begin()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        elif self.measured:
            self.sampler = _RssSampler()
        self._reset()
        previous, _ACTIVE = _ACTIVE, self
        try:
            yield self
        finally:
            _ACTIVE = previous
            self._fold()
            if self.sampler is not None:
                self.sampler.stop()
                self.sampler = None
            self.stage_reserved = max(self.stage_reserved, self.reserved)
            for k, v in self.peak.items():
                self.stage_peak[k] = max(self.stage_peak.get(k, 0), v)
            for k, v in self.time.items():
                self.stage_time[k] = self.stage_time.get(k, 0.0) + v

    @contextlib.contextmanager
    def phase(self, memory: Optional[str], time_key: Optional[str]) -> Iterator[None]:
        if memory is not None:
            self._fold()
            self._reset()
        tick = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize(self.device)  # kernels run async: time and peak at their end
            if time_key is not None:
                self.time[time_key] = self.time.get(time_key, 0.0) + time.perf_counter() - tick
            if memory is not None:
                self.peak[memory] = max(self.peak.get(memory, 0), self._fold())

    def capacity(self) -> dict[str, float]:
        """`{"capacity_gib": ...}`: the card's memory, on CUDA (the line report.html draws the peaks against)."""
        if not self.cuda:
            return {}
        return {"capacity_gib": torch.cuda.get_device_properties(self.device).total_memory / GiB}

    # ---- results -------------------------------------------------------------------------------
    def step_metrics(self) -> dict[str, float]:
        """The last step's figures: `gpu_mem_peak_gib`, `gpu_mem_reserved_gib`, `gpu_mem_peak_<phase>_gib`
        on CUDA (`cpu_rss_sampled_gib`, `cpu_rss_sampled_<phase>_gib` on CPU), `time_<bucket>_s`."""
        out: dict[str, float] = {}
        if not self.measured:
            pass
        elif self.cuda:
            out["gpu_mem_peak_gib"] = self.step_peak / GiB
            out["gpu_mem_reserved_gib"] = self.reserved / GiB
            out.update({f"gpu_mem_peak_{k}_gib": v / GiB for k, v in self.peak.items()})
        else:
            out[f"{self.prefix}_gib"] = self.step_peak / GiB
            out.update({f"{self.prefix}_{k}_gib": v / GiB for k, v in self.peak.items()})
        out.update({f"time_{k}_s": v for k, v in self.time.items()})
        return out

    def stage_report(self, planned: dict[str, float]) -> dict:
        """Per phase: planned GiB (None when the planner failed), used GiB (max over the stage's steps)
        and the relative error (used - planned) / planned, on CUDA only: CPU RSS is not the plan's
        tensor bytes."""
        phases = {}
        for ph in PHASES:
            if ph not in self.stage_peak and ph not in planned:
                continue
            used = self.stage_peak.get(ph)
            used_gib = None if used is None else used / GiB
            plan_gib = planned.get(ph)
            err = None
            if self.cuda and used_gib is not None and plan_gib:
                err = (used_gib - plan_gib) / plan_gib
            phases[ph] = {"planned_gib": plan_gib, "used_gib": used_gib, "error": err}
        out = {"basis": self.basis, "phases": phases, "time_s": dict(self.stage_time)}
        if self.cuda:
            out["reserved_gib"] = self.stage_reserved / GiB
        else:
            hwm = _status_kib("VmHWM")
            if hwm is not None:
                out["process_peak_rss_gib"] = hwm * 1024 / GiB   # whole process so far (VmHWM)
        return out


def planned_phases(plan) -> dict[str, float]:
    """The planner's allocated GiB per measured phase: rollout and scoring as planned (scoring: the
    resident bytes plus the largest no-grad scoring forward, e.g. DPO's reference forward); train = the
    resident train-phase bytes plus the larger of forward/backward and the optimizer step. A rollout
    stage without a scoring forward (GRPO with beta = 0 and one iteration: rewards are Python
    functions) still measures a scoring phase: planned as the resident bytes."""
    sub = dict(plan.substeps)
    train_alloc = plan.phases["train"].allocated
    resident = train_alloc - max(sub.values(), default=0)
    out = {"train": (resident + max((sub[k] for k in TRAIN_SUBSTEPS if k in sub), default=0)) / GiB}
    if "rollout" in plan.phases:
        out["rollout"] = plan.phases["rollout"].allocated / GiB
        out["scoring"] = resident / GiB
    if "scoring" in plan.phases:
        out["scoring"] = plan.phases["scoring"].allocated / GiB
    return out


def plan_stage(cfg) -> tuple[dict[str, float], Optional[str]]:
    """(planned GiB per phase, None) for `cfg`, or ({}, the reason) when the planner fails: a plan
    is a report here and must never stop training."""
    try:
        return planned_phases(plan(cfg, suggest=False)), None
    except Exception as e:  # noqa: BLE001 - any planner failure only loses the comparison
        return {}, f"{type(e).__name__}: {e}"


def memory_row(report: dict, plan_failed: Optional[str]) -> dict:
    """The stage's memory report as one flat metrics.jsonl row (kind=memory): per phase
    `planned_<ph>_gib`, `used_<ph>_gib`, `error_<ph>` (null where not comparable), plus `basis`,
    `time_<bucket>_s` totals and, when the planner failed, `plan_error`."""
    row: dict = {"basis": report["basis"]}
    for ph, m in report["phases"].items():
        row.update({f"planned_{ph}_gib": m["planned_gib"], f"used_{ph}_gib": m["used_gib"], f"error_{ph}": m["error"]})
    row.update({f"time_{k}_s": v for k, v in report["time_s"].items()})
    for k in ("reserved_gib", "process_peak_rss_gib"):
        if k in report:
            row[k] = report[k]
    if plan_failed:
        row["plan_error"] = plan_failed
    return row
