"""The README's measured tables, regenerated from runs of the current code (`make readme-numbers`).

    .venv/bin/python -m bench.readme_numbers                    # demo + PPO pipeline, seeds 0 1 2 (~1-2 h)
    .venv/bin/python -m bench.readme_numbers --configs demo --seeds 0    # one demo run (~6 min on 2 idle cores)
    .venv/bin/python -m bench.readme_numbers --reuse            # rewrite the README from the recorded runs
    .venv/bin/python -m bench.readme_numbers --configs cua_tiny  # the computer-use twin (needs Chromium)
    .venv/bin/python -m bench.readme_numbers --configs demo --kernels default avx2 avx512  # 3 seeds x 3 kernels

Each (config, seed triple) trains `examples/<config>.yaml` whole, one run after another, into
runs/readme-numbers/<config>-s<train.seed> (its output in <config>-s<train.seed>.log beside it), and
records its held-out accuracies (the run's summary.json), wall time, library versions, CPU and thread
count in bench/results/readme_numbers/<config>-s<train.seed>.json. `--kernels` runs every seed triple
once per CPU instruction set torch is told to use (`ATEN_CPU_CAPABILITY`: default, avx2, avx512; a CPU
without the one asked for gets the best it has below it), recorded as <config>-s<train.seed>-<kernel>.json:
kernels round differently, which steers a run, and the table shows how far apart the runs land. The README's sections between
`<!-- readme-numbers:<config> -->` and `<!-- /readme-numbers:<config> -->` are then rewritten from
those records. `--reuse` takes a record instead of running when one exists, so a long set can be run
seed by seed and the README written once at the end, or rewritten from the committed records.

`cua_tiny` (not in the default set: it needs the OS's Chromium and chromedriver and the miniwob extra)
runs the example's first two commands itself: it writes the expert rows when runs/cua_tiny_data has
none, and serves the MiniWoB++ tasks on the example's port while its seeds train.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager, nullcontext
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
# train.seed -> (train.seed, task.seed, model.seed): the README's three triples, the first the default.
TRIPLES = {0: (0, 1234, 0), 1: (1, 99, 5), 2: (2, 7, 3)}
CONFIGS = {"demo": "examples/demo.yaml", "ppo_pipeline_tiny": "examples/ppo_pipeline_tiny.yaml",
           "cua_tiny": "examples/cua_tiny.yaml", "agent_tools": "examples/agent_tools.yaml"}
DEFAULT_CONFIGS = ["demo", "ppo_pipeline_tiny"]
# examples/cua_tiny.yaml's first two commands (its header): expert rows, then the service on its env.url.
CUA_TASKS = "click-test,focus-text,click-dialog"
CUA_EXPERT = ["env", "expert", "miniwob", "--tasks", CUA_TASKS, "--seeds", "0-127", "--out", "runs/cua_tiny_data"]
# Never trained on: each trained task's sibling, which asks for the same kind of click but names its target
# in text the model would have to read (click-test-2: one of two buttons; focus-text-2: one of three
# boxes; click-dialog-2: one of a dialog's buttons). Played greedily after the run, 30 instances each.
CUA_UNSEEN = "click-test-2,focus-text-2,click-dialog-2"
CUA_UNSEEN_EPISODES = 90
CUA_PORT = 8767   # examples/cua_tiny.yaml's env.url
THREADS_LINE = re.compile(r"CPU threads: (\d+)")
# ATEN_CPU_CAPABILITY values torch's x86 CPU kernels honour (its dispatch levels, lowest first).
KERNELS = ("default", "avx2", "avx512")


def _pct(x: Optional[float]) -> str:
    return "" if x is None else f"{100 * x:.1f}%"


def _points(after: Optional[float], before: Optional[float]) -> str:
    return "" if after is None or before is None else f"{100 * (after - before):+.1f}"


def _triple(rec: dict) -> str:
    """`0 1234 0 (the default)`, and the CPU kernel the run used when the record names one."""
    seed, kernel, used = rec["seed"], rec["env"].get("kernel"), rec["env"].get("kernel_used")
    ran = f" (ran {used})" if kernel and used and used.lower() != kernel else ""
    return (" ".join(map(str, TRIPLES[seed])) + (" (the default)" if seed == 0 else "")
            + (f", {kernel}{ran}" if kernel else ""))


def _stage_seconds(summary: dict) -> str:
    return ", ".join(f"{s['stage']} {s['seconds']:.0f}" for s in summary["stages"])


def _time_and_memory(rec: dict) -> str:
    """`351 s (sft 81, grpo 260), 0.54 GiB`: wall time, each stage's seconds, the largest stage peak RSS."""
    peaks = [(s.get("memory") or {}).get("process_peak_rss_gib") for s in rec["summary"]["stages"]]
    peaks = [p for p in peaks if p is not None]
    return f"{rec['wall_s']:.0f} s ({_stage_seconds(rec['summary'])})" + (f", {max(peaks):.2f} GiB" if peaks else "")


