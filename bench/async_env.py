"""cua_tiny's GRPO stage, rollout.mode=sync against async, on the CPU against a slow environment: a
screenshot service that answers each request late, or the real MiniWoB++ browsers. Wall-clock to the
same number of samples, the trainer's wait, the rewards and, against MiniWoB++, held-out success.

    python -m bench.async_env --steps 16 --delay 0.25 --out bench/results/async_env.json
    python -m bench.async_env --service miniwob --sft runs/async_cua_sft --train-sft      # once: rows + SFT
    python -m bench.async_env --service miniwob --sft runs/async_cua_sft --modes sync async async sync \
        --root runs/async_cua_grpo --out bench/results/async_env_miniwob.json

`--service screens` (the default) is bench/screens_service.py (trainfit's HTTP environment protocol, no
browser): 160 x 210 screenshots (cua_tiny's size), reward 1 for an action of odd length, every /reset
and /step answered --delay seconds late, as a browser's page load would be. The policy is preset:vlm-tiny
from random weights (this measures time, not learning): --steps optimizer steps (16), no evaluation.

`--service miniwob` serves cua_tiny's three tasks from 32 headless Chromium browsers (`trainfit env serve
miniwob`, bench/readme_numbers.py's cua_service, on --port, not the example's 8767) and runs the stage as
written from --sft's final model: 120 optimizer steps (30 rollouts), the held-out evaluation (150
instances, greedy) at its start and its end. `--train-sft` first writes the expert rows (when
runs/cua_tiny_data has none) and trains cua_tiny's SFT stage (seed 0) into --sft against the same service
(--steps and --eval shorten it for a rehearsal).

Both: the stage's batch (4 tasks x 8 episodes), its 3 turns, its loss, beta and 4 optimizer steps a
rollout, no checkpoint. Against MiniWoB++ the file starts with two `browsers` records: the rollout's
browser work alone (32 episodes reset and clicked to their end, no decoding), once to launch the
browsers and once timed on the warm pool. Each run is one `trainfit train` process; runs go in the
order of --modes, --reps times (`async` is rollout.max_staleness --k). `train_s` sums the steps' step_time (rollout
waits included; model loading and evaluations left out), `process_s` is the process's wall-clock;
against MiniWoB++ `loop_s` runs from the first evaluation's end to the last step's, and `success_start` /
`success` are the held-out success before and after;
`reward_first` / `reward_last` are the first and last rollouts' mean episode reward, `rewards` every
rollout's; `times` sums each `time_*_s` metric over the steps (the worker's, logged with each step of its
rollout, is `worker_rollout_s`, counted once a rollout); `load_before` / `load_after` are the
1-minute load average around the run, `cpu_busy` the share of the machine's CPU time that was busy
during it (browsers included: what a sync run leaves idle is all that overlapping can fill). `--seed`
is the runs' train.seed (0, as the stage), the rollouts' sampling seeds: another seed repeats a run
from the same SFT model.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import httpx
import yaml

from bench.readme_numbers import CUA_TASKS, cua_service
from bench.run import busy_cpu_seconds
from bench.screens_service import serve_screens

ROOT = Path(__file__).resolve().parents[1]
CUA = ROOT / "examples" / "cua_tiny.yaml"
# What each measured mode sets in `rollout:`; async-process is the worker in its own process.
MODES = {"sync": {"mode": "sync"}, "async": {"mode": "async"},
         "async-process": {"mode": "async", "worker": "process"}}
QUIET = {"save_transcripts": 0, "progress": False, "tensorboard": False, "plot": False}


def _cua_stage(name: str) -> tuple[dict, dict]:
    cua = yaml.safe_load(CUA.read_text())
    return cua, next(s for s in cua["stages"] if s["stage"] == name)


def _task(cua: dict, num_eval: int) -> dict:
    """cua_tiny's episodes with absolute paths (the runs start anywhere); no held-out rows when num_eval is 0."""
    task = {**cua["task"], "path": str(ROOT / cua["task"]["path"]), "num_eval": num_eval}
    if num_eval:
        task["eval_path"] = str(ROOT / cua["task"]["eval_path"])
    else:
        task.pop("eval_path", None)
    return task


def stage_config(url: str, steps: Optional[int], run_dir: Path, mode: str, k: int, sft: Optional[Path] = None,
                 num_eval: Optional[int] = None, seed: int = 0) -> dict:
    """cua_tiny's grpo stage against `url` in `mode` (a MODES key). From random weights without evaluation
    (`sft` None), else from `sft` (a final model dir) with the held-out evaluation at its start and end
    on `num_eval` instances (the stage's own count when None); `steps` None keeps the stage's 120. `seed` is
    train.seed (the rollouts' sampling seeds): another seed repeats a run from the same SFT model."""
    cua, grpo = _cua_stage("grpo")
    steps = steps or grpo["train"]["max_steps"]
    num_eval = 0 if sft is None else cua["task"]["num_eval"] if num_eval is None else num_eval
    train = {**cua["train"], **grpo["train"], "max_steps": steps, "eval_every": 0, "save_every": 0, "seed": seed}
    model = cua["model"] if sft is None else {**cua["model"], "name": str(sft), "init": "pretrained"}
    rollout = {**cua["rollout"], **MODES[mode]}
    if rollout["mode"] == "async":
        rollout["max_staleness"] = k
    return {"stage": "grpo", "run_dir": str(run_dir), "model": model, "task": _task(cua, num_eval),
            "env": {**cua["env"], "url": url}, "rollout": rollout, "train": train, "grpo": grpo["grpo"],
            "logging": QUIET}


