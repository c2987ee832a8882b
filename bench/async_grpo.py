"""The demo's GRPO stage, rollout.mode=sync against async, on the CPU: wall-clock to the same number of samples
trained and held-out accuracy at equal samples, with the staleness observed.

    python -m bench.async_grpo --sft runs/demo/sft/final --steps 30 --out /tmp/async_grpo.json
    python -m bench.async_grpo --sft runs/demo/sft/final --workers thread process --out ...   # both workers

Each run is one `trainfit train` process of examples/demo.yaml's grpo stage (its batch, lr, G and loss;
warmup shortened to the run) from the given SFT model, with train.max_steps=--steps, no evaluation in
between and no checkpoint. `train_s` is the training loop's wall-clock: from the step-0 evaluation's row
to the last step's row of metrics.jsonl (model loading and the two evaluations left out), `first_step_s` its
first step (with the async worker's start: a process worker's child starts then), `cpu_s` the CPU seconds
of the whole run (user + system, its worker process included); `samples` =
steps x global batch; `accuracy` is the final held-out evaluation (the task's 500 held-out problems,
greedy). `rollout_wait_s`: the seconds the async trainer waited for the worker (time_rollout_wait_s summed),
`worker`: rollout.worker of an async run (thread or process; --workers runs each),
`worker_rollout_s`: the worker's seconds sampling and scoring (time_async_rollout_s summed, overlapped with
training); `rollout_s`: sync's seconds generating, scoring and in scoring forwards (time_generate_s,
time_rewards_s, time_logprobs_s summed); `forward_backward_s`: the trainer's training forwards and backwards
(time_forward_backward_s summed). Runs alternate sync, async (each worker),
sync, async... so that a machine whose load changes affects every side alike; `load_avg` is the 1-minute load
average at each run's end.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import yaml

DEMO = Path(__file__).resolve().parents[1] / "examples" / "demo.yaml"


def stage_config(sft: str, steps: int, run_dir: Path, mode: str, k: int, worker: str = "thread") -> dict:
    demo = yaml.safe_load(DEMO.read_text())
    grpo = next(s for s in demo["stages"] if s["stage"] == "grpo")
    train = {**grpo["train"], "max_steps": steps, "eval_every": 0, "save_every": 0, "device": "cpu",
             "warmup_steps": min(grpo["train"]["warmup_steps"], max(steps // 4, 1))}
    return {"stage": "grpo", "run_dir": str(run_dir), "model": {"name": sft}, "task": demo["task"],
            "rollout": {**demo["rollout"], "mode": mode, "max_staleness": k,
                        **({"worker": worker} if mode == "async" else {})}, "train": train,
            "grpo": grpo["grpo"], "logging": {"save_completions": 0, "progress": False, "tensorboard": False,
                                               "plot": False}}


def one_run(sft: str, steps: int, root: Path, mode: str, k: int, rep: int, worker: str = "thread") -> dict:
    run_dir = root / f"{mode}{k if mode == 'async' else ''}{'-' + worker if mode == 'async' else ''}-{rep}"
    cfg = run_dir / "config.yaml"
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.write_text(yaml.safe_dump(stage_config(sft, steps, run_dir, mode, k, worker)))
    began, used = time.time(), _children_cpu()
    subprocess.run([sys.executable, "-m", "trainfit.app.cli", "train", str(cfg)], check=True,
                   stdout=subprocess.DEVNULL)
    wall, cpu = time.time() - began, _children_cpu() - used
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    first_eval = next(r for r in evals if r["step"] == 0)
    out = {"mode": mode, "k": k if mode == "async" else None, "worker": worker if mode == "async" else None,
           "rep": rep, "steps": len(train), "load_avg": os.getloadavg()[0],
           "samples": len(train) * stage_config(sft, steps, run_dir, mode, k)["train"]["global_batch_size"],
           "train_s": train[-1]["time"] - first_eval["time"], "process_s": wall, "cpu_s": cpu,
           "first_step_s": train[0]["time"] - first_eval["time"],
           "accuracy_start": first_eval["accuracy"], "accuracy": evals[-1]["accuracy"],
           "reward_mean": sum(r["reward"] for r in train) / len(train),
           "forward_backward_s": sum(r.get("time_forward_backward_s", 0.0) for r in train)}
    if mode == "async":
        out.update(staleness_mean=sum(r["staleness_mean"] for r in train) / len(train),
                   staleness_max=max(r["staleness_max"] for r in train),
                   rollout_wait_s=sum(r.get("time_rollout_wait_s", 0.0) for r in train),
                   worker_rollout_s=sum(r.get("time_async_rollout_s", 0.0) for r in train),
                   iw_cut_frac=sum(r.get("iw_cut_frac", 0.0) for r in train) / len(train))
    else:
        out["rollout_s"] = sum(r.get(f"time_{k}_s", 0.0) for r in train for k in ("generate", "rewards", "logprobs"))
    return out


def _children_cpu() -> float:
    """User + system CPU seconds of the finished runs (each run's process and the worker process it waited for)."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sft", required=True, help="the SFT model's final dir (the demo's sft stage)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--k", type=int, default=1, help="rollout.max_staleness of the async runs")
    ap.add_argument("--workers", nargs="+", default=["thread"], choices=["thread", "process"],
                    help="rollout.worker of the async runs (one async run per worker and repetition)")
    ap.add_argument("--root", default="/tmp/async_grpo_runs")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    results = []
    for rep in range(a.reps):
        for mode, worker in [("sync", "thread"), *[("async", w) for w in a.workers]]:
            r = one_run(a.sft, a.steps, Path(a.root), mode, a.k, rep, worker)
            print(json.dumps(r), flush=True)
            results.append(r)
    Path(a.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
