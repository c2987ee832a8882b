"""Running `trainfit train` under the fault-injection harness: each run is a child forked from the harness's
process (which imported torch and trainfit once), in a process group of its own; a signal is sent to the
run's process at a chosen moment of its wall time, and any process of its group that outlives it (a
rollout worker left running) is counted as an orphan, then killed.

A faulted run is a chain: the run is started, signalled at a drawn moment, continued with
`--resume-or-start` (what a requeued job script runs: --resume where a checkpoint exists, a fresh start
where the kill came before the first), signalled again, ... until a process finishes before its moment
comes, or the kills to inject are spent and the last process runs to its end.
"""

from __future__ import annotations

import importlib
import os
import random
import signal
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Optional

# What a process ended by each signal should exit with: SIGKILL cannot be caught (the kernel's -9);
# SIGTERM and SIGINT checkpoint the step reached and exit 128 + the signal (train/interrupt.py).
EXPECTED_RC = {signal.SIGKILL: -signal.SIGKILL, signal.SIGTERM: 128 + signal.SIGTERM,
               signal.SIGINT: 128 + signal.SIGINT}
POLL_S = 0.005
ORPHAN_S = 60.0   # a process of the run alive this long after the run ended is an orphan


def draw_moments(seed: int, stage: str, kind: str, n: int, wall_s: float) -> list[float]:
    """`n` kill moments in seconds, uniform over [0, wall_s), from a generator seeded by (seed, stage, kind):
    the same three give the same moments in any process and any order of stages."""
    rng = random.Random(f"{seed}:{stage}:{kind}")
    return [round(rng.uniform(0.0, wall_s), 4) for _ in range(n)]