def sft_config(url: str, run_dir: Path, steps: Optional[int] = None, num_eval: Optional[int] = None) -> dict:
    """cua_tiny's sft stage (seed 0; 150 steps and 150 held-out instances unless `steps` / `num_eval` say
    otherwise), evaluated against `url` at its start and end."""
    cua, sft = _cua_stage("sft")
    steps = steps or sft["train"]["max_steps"]
    data = {**sft["data"], "path": str(ROOT / sft["data"]["path"])}
    return {"stage": "sft", "run_dir": str(run_dir), "model": cua["model"],
            "task": _task(cua, cua["task"]["num_eval"] if num_eval is None else num_eval),
            "env": {**cua["env"], "url": url}, "rollout": cua["rollout"], "data": data,
            "train": {**cua["train"], **sft["train"], "max_steps": steps, "eval_every": steps, "save_every": 0},
            "logging": QUIET}


def _train(cfg: dict, run_dir: Path) -> float:
    """One `trainfit train` process of `cfg` into `run_dir`; its wall-clock in seconds. The config and the
    output go beside the run dir (`--overwrite` refuses a run dir holding files the run does not write)."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    path = run_dir.with_name(run_dir.name + ".yaml")
    path.write_text(yaml.safe_dump(cfg))
    began = time.time()
    with open(run_dir.with_name(run_dir.name + ".log"), "w") as log:
        subprocess.run([sys.executable, "-m", "trainfit.app.cli", "train", str(path), "--overwrite"], check=True,
                       stdout=log, stderr=subprocess.STDOUT)
    return time.time() - began


def summarize(rows: list[dict], cfg: dict) -> dict:
    """One run's record from its metrics.jsonl rows (`cfg` its config)."""
    train = [r for r in rows if r["kind"] == "train"]
    evals = [r for r in rows if r["kind"] == "eval"]
    n = cfg["grpo"]["num_iterations"]
    rewards = [r["reward"] for r in train[::n]]   # a rollout's reward is logged with each of its steps
    out = {"steps": len(train), "samples": len(train) // n * cfg["train"]["global_batch_size"],
           "train_s": sum(r["step_time"] for r in train), "reward_first": rewards[0], "reward_last": rewards[-1],
           "reward_mean": sum(rewards) / len(rewards), "rewards": rewards,
           "env_failed": max(r.get("env_failed", 0.0) for r in train),
           "times": {k: sum(r.get(k, 0.0) for r in train) for k in sorted({k for r in train for k in r})
                     if k.startswith("time_") and k != "time_async_rollout_s"}}   # that one: worker_rollout_s
    if evals:
        first, last = evals[0], evals[-1]
        out.update(success_start=first.get("success"), success=last.get("success"), eval_n=cfg["task"]["num_eval"],
                   # the training loop alone: from the first evaluation's row to the last step's
                   loop_s=train[-1]["time"] - first["time"])
    if cfg["rollout"]["mode"] == "async":
        out.update(staleness_mean=sum(r["staleness_mean"] for r in train) / len(train),
                   staleness_max=max(r["staleness_max"] for r in train),
                   rollout_wait_s=sum(r.get("time_rollout_wait_s", 0.0) for r in train),
                   worker_rollout_s=sum(r.get("time_async_rollout_s", 0.0) for r in train[::n]))
        stale = [r for r in train if "iw_mean" in r]
        if stale:
            out.update(iw_mean=sum(r["iw_mean"] for r in stale) / len(stale), iw_max=max(r["iw_max"] for r in stale),
                       iw_min=min(r["iw_min"] for r in stale),
                       iw_cut_frac=sum(r.get("iw_cut_frac", 0.0) for r in stale) / len(stale))
    else:
        out["rollout_s"] = sum(r.get("time_generate_s", 0.0) for r in train)
    return out


def _cpu_share(busy0: float, began: float) -> float:
    """The share of the machine's CPU time (every core, every process) that was busy since `began`, when
    `busy_cpu_seconds` was `busy0`."""
    return (busy_cpu_seconds() - busy0) / max((time.time() - began) * (os.cpu_count() or 1), 1e-9)


def one_run(cfg: dict, mode: str, rep: int) -> dict:
    """One run's record; `cpu_busy` is the fraction of the machine's CPU time that was busy during it (any
    process: a sync run's idle share is what overlapping can at most fill)."""
    run_dir = Path(cfg["run_dir"])
    load_before, busy0, began = os.getloadavg()[0], busy_cpu_seconds(), time.time()
    wall = _train(cfg, run_dir)
    cpu_busy = _cpu_share(busy0, began)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    k = cfg["rollout"].get("max_staleness")
    return {"mode": mode, "k": k if cfg["rollout"]["mode"] == "async" else None, "rep": rep,
            "seed": cfg["train"]["seed"], "process_s": wall, **summarize(rows, cfg), "load_before": load_before,
            "load_after": os.getloadavg()[0], "cpu_busy": cpu_busy}


