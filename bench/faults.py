"""Fault-injection harness: kill every stage's training at random moments, resume it, and compare the result
with the uninterrupted run.

    python -m bench.faults [--stages sft,dpo,...] [--kills 10] [--signals 2] [--seed 0] [--quick]
                           [--out bench/results/faults.json]
    python -m bench.faults --table bench/results/faults.json     # the README / BENCHMARKS table, in markdown

Per stage (bench/faults_stages.py: tiny CPU runs of sft, streamed pretraining, rm, dpo, sync and async
grpo, ppo and agent grpo against an HTTP environment), the uninterrupted run goes first and its wall time
T is measured. Then, per fault kind:
- kill: `--kills` SIGKILLs (to the run's process group) at moments drawn uniformly over [0, T) from a
  generator seeded by (--seed, stage, kind), so they land in any phase: startup, rollout, scoring, the
  async worker's weight push, the metrics or a checkpoint being written, evaluation, the final save;
- term, int: `--signals` SIGTERMs / SIGINTs at drawn moments: the run must checkpoint the step reached,
  say how to continue, and exit 143 / 130.
Each signal goes to the run's process (as `kill -9 <pid>` or the out-of-memory killer sends it) and is
followed by `trainfit train <config> --resume-or-start` (faults_runner.faulted_run: what a requeued job
runs, since a kill before the first checkpoint leaves nothing for --resume), and the run goes on being
signalled and resumed until it finishes. Every finished run is compared with the uninterrupted one
(faults_compare): final weights byte for byte, metrics rows (each train and eval row once, the values
equal, timings aside), finite weights. A stage that is not required to repeat bit for bit says why and what
is compared instead (its `consistent` count). Also counted: processes of a run alive 60 s after it ended
(`orphans`), signals that came before any handler was installed (`early`), exits other than the signal's
(`bad_exit`). Results: machine, date, commit, per stage and kind the faults injected, runs recovered and
equal, data lost, seed, where the signals landed, the command that reproduces the row, wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from bench.faults_compare import compare_metrics, compare_weights, verdict
from bench.faults_runner import draw_moments, faulted_run, preload, run_process
from bench.faults_stages import STAGES, overrides_for, write_config
from bench.run import loadavg, machine, versions

ROOT = Path(__file__).resolve().parents[1]
KINDS = {"kill": signal.SIGKILL, "term": signal.SIGTERM, "int": signal.SIGINT}
# How a process signalled before its handler ends (faults_runner._stopped_early).
EARLY = {"term": "as SIGTERM's default does (killed, -15)",
         "int": "with a KeyboardInterrupt traceback from the command-line library (exit 1)"}
# Metrics of the async stage that must still match: the policy version a step trained on and its staleness.
ASYNC_KEYS = ("policy_version", "staleness_max")


def reproduce(stage: str, kind: str, n: int, seed: int) -> str:
    count = f"--kills {n}" if kind == "kill" else f"--signals {n}"
    return f"python -m bench.faults --stages {stage} --kinds {kind} {count} --seed {seed}"


def start_env_service(logs: Path) -> tuple[subprocess.Popen, str]:
    """bench/faults_env.py in a process of its own (it outlives every killed run); its URL."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "bench.faults_env"], stdout=subprocess.PIPE,
                            stderr=open(logs / "env-service.log", "w"), text=True, env=env, cwd=ROOT)
    return proc, proc.stdout.readline().strip()


def compare(ref: Path, got: Path, deterministic: bool) -> dict:
    weights, metrics = compare_weights(ref, got), compare_metrics(ref, got)
    v = verdict(weights, metrics, () if deterministic else ASYNC_KEYS)
    return {**v, "tensors": weights["tensors"], "steps": metrics["steps"],
            "weights_differing": weights["differing"][:5], "non_finite": weights["non_finite"][:5],
            "metrics_differing": metrics["differing"][:8], "rows_missing": metrics["missing"][:8],
            "rows_duplicated": metrics["duplicated"][:8], "unreadable_rows": metrics["unreadable"]}


def trimmed(chain: dict) -> dict:
    """The chain with each process's output tail kept only where it explains something (an exit other than the
    signal's, or a signal before the handler): the JSON stays small."""
    for p in chain["processes"]:
        if p.get("expected_rc", True) and not p.get("early") and (p["rc"] == 0 or p["sent"]):
            p.pop("tail", None)
    return chain


