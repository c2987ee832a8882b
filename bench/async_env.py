"""cua_tiny's GRPO stage, rollout.mode=sync against async, on the CPU against a screenshot service that answers
each request late: wall-clock to the same number of samples, the trainer's wait, and the rewards.

    python -m bench.async_env --steps 16 --delay 0.25 --out bench/results/async_env.json

The service is bench/screens_service.py (trainfit's HTTP environment protocol, no browser): 160 x 210
screenshots (cua_tiny's size), reward 1 for an action of odd length, every /reset and /step answered
--delay seconds late, as a browser's page load would be. The policy is preset:vlm-tiny from random
weights (cua_tiny's GRPO stage starts from its SFT stage; this measures time, not learning): the stage's
batch (4 tasks x 8 episodes), its 3 turns, its loss, beta and 4 optimizer steps a rollout, --steps
optimizer steps, no evaluation, no checkpoint. Each run is one `trainfit train` process; runs alternate
sync, async, sync... `train_s` sums the steps' step_time (rollout waits included; model loading left out);
`reward_first` / `reward_last` are the first and last rollouts' mean episode reward.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

from bench.screens_service import serve_screens

ROOT = Path(__file__).resolve().parents[1]
CUA = ROOT / "examples" / "cua_tiny.yaml"


def stage_config(url: str, steps: int, run_dir: Path, mode: str, k: int) -> dict:
    cua = yaml.safe_load(CUA.read_text())
    grpo = next(s for s in cua["stages"] if s["stage"] == "grpo")
    train = {**cua["train"], **grpo["train"], "max_steps": steps, "eval_every": 0, "save_every": 0}
    task = {**cua["task"], "path": str(ROOT / cua["task"]["path"]), "num_eval": 0}
    task.pop("eval_path", None)
    return {"stage": "grpo", "run_dir": str(run_dir), "model": cua["model"], "task": task,
            "env": {**cua["env"], "url": url}, "rollout": {**cua["rollout"], "mode": mode, "max_staleness": k},
            "train": train, "grpo": grpo["grpo"],
            "logging": {"save_transcripts": 0, "progress": False, "tensorboard": False, "plot": False}}


def one_run(url: str, steps: int, root: Path, mode: str, k: int, rep: int) -> dict:
    run_dir = root / f"{mode}{k if mode == 'async' else ''}-{rep}"
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = stage_config(url, steps, run_dir, mode, k)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(cfg))
    began = time.time()
    subprocess.run([sys.executable, "-m", "trainfit.app.cli", "train", str(run_dir / "config.yaml")], check=True,
                   stdout=subprocess.DEVNULL)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    n = cfg["grpo"]["num_iterations"]
    out = {"mode": mode, "k": k if mode == "async" else None, "rep": rep, "steps": len(train),
           "samples": len(train) // n * cfg["train"]["global_batch_size"],
           "train_s": sum(r["step_time"] for r in train), "process_s": time.time() - began,
           "reward_first": train[0]["reward"], "reward_last": train[-1]["reward"],
           "reward_mean": sum(r["reward"] for r in train[::n]) / len(train[::n]),
           "env_failed": max(r.get("env_failed", 0.0) for r in train)}
    if mode == "async":
        out.update(staleness_max=max(r["staleness_max"] for r in train),
                   rollout_wait_s=sum(r.get("time_rollout_wait_s", 0.0) for r in train),
                   worker_rollout_s=sum(r.get("time_async_rollout_s", 0.0) for r in train[::n]))
    else:
        out["rollout_s"] = sum(r.get("time_generate_s", 0.0) for r in train)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16, help="optimizer steps (4 a rollout)")
    ap.add_argument("--delay", type=float, default=0.25, help="seconds the service takes over each request")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--k", type=int, default=1, help="rollout.max_staleness of the async runs")
    ap.add_argument("--root", default="/tmp/async_env_runs")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    server = serve_screens(160, 210, delay_s=a.delay)
    results = []
    try:
        for rep in range(a.reps):
            for mode in ("sync", "async"):
                r = {**one_run(server.url, a.steps, Path(a.root), mode, a.k, rep), "delay_s": a.delay}
                print(json.dumps(r), flush=True)
                results.append(r)
    finally:
        server.stop()
    Path(a.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