def browsers_only(url: str) -> dict:
    """A rollout's browser work without the policy: the stage's 4 rows x 8 episodes at once, each reset and
    then clicked at (1, 1), a miss on these pages, for its max_turns turns (the service launches its
    browsers on first use, so the first call also warms the pool before the timed runs)."""
    cua, grpo = _cua_stage("grpo")
    rows = [json.loads(x) for x in (ROOT / cua["task"]["path"]).read_text().splitlines()[:grpo["train"][
        "global_batch_size"] // grpo["grpo"]["num_generations"]]]

    def episode(row: dict) -> list[float]:
        took = []
        with httpx.Client(timeout=cua["env"]["timeout_s"]) as c:
            began = time.time()
            eid = c.post(f"{url}/reset", json={"task": row}).json()["episode_id"]
            took.append(time.time() - began)
            for step in range(1, cua["rollout"]["max_turns"] + 1):
                began = time.time()
                done = c.post(f"{url}/step", json={"episode_id": eid, "step": step, "action": "click(1, 1)"}).json()["done"]
                took.append(time.time() - began)
                if done:
                    break
            c.post(f"{url}/close", json={"episode_id": eid})
        return took

    load, began, busy0 = os.getloadavg()[0], time.time(), busy_cpu_seconds()
    with ThreadPoolExecutor(grpo["train"]["global_batch_size"]) as pool:
        took = [t for ep in pool.map(episode, [r for r in rows for _ in range(grpo["grpo"]["num_generations"])])
                for t in ep]
    return {"mode": "browsers", "rollout_s": time.time() - began, "requests": len(took),
            "request_mean_s": sum(took) / len(took), "request_max_s": max(took), "load_before": load,
            "cpu_busy": _cpu_share(busy0, began)}


@contextmanager
def service(a: argparse.Namespace):
    """The environment's URL while it runs."""
    if a.service == "screens":
        server = serve_screens(160, 210, delay_s=a.delay)
        try:
            yield server.url
        finally:
            server.stop()
    else:
        with cua_service(port=a.port, tasks=CUA_TASKS):
            yield f"http://127.0.0.1:{a.port}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--service", choices=("screens", "miniwob"), default="screens")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps, 4 a rollout (screens: 16; "
                    "miniwob: the stage's 120)")
    ap.add_argument("--delay", type=float, default=0.25, help="screens: seconds the service takes over each request")
    ap.add_argument("--sft", type=Path, help="miniwob: the SFT stage's run dir; the runs start from its final/")
    ap.add_argument("--train-sft", action="store_true", help="miniwob: train cua_tiny's SFT stage into --sft, then stop")
    ap.add_argument("--eval", type=int, default=None, help="miniwob: held-out instances (the stage's 150)")
    ap.add_argument("--port", type=int, default=8779, help="miniwob: the service's port")
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=["sync", "async"],
                    help="run in this order, --reps times (a mode may repeat: sync async async sync)")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--k", type=int, default=1, help="rollout.max_staleness of the async runs")
    ap.add_argument("--seed", type=int, default=0, help="train.seed of the GRPO runs (repeats from one SFT model)")
    ap.add_argument("--label", default=None, help="written into each record as `batch`")
    ap.add_argument("--root", default="/tmp/async_env_runs")
    ap.add_argument("--out")
    a = ap.parse_args()
    if a.service == "miniwob" and a.sft is None:
        ap.error("--service miniwob needs --sft (the SFT stage's run dir)")
    if not a.train_sft and not a.out:
        ap.error("--out is required")
    results = []
    with service(a) as url:
        if a.train_sft:
            seconds = _train(sft_config(url, a.sft.resolve(), a.steps, a.eval), a.sft.resolve())
            print(f"SFT stage trained into {a.sft} in {seconds:.0f} s", flush=True)
            return
        if a.service == "miniwob":   # the first warms the pool, the second is timed on warm browsers
            results += [{**browsers_only(url), "warm": warm} for warm in (False, True)]
            print(json.dumps(results[-1]), flush=True)
        order = [m for _ in range(a.reps) for m in a.modes]
        for i, mode in enumerate(order):
            rep = order[:i].count(mode)   # --modes sync async async sync: each mode's runs numbered apart
            run_dir = Path(a.root) / f"{mode}{a.k if mode != 'sync' else ''}-s{a.seed}-{rep}"
            sft = None if a.service == "screens" else a.sft.resolve() / "final"
            cfg = stage_config(url, a.steps, run_dir, mode, a.k, sft=sft, num_eval=a.eval, seed=a.seed)
            r = {**({"batch": a.label} if a.label else {}), **one_run(cfg, mode, rep), "service": a.service,
                 **({"delay_s": a.delay} if a.service == "screens" else {"sft": str(a.sft)})}
            print(json.dumps(r), flush=True)
            results.append(r)
            # each finished run is kept, so a cut series still leaves its records
            Path(a.out).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