def landed(runs: list[dict]) -> dict:
    """Where the signals landed, from the run dir each left: before the first checkpoint, with a checkpoint
    half-written, after the final model was written, or in between (steps, rollouts, evaluations, metrics)."""
    out = {"before first checkpoint": 0, "checkpoint half-written": 0, "after final model": 0, "mid-run": 0}
    for p in (p for r in runs for p in r["processes"] if p["sent"]):
        s = p["state"]
        key = ("checkpoint half-written" if s["half_written"] else "after final model" if s["final"] else
               "before first checkpoint" if s["latest"] is None else "mid-run")
        out[key] += 1
    return out


def run_kind(name: str, kind: str, n: int, seed: int, work: Path, ref: Path, wall_s: float, env_url: str) -> dict:
    """`n` signals of one kind into runs of stage `name`, as many runs as it takes; the row of the results."""
    stage, t0 = STAGES[name], time.monotonic()
    moments = iter(draw_moments(seed, name, kind, 6 * n + 20, wall_s))
    runs, left = [], n
    while left > 0 and len(runs) < 3 * n:
        run_dir = work / name / f"{kind}-{len(runs)}"
        config = write_config(overrides_for(stage, work, run_dir, env_url), work / name / f"{kind}-{len(runs)}.yaml")
        chain = faulted_run(config, run_dir, KINDS[kind], moments, left, work / "logs")
        left -= chain["signals"]
        if chain["recovered"]:
            chain["compared"] = compare(ref, run_dir, stage.deterministic)
        runs.append(trimmed(chain))
        shutil.rmtree(run_dir, ignore_errors=True)
    hit = [r for r in runs if r["signals"]]
    row = {"stage": name, "kind": kind, "seed": seed, "faults": sum(r["signals"] for r in runs), "runs": len(hit),
           "recovered": sum(r["recovered"] for r in hit),
           "equal": sum(r.get("compared", {}).get("equal", False) for r in hit),
           "consistent": sum(r.get("compared", {}).get("consistent", False) for r in hit),
           "lost": sum(r.get("compared", {}).get("lost", 0) for r in hit),
           "bad_exit": sum(not p.get("expected_rc", True) for r in runs for p in r["processes"]),
           "early": sum(p.get("early", False) for r in runs for p in r["processes"]),
           "orphans": sum(p["orphans"] for r in runs for p in r["processes"]),
           "outlived_s": max((p["outlived_s"] for r in runs for p in r["processes"]), default=0.0),
           "landed": landed(runs),
           "deterministic": stage.deterministic, "compared": stage.compared, "why_not_exact": stage.why_not_exact,
           "command": reproduce(name, kind, n, seed), "wall_s": round(time.monotonic() - t0, 1), "chains": runs}
    return row


def run_stage(name: str, kinds: dict, seed: int, work: Path, env_url: str) -> list[dict]:
    stage = STAGES[name]
    (work / name).mkdir(parents=True, exist_ok=True)
    ref = work / name / "ref"
    config = write_config(overrides_for(stage, work, ref, env_url), work / name / "ref.yaml")
    modules = work / "logs" / f"{name}-modules.txt"
    p = run_process(["train", str(config)], work / "logs" / f"{name}-ref.log", modules_out=modules)
    if p.rc != 0:
        raise SystemExit(f"{name}: the uninterrupted run failed (exit {p.rc}):\n{p.tail}")
    preload(modules)
    print(f"{name}: uninterrupted run {p.wall_s:.1f} s", flush=True)
    rows = []
    for kind, n in kinds.items():
        row = run_kind(name, kind, min(n, stage.most_signals or n), seed, work, ref, p.wall_s, env_url)
        row["asked"], row["fewer"] = n, stage.why_fewer if stage.most_signals and n > stage.most_signals else ""
        row["reference_wall_s"] = p.wall_s
        rows.append(row)
        print(f"{name} {kind}: {row['faults']} faults, {row['recovered']}/{row['runs']} recovered, {row['equal']} "
              f"equal, {row['consistent']} consistent, {row['lost']} lost, {row['bad_exit']} bad exits, "
              f"{row['orphans']} orphans "
              f"({row['wall_s']:.0f} s)", flush=True)
    return rows