def demo_row(rec: dict) -> list[str]:
    acc = rec["summary"]["accuracy"]
    return [_triple(rec), _pct(acc.get("before sft")), _pct(acc.get("after sft")),
            _pct(acc.get("after grpo")), _points(acc.get("after grpo"), acc.get("after sft")), _time_and_memory(rec)]


def ppo_row(rec: dict) -> list[str]:
    s = rec["summary"]
    acc = s["accuracy"]
    rm = next((st["accuracy_after"] for st in s["stages"] if st["stage"] == "rm"), None)
    return [_triple(rec), _pct(acc.get("before sft")), _pct(acc.get("after sft")),
            _pct(rm), _pct(acc.get("after ppo")), _points(acc.get("after ppo"), acc.get("after sft")),
            _time_and_memory(rec)]


def cua_row(rec: dict) -> list[str]:
    acc = rec["summary"]["accuracy"]
    unseen = rec.get("unseen_tasks")
    return [_triple(rec), _pct(acc.get("before sft")), _pct(acc.get("after sft")),
            _pct(acc.get("after grpo")), _points(acc.get("after grpo"), acc.get("after sft")),
            _pct(unseen["success"]) if unseen else "-", _time_and_memory(rec)]


HEADERS = {
    "demo": (["`train.seed task.seed model.seed`", "before SFT", "after SFT", "after GRPO", "GRPO adds",
              "wall time (per stage, s), peak memory"], demo_row),
    "ppo_pipeline_tiny": (["`train.seed task.seed model.seed`", "before SFT", "after SFT", "RM pair accuracy",
                           "after PPO", "PPO adds", "wall time (per stage, s), peak memory"], ppo_row),
    "agent_tools": (["`train.seed task.seed model.seed`", "before SFT", "after SFT", "after GRPO", "GRPO adds",
                     "wall time (per stage, s), peak memory"], demo_row),
    "cua_tiny": (["`train.seed task.seed model.seed`", "before SFT", "after SFT", "after GRPO", "GRPO adds",
                  f"unseen tasks after GRPO ({CUA_UNSEEN_EPISODES} instances)",
                  "wall time (per stage, s), peak memory"], cua_row),
}


@contextmanager
def cua_service(timeout: float = 120.0, port: int = CUA_PORT, tasks: str = f"{CUA_TASKS},{CUA_UNSEEN}"):
    """The MiniWoB++ service examples/cua_tiny.yaml trains against (`tasks` on 127.0.0.1:`port`, 32
    browsers), with its expert rows written first."""
    cli = [sys.executable, "-m", "trainfit.app.cli"]
    if not (ROOT / "runs" / "cua_tiny_data" / "rows.jsonl").is_file():
        subprocess.run(cli + CUA_EXPERT, cwd=ROOT, check=True)
    serve = ["env", "serve", "miniwob", "--tasks", tasks, "--port", str(port), "--pool", "32"]
    proc = subprocess.Popen(cli + serve, cwd=ROOT)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"{' '.join(serve)} did not start (exit {proc.poll()})")
                time.sleep(1)
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def cua_unseen(model: Path) -> dict:
    """Greedy success of the run's final policy on CUA_UNSEEN's tasks (bench/cua_eval.py, on the service
    cua_service started), overall and per task."""
    out = subprocess.run([sys.executable, "-m", "bench.cua_eval", str(model), "--episodes", str(CUA_UNSEEN_EPISODES),
                          "--tasks", CUA_UNSEEN], cwd=ROOT, capture_output=True, text=True, check=True)
    return {"tasks": CUA_UNSEEN.split(","), **parse_cua_eval(out.stdout)}