def _child(argv: list[str], log: Path, modules_out: Optional[Path]) -> None:
    code, before = 1, set(sys.modules)
    try:
        os.setpgid(0, 0)
        fd = os.open(str(log), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        from trainfit.app.main import main

        main(argv)   # what the `trainfit` command runs, its Ctrl-C guard included
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:   # noqa: BLE001 - whatever ends the child is written to its log
        traceback.print_exc()
    finally:
        if modules_out is not None:
            modules_out.write_text("\n".join(sorted(set(sys.modules) - before)))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def preload(modules_file: Path) -> None:
    """Import in this process what a run imported lazily (listed by run_process's `modules_out`), so the runs
    forked after it start warm: ~1.5 s less each on two busy cores. A module that fails to import is left."""
    for name in modules_file.read_text().split():
        if name not in sys.modules:
            try:
                importlib.import_module(name)
            except Exception:   # noqa: BLE001 - an optional part this machine lacks: the run imports it again
                pass


@dataclass
class Process:
    argv: list
    log: str
    at_s: Optional[float]    # when the signal was due (None: no signal)
    sent: bool = False       # the signal went out before the process ended
    rc: Optional[int] = None
    wall_s: float = 0.0
    orphans: int = 0         # processes of the run still alive ORPHAN_S after it ended
    outlived_s: float = 0.0  # how long the last of them outlived it
    timed_out: bool = False  # still running after timeout_s: killed
    tail: str = ""


def run_process(argv: list[str], log: Path, signum: int = signal.SIGKILL, at_s: Optional[float] = None,
                timeout_s: float = 600.0, modules_out: Optional[Path] = None) -> Process:
    """`trainfit <argv>` in a forked child; `signum` sent to it `at_s` seconds after it started. Waits for its end
    and for the processes it started (Process.orphans: those still alive ORPHAN_S later). With
    `modules_out`, the child lists there the modules it imported (for preload)."""
    p = Process(list(argv), str(log), at_s)
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:
        _child(argv, log, modules_out)
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        now = time.monotonic() - t0
        if done:
            p.rc, p.wall_s = os.waitstatus_to_exitcode(status), round(now, 3)
            # A process that exited between the poll and the kill is signalled as a zombie: not killed.
            p.sent = p.sent and not (signum == signal.SIGKILL and p.rc != -signal.SIGKILL)
            break
        if at_s is not None and not p.sent and now >= at_s:
            p.sent = True
            try:
                os.kill(pid, signum)
            except ProcessLookupError:   # it ended between the poll and the signal
                p.sent = False
        elif now > timeout_s and not p.timed_out:   # hung: ended, and the chain fails on its exit code
            p.timed_out = True
            os.killpg(pid, signal.SIGKILL)
        time.sleep(POLL_S)
    p.orphans, p.outlived_s = _outlived(pid)
    text = Path(log).read_text(errors="replace") if Path(log).exists() else ""
    p.tail = text[-1500:]
    return p


def _outlived(pgid: int, wait_s: float = ORPHAN_S) -> tuple[int, float]:
    """(processes the run started still alive `wait_s` after it ended, then killed; seconds the last one
    outlived it): a rollout worker or a data loader must notice its parent is gone. The signal went to the
    run's process alone, as the kernel's out-of-memory killer or `kill -9 <pid>` sends it."""
    t0 = time.monotonic()
    while _group(pgid) and time.monotonic() - t0 < wait_s:
        time.sleep(0.1)
    left = len(_group(pgid))
    if left:
        os.killpg(pgid, signal.SIGKILL)
    return left, round(time.monotonic() - t0, 1)


def _group(pgid: int) -> list[int]:
    """The live processes of a process group (zombies, ended and waiting for their reaper, left out)."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and os.getpgid(int(d.name)) == pgid and \
                    (d / "stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                out.append(int(d.name))
        except (OSError, IndexError):   # gone meanwhile
            pass
    return out


def state_after(run_dir: Path) -> dict:
    """Where a signalled run stood: the latest checkpoint's name, a half-written one left behind, the last train
    step in metrics.jsonl (the phase the signal landed in, roughly)."""
    from bench.faults_compare import metrics_files, read_rows

    root = next((p for p in sorted(run_dir.rglob("checkpoints"))), None)
    latest = (root / "latest").read_text().strip() if root and (root / "latest").is_file() else None
    half = sorted(p.name for p in root.glob(".tmp-*")) if root else []
    steps = [r["step"] for f in metrics_files(run_dir).values() for r in read_rows(f) if r.get("kind") == "train"]
    return {"latest": latest, "half_written": half, "last_step": max(steps, default=0),
            "final": any(run_dir.rglob("final/*.safetensors"))}


def faulted_run(config: Path, run_dir: Path, signum: int, moments: Iterator[float], kills: int,
                logs: Path, max_processes: int = 40) -> dict:
    """One chain (module docstring) of at most `kills` signals; its processes and how it ended."""
    processes, sent, ok = [], 0, False
    for i in range(max_processes):
        at = next(moments) if sent < kills else None
        argv = ["train", str(config)] + (["--resume-or-start"] if i else [])
        p = run_process(argv, logs / f"{run_dir.parent.name}-{run_dir.name}-{i}.log", signum, at)
        row = asdict(p)
        if p.sent:
            sent += 1
            row["state"] = state_after(run_dir)
            row["early"] = _stopped_early(p, signum)
            row["expected_rc"] = p.rc == EXPECTED_RC[signum] or row["early"] or (
                p.rc == 0 and signum != signal.SIGKILL)   # asked to stop in the last step: it finishes
        processes.append(row)
        if p.rc == 0:
            ok = True
            break
        if not p.sent or not row["expected_rc"]:
            break   # a failure that no signal explains: the run does not recover
    return {"signals": sent, "recovered": ok, "processes": processes}


def _stopped_early(p: Process, signum: int) -> bool:
    """A signal before the command line or the trainer installs its handler (a run's first instants): SIGTERM
    ends the process as its default does (the kernel's -15); SIGINT is Python's KeyboardInterrupt, raised
    wherever the process is (in the command-line library's start, it ends with a traceback and exit 1).
    Nothing was trained, so nothing is lost; the harness counts these apart (`early`)."""
    return ((signum == signal.SIGTERM and p.rc == -signal.SIGTERM) or
            (signum == signal.SIGINT and p.rc in (1, -signal.SIGINT) and "KeyboardInterrupt" in p.tail))
