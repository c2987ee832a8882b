"""How many torch threads a CPU run uses (train.cpu_threads), chosen on purpose and said at stage start.

torch starts with one intra-op thread per core it sees (or OMP_NUM_THREADS). On a machine shared
with other work that is the wrong default for the models trainfit trains on CPU: every op forks onto
all cores and waits at a barrier for the slowest thread, and a thread whose core another job holds
stalls the op (the demo's SFT ran ~50x slower with 2 threads than with 1 on a loaded 2-core machine).
bench/cpu_threads.py measures a training step by model size at 1 and 2 threads
(bench/results/cpu_threads.json, 2-core AVX2 machine with other jobs running): 2 threads were 14x
slower at 0.16M parameters, 1.5x at 3.3M, 1.8x at 17.5M, 3.1x at 104M (load 3-5), and tied at 104M
under a heavier load (7-10). So `auto` gives models under SMALL_MODEL one thread, and larger ones
what torch would (all cores), shared among this node's ranks:

- `train.cpu_threads: N` sets N (over OMP_NUM_THREADS);
- else OMP_NUM_THREADS when the user set it (not when only torchrun set it for trainfit's own relaunch);
- else 1 for a model under SMALL_MODEL parameters, and otherwise the cores this process may use
  (affinity mask, capped by a cgroup CPU quota) divided among the ranks on this node.

Not measured: an idle many-core machine, where more threads likely pay off below SMALL_MODEL too;
there, set train.cpu_threads (bench/cpu_threads.py --threads 1 2 4 8 measures it).
GPU runs are left as torch found them (their CPU threads feed the GPU, not the math).

With the async rollout worker in a process of its own (rollout.worker=process) the chosen count is split
between the trainer and the worker (`split_for_worker`): half each, at least one each, so on 2 cores the
two run in parallel (1 + 1).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional, Union

import torch

# Below this many parameters one thread was fastest at every size measured (bench/results/cpu_threads.json).
SMALL_MODEL = 100_000_000
CGROUP = Path("/sys/fs/cgroup")
# Set by `trainfit train` for the ranks it launches when the user's environment had no OMP_NUM_THREADS,
# so the ranks can tell torchrun's default (OMP_NUM_THREADS=1 for every worker) from the user's choice.
NOT_FROM_USER = "TRAINFIT_OMP_NUM_THREADS_FROM_TORCHRUN"
_interop_set = False


def cgroup_cpus(root: Path = CGROUP) -> Optional[float]:
    """The CPU quota of this process's cgroup in CPUs (cgroup v2 cpu.max, v1 cfs quota), None if unlimited."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def available_cores(root: Path = CGROUP) -> int:
    """Cores this process may run on: its affinity mask, capped by the cgroup quota (rounded down, at least 1)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpus(root)
    return max(1, min(cores, math.floor(quota))) if quota else cores


def auto_threads(cores: int, params: int, local_ranks: int = 1) -> int:
    """`auto`: 1 for a small model, else this node's cores shared among its ranks."""
    if params < SMALL_MODEL:
        return 1
    return max(1, cores // max(1, local_ranks))


def choose(setting: Union[str, int], *, params: int, cores: int, local_ranks: int = 1,
           env: Optional[dict] = None) -> tuple[int, str]:
    """(threads, why) for train.cpu_threads=`setting`; `env` is os.environ (OMP_NUM_THREADS)."""
    env = os.environ if env is None else env
    if setting != "auto":
        return int(setting), f"train.cpu_threads={setting}"
    omp = env.get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) > 0 and NOT_FROM_USER not in env:
        return int(omp), f"OMP_NUM_THREADS={omp} from the environment; train.cpu_threads=auto defers to it"
    n = auto_threads(cores, params, local_ranks)
    per_rank = f" for {local_ranks} ranks" if local_ranks > 1 else ""
    return n, f"auto: {cores} cores available{per_rank}, {params / 1e6:.2f}M-parameter model"


def split_for_worker(n: int) -> tuple[int, int]:
    """(trainer, worker) threads out of `n` for a trainer and a rollout worker process: the worker half (at
    least 1), the trainer the rest (at least 1); 1 gives 1 + 1."""
    worker = max(1, n // 2)
    return max(1, n - worker), worker


def worker_threads(setting: Union[str, int], *, params: int) -> int:
    """The rollout worker process's share of train.cpu_threads=`setting` (see `apply`)."""
    return split_for_worker(choose(setting, params=params, cores=available_cores())[0])[1]


def set_threads(n: int) -> None:
    """torch's intra-op threads, and the inter-op ones the first time (settable once per process, before any
    inter-op work; they stay as they are after that)."""
    global _interop_set
    torch.set_num_threads(n)
    if not _interop_set:
        _interop_set = True
        try:
            torch.set_num_interop_threads(n)
        except RuntimeError:
            pass


def apply(setting: Union[str, int], *, params: int, device: torch.device, local_ranks: int = 1,
          worker_process: bool = False) -> Optional[str]:
    """Set torch's thread count for a CPU stage; the line saying so, or None on a GPU (left as it is). With
    `worker_process` (rollout.worker=process) the trainer takes its part of `split_for_worker`."""
    if device.type != "cpu":
        return None
    n, why = choose(setting, params=params, cores=available_cores(), local_ranks=local_ranks)
    if worker_process:
        trainer, worker = split_for_worker(n)
        set_threads(trainer)
        return (f"CPU threads: {trainer} for training + {worker} for the rollout worker process ({why}: {n}, "
                "split between the two for rollout.worker=process, at least 1 each)")
    set_threads(n)
    return f"CPU threads: {n} ({why})"


def launch_env(env: dict) -> dict:
    """The environment for ranks `trainfit train` launches under torchrun: marks an OMP_NUM_THREADS that
    torchrun (not the user) will set, so `auto` still chooses per rank."""
    return env if "OMP_NUM_THREADS" in env else {**env, NOT_FROM_USER: "1"}
