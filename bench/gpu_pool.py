"""Side-by-side trainer runs on one card, admitted by their planned GPU memory.

Each job is a child process in its own process group with its own CUDA caching allocator, so its
`max_memory_allocated` is its own whatever runs beside it; the pool only has to keep the sum of the
jobs' peaks under the card. A job starts when its planned peak fits in what the running jobs leave
of `capacity_gib` (largest first, jobs of a later `tier` after every earlier one; one that fits does
not wait behind one that does not), and every job is killed with its whole group at the deadline,
marked `cut`, or when the pool stops for any other reason (nothing it started outlives it). Jobs may
be added from another thread while it runs (the cases' model directories are built meanwhile); it
ends once `close()` was called and every job ended.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional


@dataclass
class Job:
    name: str
    cmd: list[str]
    peak_gib: float                       # planned peak, for admission
    log: Path
    tier: int = 0                         # lower tiers start first (snapshot reruns: 1)
    done: Optional[Callable[["Job"], None]] = None   # called once it ended (or was cut)
    proc: Optional[subprocess.Popen] = None
    started: float = 0.0
    seconds: float = 0.0
    rc: Optional[int] = None
    cut: bool = False
    meta: dict = field(default_factory=dict)

    def tail(self, n: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


class Pool:
    def __init__(self, capacity_gib: float, deadline: float, cwd: Path, max_running: int = 4):
        self.capacity, self.deadline, self.cwd, self.max_running = capacity_gib, deadline, cwd, max_running
        self.pending: list[Job] = []
        self.running: list[Job] = []
        self.finished: list[Job] = []
        self.lock = threading.Lock()
        self.closed = False

    def add(self, job: Job) -> None:
        with self.lock:
            self.pending.append(job)

    def close(self) -> None:
        """No more jobs will be added: run() returns once the ones it has ended."""
        self.closed = True

    def free_gib(self) -> float:
        return self.capacity - sum(j.peak_gib for j in self.running)

    def _start(self, job: Job) -> None:
        job.log.parent.mkdir(parents=True, exist_ok=True)
        with open(job.log, "w") as f:
            f.write("$ " + " ".join(job.cmd) + "\n")
            f.flush()
            job.proc = subprocess.Popen(job.cmd, cwd=self.cwd, stdout=f, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        job.started = time.time()
        self.running.append(job)

    def _end(self, job: Job, cut: bool) -> None:
        if cut:
            try:
                os.killpg(job.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        job.rc = job.proc.wait()
        job.cut, job.seconds = cut, round(time.time() - job.started, 1)
        self.running.remove(job)
        self.finished.append(job)
        if job.done:
            job.done(job)   # may add jobs (a snapshot rerun)

    def run(self, poll_s: float = 0.5) -> list[Job]:
        """Until close() was called and every job ended, or the deadline passed; jobs never started
        stay in `pending`."""
        try:
            while (self.pending or self.running or not self.closed) and time.time() < self.deadline:
                with self.lock:
                    # Largest first (first-fit decreasing): small jobs fill the room the big ones leave.
                    order = sorted(self.pending, key=lambda j: (j.tier, -j.peak_gib))
                for job in order:
                    if any(j.tier < job.tier for j in order):
                        break
                    alone = not self.running
                    # A job bigger than the whole capacity still runs, alone.
                    if len(self.running) < self.max_running and (job.peak_gib <= self.free_gib() or alone):
                        with self.lock:
                            self.pending.remove(job)
                        self._start(job)
                for job in list(self.running):
                    if job.proc.poll() is not None:
                        self._end(job, cut=False)
                time.sleep(poll_s)
        finally:
            for job in list(self.running):
                self._end(job, cut=True)
        return self.finished
