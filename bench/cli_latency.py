"""How long the command line takes to answer: plain errors, and a warm `trainfit plan` of every example.

    .venv/bin/python -m bench.cli_latency [--repeat 3] [--cache DIR] [--out bench/results/cli_latency.json]

Each timing is a fresh Python process running the whole command, imports included, as a user would
(`python -m trainfit.app.cli ...`, wrapped so that it also reports, at exit, which of torch,
transformers and peft it imported). Cases:
- errors that need no model, each exit 2 with one paragraph: a config error (an unknown key), a
  missing data file (`train --dry-run`, the door that always refuses it), an unknown model directory
  (told from the filesystem), an unknown hub id with hub lookups off (told from the local cache), and
  an unknown --gpu;
- a warm `plan` of every examples/*.yaml as written (run once to fill the planner cache, then the
  median of --repeat runs), and the Llama-3.1-70B GRPO LoRA plan of bench/plan_speed.py (README).
The planner cache is a fresh folder unless --cache names one, so "warm" means "after one plan here".
Python's bytecode cache is on for the commands (PYTHONDONTWRITEBYTECODE removed), as an installed
package has it. The 1-minute load average is recorded before and after every case: on a shared
machine the numbers are only comparable at a similar load. Goals (issue 46): errors < 1 s, warm
plans <= 2 s, no torch / transformers / peft in either.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from bench.plan_speed import CONFIG as LLAMA70B_CONFIG
from bench.run import _children_cpu, loadavg, versions

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "peft")
MARK = "cli-latency modules:"
# `python -m trainfit.app.cli ARGS`, then (however it exits) the heavy modules it imported, on stderr.
_PROBE = ("import json, runpy, sys\n"
          "sys.argv = ['trainfit', *sys.argv[1:]]\n"
          "try:\n"
          "    runpy.run_module('trainfit.app.cli', run_name='__main__', alter_sys=True)\n"
          "finally:\n"
          f"    sys.stderr.write('\\n{MARK} ' + json.dumps([m for m in {HEAVY!r} if m in sys.modules]) + '\\n')\n")
ERROR_GOAL_S, PLAN_GOAL_S = 1.0, 2.0


def cli_env(cache: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return {**env, "TRAINFIT_CACHE": str(cache), **extra}


def run_cli(args: list[str], env: dict, timeout: float = 900) -> dict:
    """One `trainfit ARGS` in a fresh process: exit code, wall seconds, CPU seconds (user + system: what
    the wall time would be on an idle core, give or take the disk), the heavy modules it imported (None
    when it died before saying), and its stderr."""
    cpu0, t = _children_cpu(), time.perf_counter()
    p = subprocess.run([sys.executable, "-c", _PROBE, *args], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=timeout)
    seconds, cpu = time.perf_counter() - t, _children_cpu() - cpu0
    lines = p.stderr.splitlines()
    said = [json.loads(line[len(MARK):]) for line in lines if line.startswith(MARK)]
    rest = [line for line in lines if line.strip() and not line.startswith(MARK)]
    return {"rc": p.returncode, "seconds": round(seconds, 3), "cpu_s": round(cpu, 3), "heavy_imported": said[-1] if said else None,
            "stderr": "\n".join(rest)}


def timed(args: list[str], env: dict, repeat: int, warm_up: bool) -> dict:
    """Median of `repeat` runs (after one untimed run when `warm_up`), with the load around them."""
    before = loadavg()
    if warm_up:
        run_cli(args, env)
    runs = [run_cli(args, env) for _ in range(repeat)]
    secs = [r["seconds"] for r in runs]
    return {"args": args, "rc": runs[-1]["rc"], "median_s": round(statistics.median(secs), 3), "runs_s": secs,
            "median_cpu_s": round(statistics.median(r["cpu_s"] for r in runs), 3),
            "heavy_imported": sorted({m for r in runs for m in (r["heavy_imported"] or [])}),
            "reported": all(r["heavy_imported"] is not None for r in runs), "loadavg_before": before,
            "loadavg_after": loadavg(), "stderr_tail": runs[-1]["stderr"][-300:]}


def error_cases(work: Path) -> dict[str, tuple[list[str], dict]]:
    """name -> (trainfit arguments, extra environment); each is a user mistake that exits 2."""
    return {
        "config_error": (["plan", "examples/demo.yaml", "train.lr_typo=1"], {}),
        "missing_data_file": (["train", "examples/sft_chat.yaml", f"data.path={work / 'missing.jsonl'}",
                               f"run_dir={work / 'run'}", "--dry-run"], {}),
        "unknown_model_dir": (["plan", "examples/sft_chat.yaml", "model.name=./no-such-model-dir"], {}),
        "unknown_model_id": (["plan", "examples/sft_chat.yaml", "model.name=no-such-org/no-such-model"],
                             {"HF_HUB_OFFLINE": "1"}),
        "unknown_gpu": (["plan", "examples/demo.yaml", "--gpu", "no-such-gpu"], {}),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cache", help="planner cache to use (default: a fresh folder, filled by each first run)")
    ap.add_argument("--examples", nargs="*", help="only these examples/*.yaml (names without .yaml)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cli_latency.json"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="trainfit-cli-latency-"))
    cache = Path(args.cache) if args.cache else work / "cache"
    env = cli_env(cache)
    out: dict = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cores": os.cpu_count(),
                 "cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
                 "versions": versions(), "repeat": args.repeat, "planner_cache": args.cache or "fresh (filled by each first run)", "hub_offline_env": os.environ.get("HF_HUB_OFFLINE"),
                 "goals_s": {"errors": ERROR_GOAL_S, "warm_plan": PLAN_GOAL_S},
                 "loadavg_start": loadavg(), "errors": {}, "warm_plans": {}}
    for name, (cli_args, extra) in error_cases(work).items():
        # The first run compiles trainfit's bytecode (a fresh clone's first command); timed ones after it.
        out["errors"][name] = timed(cli_args, cli_env(cache, **extra), args.repeat, warm_up=True)
        print(f"{name:24s} rc {out['errors'][name]['rc']}  {out['errors'][name]['median_s']:.2f} s  "
              f"heavy {out['errors'][name]['heavy_imported']}  load {loadavg()[0]:.1f}", flush=True)
    examples = sorted(ROOT.glob("examples/*.yaml"))
    if args.examples:
        examples = [e for e in examples if e.stem in args.examples]
    llama = work / "llama70b_grpo_lora.yaml"
    llama.write_text(LLAMA70B_CONFIG)
    plans = {e.stem: ["plan", str(e.relative_to(ROOT))] for e in examples}
    plans["llama70b_grpo_lora (bench/plan_speed.py)"] = ["plan", str(llama), "--gpu", "h100", "--json"]
    for name, cli_args in plans.items():
        out["warm_plans"][name] = timed(cli_args, env, args.repeat, warm_up=True)
        r = out["warm_plans"][name]
        print(f"{name:40s} rc {r['rc']}  {r['median_s']:.2f} s  heavy {r['heavy_imported']}  "
              f"load {r['loadavg_after'][0]:.1f}", flush=True)
    out["loadavg_end"] = loadavg()
    errs = [r["median_s"] for r in out["errors"].values()]
    warm = [r["median_s"] for r in out["warm_plans"].values()]
    out["summary"] = {
        "errors_max_s": max(errs), "warm_plan_max_s": max(warm), "warm_plan_median_s": statistics.median(warm),
        "slowest_warm_plan": max(out["warm_plans"], key=lambda k: out["warm_plans"][k]["median_s"]),
        "heavy_imported_anywhere": sorted({m for r in [*out["errors"].values(), *out["warm_plans"].values()]
                                           for m in r["heavy_imported"]}),
        "goals_met": max(errs) < ERROR_GOAL_S and max(warm) <= PLAN_GOAL_S,
        "load_note": "1-minute load average before/after each case; above the 2 cores the numbers are slower "
                     "than on a quiet machine"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out["summary"], indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