def parse_cua_eval(stdout: str) -> dict:
    """bench/cua_eval.py's greedy line as numbers: overall success, instances, and success per task."""
    line = next(x for x in stdout.splitlines() if x.startswith("greedy:"))
    total = re.search(r"success ([0-9.]+) \(n=(\d+)\)", line)
    return {"success": float(total.group(1)), "n": int(total.group(2)),
            "per_task": {t: float(v) for t, v in re.findall(r"([a-z0-9-]+) ([0-9.]+) \(t1", line)}}


SERVICES = {"cua_tiny": cua_service}
# What is measured after a config's run, from its final model, into the record under the given key.
AFTER_RUN = {"cua_tiny": ("unseen_tasks", cua_unseen)}


def _machine_line(records: list[dict]) -> str:
    """Where the numbers came from, said once: the same for every record, else each value listed."""
    def one(key: str) -> str:
        vals = sorted({str(r["env"][key]) for r in records})
        return " / ".join(vals)

    loads = [r["env"]["load_before"] for r in records]
    return (f"Generated by `make readme-numbers` (`bench/readme_numbers.py`) on {one('date')}: {one('cpu')}, "
            f"{one('cores')} cores available, "
            + (f"CPU kernels (ATEN_CPU_CAPABILITY) {', '.join(sorted({r['env']['kernel'] for r in records}, key=KERNELS.index))}, "
               if all(r["env"].get("kernel") in KERNELS for r in records) else "")
            + f"{one('threads')} torch thread{'' if one('threads') == '1' else 's'} per "
            f"run, torch {one('torch')}, "
            f"transformers {one('transformers')}, Python {one('python')}; 1-minute load average "
            f"{min(loads):.1f}-{max(loads):.1f} as the runs started (the machine is shared and seed triples may run "
            "side by side, so wall times are upper bounds; accuracies do not depend on load).")


def render(config: str, records: list[dict]) -> str:
    """The README section for `config`: the table of its records (sorted by seed) and where they came from."""
    header, row = HEADERS[config]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    for rec in sorted(records, key=_order):
        lines.append("| " + " | ".join(row(rec)) + " |")
    spread = _spread_line(records)
    return "\n".join(lines) + "\n\n" + (spread + "\n\n" if spread else "") + _machine_line(records)


def _order(rec: dict) -> tuple:
    kernel = rec["env"].get("kernel")
    return rec["seed"], KERNELS.index(kernel) if kernel in KERNELS else -1


def _spread_line(records: list[dict]) -> str:
    """How far apart the runs land: the range of each held-out accuracy after a stage, in points, and its
    mean with the standard error of that mean over the runs."""
    if len(records) < 2:
        return ""
    parts = []
    for key in records[0]["summary"]["accuracy"]:
        vals = [r["summary"]["accuracy"].get(key) for r in records]
        if key == "before sft" or None in vals:
            continue
        lo, hi = 100 * min(vals), 100 * max(vals)
        mean = 100 * statistics.fmean(vals)
        sem = 100 * statistics.stdev(vals) / len(vals) ** 0.5
        parts.append(f"{key} {lo:.1f}-{hi:.1f}% ({hi - lo:.1f} points apart; mean {mean:.1f}% +- {sem:.1f}, "
                     "the standard error of the mean)")
    return f"Across these {len(records)} runs: " + "; ".join(parts) + "." if parts else ""


def replace_section(text: str, name: str, body: str) -> str:
    """`text` with what lies between `<!-- readme-numbers:name -->` and `<!-- /readme-numbers:name -->` replaced."""
    start, end = f"<!-- readme-numbers:{name} -->", f"<!-- /readme-numbers:{name} -->"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if len(pattern.findall(text)) != 1:
        raise ValueError(f"the README needs exactly one {start} ... {end} pair")
    return pattern.sub(lambda _: f"{start}\n{body}\n{end}", text)