def render_table(results: dict) -> str:
    """The reliability table (markdown) of a results JSON: one row per stage and fault kind, then notes on the
    stages compared otherwise than bit for bit, on those signalled fewer times, and on signals that came
    before any handler or left a process running."""
    lines = ["| Stage | Fault | Injected | Runs recovered | Equal to uninterrupted | Data lost | Reproduce |",
             "|---|---|---:|---:|---:|---:|---|"]
    notes = []
    for r in results["rows"]:
        equal = f"{r['equal']}/{r['runs']}"
        if not r["deterministic"]:
            equal += f" bit for bit; {r['consistent']}/{r['runs']} consistent (*)"
        lines.append(f"| {r['stage']} | {r['kind']} | {r['faults']} | {r['recovered']}/{r['runs']} | {equal} | "
                     f"{r['lost']} | `{r['command']}` |")
        if r.get("early"):
            notes.append(f"{r['stage']} {r['kind']}: {r['early']} of the {r['faults']} signals came in a process's "
                         "first instants, before it installed its handler: it ended " + EARLY[r["kind"]] + ", with "
                         "nothing of its own to save, and the next start went on.")
        if r.get("orphans"):
            notes.append(f"{r['stage']} {r['kind']}: {r['orphans']} processes of the run were still alive 60 s "
                         "after it ended.")
    fewer = {r["stage"]: r for r in results["rows"] if r.get("fewer")}
    for r in {r["stage"]: r for r in results["rows"]}.values():
        if not r["deterministic"]:
            notes.append(f"(*) {r['stage']}: {r['why_not_exact']}; compared: {r['compared']}.")
        r = fewer.get(r["stage"], r)
        if r.get("fewer"):
            notes.append(f"{r['stage']}: fewer signals than the other stages (the command of each row says how "
                         f"many): {r['fewer']}.")
    return "\n".join(lines + ([""] + [f"- {n}" for n in notes] if notes else [])) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of: {', '.join(STAGES)}")
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated, of: kill, term, int")
    ap.add_argument("--kills", type=int, default=10, help="SIGKILLs per stage")
    ap.add_argument("--signals", type=int, default=2, help="SIGTERMs and SIGINTs per stage, each")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="one signal of each kind per stage")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "faults.json"))
    ap.add_argument("--work", default=None, help="where the runs go (a temporary folder by default)")
    ap.add_argument("--table", default=None, help="print the markdown table of this results JSON and exit")
    a = ap.parse_args(argv)
    if a.table:
        print(render_table(json.loads(Path(a.table).read_text())), end="")
        return 0
    stages = [s.strip() for s in a.stages.split(",") if s.strip()]
    unknown = [s for s in stages if s not in STAGES] + [k for k in a.kinds.split(",") if k not in KINDS]
    if unknown:
        ap.error(f"unknown stage or kind: {', '.join(unknown)}; stages: {', '.join(STAGES)}; kinds: kill, term, int")
    counts = {"kill": 1 if a.quick else a.kills, "term": 1 if a.quick else a.signals,
              "int": 1 if a.quick else a.signals}
    kinds = {k: counts[k] for k in a.kinds.split(",")}
    work = Path(a.work or tempfile.mkdtemp(prefix="trainfit-faults-"))
    (work / "logs").mkdir(parents=True, exist_ok=True)
    # The runs are forked from this process: their imports are paid once here, not per run.
    import torch  # noqa: F401
    import trainfit.app.cli  # noqa: F401
    import trainfit.train.run  # noqa: F401

    started, load0, t0 = datetime.now(timezone.utc).isoformat(timespec="seconds"), loadavg(), time.monotonic()
    env = start_env_service(work / "logs") if any(STAGES[s].needs_env for s in stages) else None
    rows = []
    try:
        for name in stages:
            rows += run_stage(name, kinds, a.seed, work, env[1] if env else "")
    finally:
        if env:
            env[0].terminate()
            env[0].wait()
    results = {"date": started, "machine": machine(), "versions": versions(), "load_before": load0,
               "load_after": loadavg(), "wall_s": round(time.monotonic() - t0, 1), "seed": a.seed,
               "argv": ["python", "-m", "bench.faults", *(argv if argv is not None else sys.argv[1:])],
               "work": str(work), "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=1) + "\n")
    print(render_table(results), end="")
    clean = all(r["recovered"] == r["runs"] and not (r["lost"] or r["bad_exit"] or r["orphans"]) for r in rows)
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
