"""How long `trainfit report` takes on a long run: a 100k-step GRPO stage's metrics.jsonl.

    .venv/bin/python -m bench.report_speed [--steps 100000] [--repeat 3] [--out bench/results/report_speed.json]

The metrics file has the rows a GPU GRPO run logs (train rows with loss, reward, KL, entropy, grad norm,
per-phase memory peaks and time buckets; an evaluation every 500 steps; the plan and memory rows; a few
out-of-memory retries and a resume), with noise, spikes and dips. Each timing is a fresh Python process
running the whole command (imports included), as a user would; its CPU seconds are recorded too, since
a shared machine's load stretches the wall time. Target: < 5 s on a 2-core CPU. It also checks that the
drawn loss keeps the file's largest and smallest values.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PHASES = ("rollout", "scoring", "train")
BUCKETS = ("sync", "generate", "rewards", "logprobs", "forward_backward", "optimizer")


def write_metrics(path: Path, steps: int, seed: int = 0) -> dict:
    """A GRPO stage's metrics.jsonl of `steps` train rows; returns the loss extremes it holds."""
    rng = random.Random(seed)
    lo, hi = (None, None)
    t0 = 1.7e9
    with open(path, "w") as f:
        f.write(json.dumps({"step": 0, "kind": "eval", "time": t0, "accuracy": 0.1}) + "\n")
        f.write(json.dumps({"step": 0, "kind": "plan", "time": t0, **{f"planned_{p}_gib": 20.0 + i for i, p in
                                                                   enumerate(PHASES)}}) + "\n")
        for s in range(1, steps + 1):
            loss = 0.5 * (1 + 1 / s ** 0.3) + rng.gauss(0, 0.02)
            if s % 9973 == 0:
                loss += 5.0      # spikes
            if s % 7919 == 0:
                loss -= 1.0      # dips
            lo, hi = min(loss, lo if lo is not None else loss), max(loss, hi if hi is not None else loss)
            row = {"step": s, "kind": "train", "time": t0 + 3 * s, "loss": loss, "reward": rng.random(),
                   "kl": abs(rng.gauss(0.01, 0.005)), "entropy": 1.2 + rng.gauss(0, 0.05), "ratio": 1.0,
                   "zero_adv_frac": rng.random(), "lr": 1e-5, "grad_norm": abs(rng.gauss(0.5, 0.1)),
                   "step_time": 3.0 + rng.random(), "tokens_per_s": 4000 + 100 * rng.random(),
                   "gpu_mem_peak_gib": 30.0 + rng.random(), "gpu_mem_reserved_gib": 34.0,
                   **{f"gpu_mem_peak_{p}_gib": 19.0 + i + rng.random() for i, p in enumerate(PHASES)},
                   **{f"time_{b}_s": rng.random() for b in BUCKETS}}
            f.write(json.dumps(row) + "\n")
            if s % 500 == 0:
                f.write(json.dumps({"step": s, "kind": "eval", "time": t0 + 3 * s, "accuracy": rng.random()}) + "\n")
            if s % 33_333 == 0:
                f.write(json.dumps({"step": s, "kind": "oom", "micro_batch_size": 1, "accumulation": 16,
                                    "message": f"out of memory at step {s}"}) + "\n")
            if s == steps // 2:
                f.write(json.dumps({"step": s, "kind": "resume", "checkpoint": f"checkpoints/step-{s}"}) + "\n")
        f.write(json.dumps({"step": steps, "kind": "memory", "basis": "cuda max_memory_allocated",
                            **{f"planned_{p}_gib": 20.0 + i for i, p in enumerate(PHASES)},
                            **{f"used_{p}_gib": 20.0 + i for i, p in enumerate(PHASES)}}) + "\n")
    return {"min": lo, "max": hi}


def drawn_loss(page: Path) -> list[float]:
    m = re.search(r'data-figure="fig-curves">(.*?)</script>', page.read_text(), re.S)
    fig = json.loads(m.group(1).replace("<\\/", "</"))
    return next(t["y"] for t in fig["data"] if t["meta"]["metric"] == "loss")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "report_speed.json"))
    args = ap.parse_args()
    run = Path(tempfile.mkdtemp(prefix="trainfit-report-speed-"))
    extremes = write_metrics(run / "metrics.jsonl", args.steps)
    cmd = [sys.executable, "-m", "trainfit.app.cli", "report", str(run)]
    times, cpu = [], []
    for _ in range(args.repeat):
        t, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - t)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    loss = drawn_loss(run / "report.html")
    res = {"command": "trainfit report <run dir>", "steps": args.steps,
           "metrics_rows": sum(1 for _ in open(run / "metrics.jsonl")),
           "metrics_mb": round((run / "metrics.jsonl").stat().st_size / 2 ** 20, 1),
           "report_mb": round((run / "report.html").stat().st_size / 2 ** 20, 2),
           "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
           "seconds": [round(x, 2) for x in times], "median_s": round(sorted(times)[len(times) // 2], 2),
           # CPU seconds of the process: what the wall time is on an idle machine (one core is used)
           "cpu_seconds": [round(x, 2) for x in cpu], "load_average_1min": round(os.getloadavg()[0], 1),
           "loss_points_drawn": len(loss),
           "extremes_kept": min(loss) == extremes["min"] and max(loss) == extremes["max"]}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