def environment(threads: str) -> dict:
    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        model = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        cpu = model.group(1).strip() if model else cpu
    except OSError:
        pass
    return {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d"), "cpu": f"{cpu} ({torch.backends.cpu.get_cpu_capability()})",
            "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "threads": threads, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "load_before": os.getloadavg()[0]}


def record_name(config: str, seed: int, kernel: Optional[str]) -> str:
    return f"{config}-s{seed}" + (f"-{kernel}" if kernel else "")


def kernel_used(env: dict) -> str:
    """The CPU capability torch dispatches to under `env` (DEFAULT, AVX2, AVX512...)."""
    out = subprocess.run([sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                         env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


def run_one(config: str, seed: int, runs: Path, records: Path, timeout: int, kernel: Optional[str] = None) -> dict:
    """Train `config` for one seed triple (under CPU kernel `kernel` when given); the record of the run
    (also written beside its run dir)."""
    t, k, m = TRIPLES[seed]
    name = record_name(config, seed, kernel)
    run_dir = runs / name
    shown = run_dir.relative_to(ROOT) if run_dir.is_relative_to(ROOT) else run_dir  # the command runs in ROOT
    cmd = [sys.executable, "-m", "trainfit.app.cli", "train", CONFIGS[config], f"train.seed={t}", f"task.seed={k}",
           f"model.seed={m}", f"run_dir={shown}", "--overwrite"]
    child_env = {**os.environ, "ATEN_CPU_CAPABILITY": kernel} if kernel else None
    load_before = os.getloadavg()[0]
    began = time.monotonic()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=child_env)
    wall = time.monotonic() - began
    (runs / f"{name}.log").write_text(out.stdout + out.stderr)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {out.returncode}; see {runs / f'{name}.log'}")
    threads = THREADS_LINE.search(out.stdout)
    env = environment(threads.group(1) if threads else os.environ.get("OMP_NUM_THREADS", "default"))
    env["load_before"] = load_before
    if kernel:
        env["kernel"], env["kernel_used"] = kernel, kernel_used(child_env)
    rec = {"config": config, "seed": seed, "command": (f"ATEN_CPU_CAPABILITY={kernel} " if kernel else "") + " ".join(cmd),
           "wall_s": wall, "env": env, "summary": json.loads((run_dir / "summary.json").read_text())}
    if config in AFTER_RUN:
        key, measure = AFTER_RUN[config]
        rec[key] = measure(ROOT / rec["summary"]["stages"][-1]["output"])
    (records / f"{name}.json").write_text(json.dumps(rec, indent=2) + "\n")
    return rec


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=DEFAULT_CONFIGS)
    ap.add_argument("--seeds", nargs="+", type=int, choices=sorted(TRIPLES), default=sorted(TRIPLES),
                    help="train.seed of each triple to run (0 = the default 0 1234 0)")
    ap.add_argument("--kernels", nargs="+", choices=KERNELS, default=None,
                    help="run each seed triple once per CPU kernel (ATEN_CPU_CAPABILITY); default: the CPU's best")
    ap.add_argument("--runs", type=Path, default=ROOT / "runs" / "readme-numbers")
    ap.add_argument("--records", type=Path, default=ROOT / "bench" / "results" / "readme_numbers")
    ap.add_argument("--reuse", action="store_true", help="use a recorded run instead of training it again")
    ap.add_argument("--readme", type=Path, default=ROOT / "README.md")
    ap.add_argument("--no-write", action="store_true", help="print the sections, leave the README as it is")
    ap.add_argument("--timeout", type=int, default=3 * 3600, help="seconds one run may take")
    args = ap.parse_args(argv)
    args.runs.mkdir(parents=True, exist_ok=True)
    args.records.mkdir(parents=True, exist_ok=True)
    text = args.readme.read_text()
    for config in args.configs:  # before hours of training, not after
        replace_section(text, config, "")
    for config in args.configs:
        records = []
        runs = [(s, k) for s in args.seeds for k in (args.kernels or [None])]
        todo = [r for r in runs if not (args.reuse and (args.records / f"{record_name(config, *r)}.json").is_file())]
        with SERVICES.get(config, nullcontext)() if todo else nullcontext():
            for seed, kernel in runs:
                if (seed, kernel) in todo:
                    print(f"training {config} seed {TRIPLES[seed]}" + (f" kernel {kernel}" if kernel else "") + " ...",
                          flush=True)
                    records.append(run_one(config, seed, args.runs, args.records, args.timeout, kernel))
                else:
                    records.append(json.loads((args.records / f"{record_name(config, seed, kernel)}.json").read_text()))
                print(" | ".join(HEADERS[config][1](records[-1])), flush=True)
        body = render(config, records)
        print(body)
        text = replace_section(text, config, body)
    if not args.no_write:
        args.readme.write_text(text)
        print(f"rewrote {args.readme}")


if __name__ == "__main__":
    main()
