"""The steps of bench/gpu_check.py: what each runs, its time limits, and its rows of the summary table.

Every step runs its work in child processes (ctx.run: own process group, killed at the limit) and
reads what they wrote, so a CUDA error or a hang costs that step only. A row is one line of the
table: check, goal, measured, result (pass / fail / not-run / rehearsal / info).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

PY = sys.executable
# The rehearsal's tests: two gpu-marked files (collected, skipped on CPU) and one default-suite test.
DRY_TESTS = ["tests/test_static_cache.py", "tests/test_fused_head.py",
             "tests/test_oom_recovery.py::test_smaller_micro_and_giving_up"]
# On the GPU machine: the whole default suite plus the gpu-marked tests, GPU visible, xdist workers six
# short of the machine's cores (the trainer cases beside them need a few).
GPU_MARKERS = "not slow and not cua and not deepspeed"
MAX_FILE = 16 * 2**20     # the GPU machine returns files of up to 16 MiB, 8 files a command


@dataclass
class Step:
    name: str
    what: str
    goal: str
    limit_s: int          # at most this long
    min_s: int            # not started with less left
    expect_s: int         # what it took on an H100: the time kept for it while the steps before it run
    fn: Optional[Callable] = None
    batch: str = ""       # steps of one batch are measured by one call of BATCHES[batch]


def row(check: str, goal: str, measured: str, result: str) -> dict:
    return {"check": check, "goal": goal, "measured": measured, "result": result}


def has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


# ---- tests ------------------------------------------------------------------------------------------

WORST = {"error": 0, "failed": 1, "xpassed": 2, "passed": 3, "xfailed": 4, "skipped": 5}


def live_outcomes(path) -> tuple[list[dict], int | None]:
    """bench/pytest_live.py's lines: one outcome per test (the worst of its phases: a test that fails and
    then errors in teardown counts once), and how many tests were collected. A cut run's last line may
    be half written: skipped."""
    by_test: dict[str, dict] = {}
    total = None
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                o = json.loads(line)
            except ValueError:
                continue
            if "collected" in o:
                total = o["collected"]
            elif o["nodeid"] not in by_test or WORST.get(o["outcome"], 9) < WORST.get(by_test[o["nodeid"]]["outcome"], 9):
                by_test[o["nodeid"]] = o
    return list(by_test.values()), total


def tests(ctx, limit: float) -> dict:
    """One pytest run of the default suite and the gpu-marked tests, GPU visible, across the cores;
    every outcome is written as it happens (bench/pytest_live.py), so a cut run names what failed."""
    live = ctx.out / "tests.jsonl"
    live.unlink(missing_ok=True)
    cmd = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "bench.pytest_live", "--live-log", str(live),
           "-rfE"] + (["--timeout", "240"] if has("pytest_timeout") else [])
    if ctx.dry:
        cmd += ["-m", "", *DRY_TESTS]
    else:
        workers = max(2, len(os.sched_getaffinity(0)) - 6)
        cmd += (["-n", str(workers), "--dist", "worksteal"] if has("xdist") else []) + ["-m", GPU_MARKERS, "tests"]
    r = ctx.run(cmd, limit, "tests")
    outcomes, total = live_outcomes(live)
    failures = [{"test": o["nodeid"], "outcome": o["outcome"], "error": o.get("error", ""), "gpu": o.get("gpu")}
                for o in outcomes if o["outcome"] in ("failed", "error", "xpassed")]
    # pytest's own exit codes: 0 all passed, 1 some failed, 5 none collected; others (2 interrupted,
    # 3 internal error, 4 usage error) mean the run itself broke, whatever it wrote before.
    broke = not r["timed_out"] and r["rc"] not in (0, 1, 5)
    rows = []
    for label, pick in (("pytest -m gpu (gpu-marked tests)", lambda o: o.get("gpu")),
                        ("default suite, GPU visible", lambda o: not o.get("gpu"))):
        mine = [o for o in outcomes if pick(o)]
        counts: dict[str, int] = {}
        for o in mine:
            counts[o["outcome"]] = counts.get(o["outcome"], 0) + 1
        bad = [f for f in failures if pick(f)]
        shown = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "none ran"
        if bad:
            shown += "; " + "; ".join(f"{f['test'].split('::', 1)[-1]}: {f['error'][:80]}" for f in bad[:3])
            shown += f" (+{len(bad) - 3} more in check-tests.json)" if len(bad) > 3 else ""
        if r["timed_out"]:
            shown = f"cut at {r['seconds']:.0f} s after {len(outcomes)} of {total or '?'} tests; " + shown
        elif broke:
            shown = f"pytest exited {r['rc']} (the run broke; see the log tail); " + shown
        if bad or broke or (not mine and not r["timed_out"] and not ctx.dry):
            result = "fail"
        elif r["timed_out"]:
            result = "cut"
        else:
            result = "rehearsal" if ctx.dry else "pass"
        rows.append(row(label, "all pass (vLLM ones skip without vllm)" if "gpu" in label else "all pass",
                        shown, result))
    slowest = sorted(outcomes, key=lambda o: -o.get("seconds", 0))[:15]
    return {"rows": rows, "details": {"run": r, "collected": total, "ran": len(outcomes), "failures": failures,
                                      "slowest": [(o["nodeid"], o["seconds"]) for o in slowest]}}


# ---- decoding ---------------------------------------------------------------------------------------

def decode(ctx, limit: float) -> dict:
    out = ctx.work / "decode.json"
    out.unlink(missing_ok=True)
    r = ctx.run([PY, "-m", "bench.decode_speed", "--out", str(out), "--work", str(ctx.work / "decode"),
                 "--engines", "cuda-graphs,hf-generate"]
                + (["--quick"] if ctx.dry else []), limit, "decode")
    goal = "CUDA-graph decoding >= 2x HF generate tokens/s"
    if not out.exists():
        return {"rows": [row("decode: CUDA graphs vs HF generate", goal, f"no result (exit {r['rc']}"
                             + (", timed out" if r["timed_out"] else "") + ")", "fail")], "details": {"run": r}}
    d = json.loads(out.read_text())
    e = d["engines"]
    if d.get("partial"):   # stopped at its limit after some engines
        shown = "; ".join(f"{k} {v['tokens_per_s']:.0f} tok/s, {1e3 * v['s_per_decode_step']:.2f} ms/step, warm-up "
                          f"{v['warmup_s']:.1f} s" for k, v in e.items())
        return {"rows": [row("decode: CUDA graphs vs HF generate", goal, f"cut at its limit after {shown}", "cut")],
                "details": {"result": d, "run": r}}
    measured = (f"{e['cuda-graphs']['tokens_per_s']:.0f} vs {e['hf-generate']['tokens_per_s']:.0f} tok/s = "
                f"{d['graphs_over_generate']:.2f}x ({d['rows_per_call']} rows x {d['max_new_tokens']} new; graphs' "
                f"warm-up {e['cuda-graphs']['warmup_s']:.1f} s)")
    if d.get("bandwidth_fraction"):
        prof = e["cuda-graphs"].get("profile") or {}
        measured += (f"; {d['bandwidth_fraction']:.0%} of the bandwidth limit ({d['bandwidth_limit_tokens_per_s']:.0f} "
                     f"tok/s); GPU busy {prof.get('gpu_busy_fraction')} of a profiled step")
    if ctx.dry:
        result = "rehearsal"
    else:
        result = "pass" if d["graphs_over_generate"] >= d["goal"] and e["cuda-graphs"]["cuda_graphs"] else "fail"
    return {"rows": [row("decode: CUDA graphs vs HF generate", goal, measured, result)],
            "details": {"result": d, "run": r}}


# ---- trainer cases: OOM recovery and the planner --------------------------------------------------------

CASE_SETS = {"plan": "recorded", "plan-new": "new", "oom": "oom"}   # step -> bench/gpu_cases.py --set
# The rehearsal trains one recorded case of each kind (full, LoRA + checkpointing, GRPO), every new and
# OOM case, and builds the rest; it snapshots the first (no CUDA error on CPU to pick one by).
DRY_ONLY = ("pre-smol17-full-2k-m4,sft-smol17-lora-2k-m4-ckpt,grpo-q05-lora-g8-256,ppo-q05-lora-rm-128,dpo-q05-full-m8,"
            "pre-q05-full-2k-m4-zero3,sft-vlm-shapes-512px-m8,oom-q05-pre-4k-m8,oom-q05-grpo-g8-m64")


def cases_batch(ctx, limit: float, names: list[str]) -> dict:
    """plan, plan-new and oom in one bench/gpu_cases.py run: its cases share the card, admitted by their
    planned memory (bench/gpu_pool.py); each step gets the rows of its own set."""
    out = ctx.work / "cases.json"
    out.unlink(missing_ok=True)
    cmd = [PY, "-m", "bench.gpu_cases", "--set", ",".join(CASE_SETS[n] for n in names), "--out", str(out),
           "--work", str(ctx.work / "cases"), "--snapshots", str(ctx.out), "--deadline", str(time.time() + limit - 15)]
    if ctx.dry:
        cmd += ["--quick", "--only", DRY_ONLY, "--snapshot-all", "--max-snapshots", "1"]
    r = ctx.run(cmd, limit, "cases")
    if not out.exists():
        return {n: {"rows": [row(f"trainer cases ({CASE_SETS[n]})", "every case runs", f"no result (exit {r['rc']})",
                                 "fail")], "details": {"run": r}} for n in names}
    d = json.loads(out.read_text())
    snapshots = {}
    for snap in ctx.out.glob("snapshot-*.pickle"):  # gzip: a pickled trace compresses several times
        gz = snap.with_suffix(".pickle.gz")
        with open(snap, "rb") as f, gzip.open(gz, "wb", compresslevel=1) as g:
            g.write(f.read())
        snap.unlink()
        snapshots[gz.name] = f"{gz.stat().st_size / 2**20:.1f} MiB"
        if gz.stat().st_size > MAX_FILE:  # the GPU machine returns files of 16 MiB at most
            gz.rename(ctx.work / gz.name)
            snapshots[gz.name] += f", over 16 MiB: left in {ctx.work} on that machine"
    res = {}
    for n in names:
        mine = [c for c in d["cases"] if c.get("set") == CASE_SETS[n]]
        rows = [case_row(c, CASE_SETS[n]) for c in mine]
        if r["timed_out"]:
            rows.append(row(f"trainer cases ({CASE_SETS[n]})", "all cases within the step's limit",
                            f"timed out after {r['seconds']} s", "fail"))
        res[n] = {"rows": rows, "details": {"result": {**d, "cases": mine}, "snapshots": snapshots, "run": r}}
    return res


def case_row(c: dict, which: str) -> dict:
    if which == "oom":
        goal = "OOM caught, same step redone at a smaller micro-batch, all steps done"
        if c.get("skipped"):
            return row(c["case"], goal, c["skipped"], c["result"])
        micro = [c["config"]["train"]["micro_batch_size"], *c.get("micro_after_oom", [])]
        how = "injected (--fault oom_at_micro:1)" if c.get("injected_oom") else "real"
        cut = "; cut by the budget's deadline" if c["run"].get("cut") else ""
        return row(c["case"], goal, f"{c['ooms']} {how} OOM(s), micro-batch {' -> '.join(map(str, micro))}, "
                   f"{c['steps']}/{c['config']['train']['max_steps']} steps, exit {c['run']['rc']}{cut}", c["result"])
    goal = "planned within -5%..+10% of used, every phase"
    if c.get("skipped"):
        return row(f"plan vs trainer: {c['case']}", goal, c["skipped"], c["result"])
    phases = [f"{ph} {p['planned_gib']:.3g}/{p['used_gib']:.3g} GiB" + (f" {p['error']:+.1%}" if p["error"] is not None else "")
              for ph, p in c.get("phases", {}).items() if p["planned_gib"] is not None and p["used_gib"] is not None]
    measured = "planned/used: " + "; ".join(phases) if phases else f"no memory row (exit {c['run']['rc']})"
    if c.get("ooms"):
        measured += (f"; {c['ooms']} OOM(s) beside other cases, micro-batch cut to {c['micro_after_oom']}: not the "
                     "planned shape")
    if c["run"].get("cut"):
        measured += f"; cut by the budget's deadline after {c['run']['seconds']:.0f} s"
    if c.get("snapshot"):
        snap = c["snapshot"]
        why = snap.get("skipped") or ("cut by the budget's deadline" if snap.get("cut") else "its run failed")
        measured += f"; snapshot {snap['file']}.gz" if snap.get("file") else f"; no snapshot: {why}"
    return row(f"plan vs trainer: {c['case']}", goal, measured, c["result"])


def plan_grid(ctx, limit: float) -> dict:
    out = ctx.out / f"plan_accuracy_{'cpu' if ctx.dry else 'gpu'}.json"
    out.unlink(missing_ok=True)
    r = ctx.run([PY, "-m", "bench.plan_accuracy", "--out", str(out), "--deadline", str(time.time() + limit - 60)]
                + (["--cpu", "--limit", "1"] if ctx.dry else []), limit, "plan-grid")
    goal = "median |error| <= 5%, worst <= 10%, never > 5% under"
    if not out.exists():
        return {"rows": [row("plan_accuracy grid", goal, f"no result (exit {r['rc']})", "fail")], "details": {"run": r}}
    s = json.loads(out.read_text())["summary"]
    t = s["targets"]
    measured = (f"{s['configs']} configs ({s['failed']} failed): median {s['median_abs_error']}, worst "
                f"{s['worst_abs_error']}, worst under {s['worst_under_prediction']}")
    ok = s["configs"] > 0 and s["median_abs_error"] <= t["median_abs_error"] and \
        s["worst_abs_error"] <= t["worst_abs_error"] and s["worst_under_prediction"] >= t["worst_under_prediction"]
    return {"rows": [row("plan_accuracy grid (SFT steps)", goal, measured,
                         "rehearsal" if ctx.dry else "pass" if ok and not s["failed"] else "fail")],
            "details": {"summary": s, "file": out.name, "run": r}}


# ---- workloads against TRL ------------------------------------------------------------------------------

def workload(ctx, limit: float, name: str, reps: int, steps: int, trl: bool = True) -> dict:
    sides = "trainfit,trl" if trl and has("trl") else "trainfit"
    out = ctx.out / f"{name}.json"
    out.unlink(missing_ok=True)
    cmd = [PY, "-m", "bench.run", name, "--sides", sides, "--max-load", "0", "--max-others", "0", "--no-md",
           "--out-dir", str(ctx.out), "--work", str(ctx.work / "bw"), "--timeout", str(int(limit))]
    r = ctx.run(cmd + (["--quick"] if ctx.dry else ["--reps", str(reps), "--steps", str(steps)]), limit, name)
    if not out.exists():
        return {"rows": [row(name, "runs", f"no result (exit {r['rc']}" + (", timed out" if r["timed_out"] else "")
                             + ")", "fail")], "details": {"run": r}}
    d = json.loads(out.read_text())
    g, ra, tf = d["goal"], d["ratio"], d["sides"]["trainfit"]
    rows = []
    trl_missing = (None if "trl" in d["sides"] else "TRL side not run: trl is not installed" if trl else
                   "TRL side not run in the kit (bench.run runs it)")
    figures = (f"trainfit {tf['steps_per_s']['median']:.3f} steps/s, {tf['peak_mem_mb']['median']:.0f} MiB"
               + (f"; TRL {d['sides']['trl']['steps_per_s']['median']:.3f} steps/s, "
                  f"{d['sides']['trl']['peak_mem_mb']['median']:.0f} MiB" if not trl_missing else ""))
    for key, label, op, value in (("speedup", "steps/s over TRL", ">=", ra["steps_per_s_trainfit_over_trl"]),
                                  ("memory", "peak memory over TRL", "<=", ra["peak_mem_trainfit_over_trl"]),
                                  ("mfu", "trainfit MFU", ">=", (tf.get("mfu") or {}).get("median"))):
        target = g.get(f"{key}_target")
        if target is None:
            continue
        goal = f"{op} {target:.0%}" if key == "mfu" else f"{op} {target:g}x"
        if value is None:
            measured = trl_missing if key != "mfu" and trl_missing else "not measured" + ("" if not ctx.dry else " (CPU)")
            result = "rehearsal" if ctx.dry else "not-run" if trl_missing and key != "mfu" else "fail"
        else:
            measured = f"{value:.1%}" if key == "mfu" else f"{value:.2f}x"
            result = "rehearsal" if ctx.dry else "pass" if g.get(f"{key}_met") else "fail"
        rows.append(row(f"{name}: {label}", goal, f"{measured} ({figures})", result))
    return {"rows": rows, "details": {"file": out.name, "goal": g, "ratio": ra, "run": r}}


def sft(ctx, limit: float) -> dict:
    # The row is trainfit's MFU; TRL's side (measured 2026-11-27: 0.985 steps/s against trainfit's 0.982)
    # is bench.run's, and would double the step's time.
    return workload(ctx, limit, "sft-gpu-1.7b", reps=1, steps=5, trl=False)


def grpo(ctx, limit: float) -> dict:
    return workload(ctx, limit, "grpo-gpu-0.5b", reps=1, steps=3)


def grpo_vllm(ctx, limit: float) -> dict:
    if not has("vllm"):
        why = ("not run: vllm is not importable here (the GPU image has no vllm, and its ~400 MB wheel is over "
               "the 64 MiB a device call carries); the vLLM engine, its sleep/wake and the vllm-marked tests "
               "stay unmeasured")
        return {"rows": [row("grpo-gpu-0.5b-vllm: steps/s over TRL", ">= 2x", why, "not-run"),
                         row("grpo-gpu-0.5b-vllm: peak memory over TRL", "<= 0.8x", why, "not-run")]}
    if limit < 120:
        why = f"not started: {limit:.0f} s left; run it in a command of its own: make gpu-check STEPS=grpo-vllm"
        return {"rows": [row("grpo-gpu-0.5b-vllm", ">= 2x steps/s, <= 0.8x memory", why, "not-run")]}
    return workload(ctx, limit, "grpo-gpu-0.5b-vllm", reps=1, steps=3)


STEPS = {s.name: s for s in [
    Step("tests", "the default suite and the gpu-marked tests, GPU visible, xdist across the cores", "all pass",
         260, 60, 250, tests),
    Step("plan", "planner vs trainer, the 9 recorded H100 cases (bench/gpu_cases.py), side by side",
         "-5%..+10%", 260, 60, 250, batch="cases"),
    Step("plan-new", "planner vs trainer: PPO with its 4 models, DPO, ZeRO-3 on one GPU, VLM SFT "
         "(bench/gpu_cases.py --set new)", "-5%..+10%", 240, 60, 150, batch="cases"),
    Step("oom", "real OOMs from oversized micro-batches in a capped share of the card, recovered "
         "(bench/gpu_cases.py --set oom)", "recovered", 260, 45, 250, batch="cases"),
    Step("decode", "CUDA-graph decoding vs HF generate (bench/decode_speed.py)", ">= 2x tokens/s", 120, 45, 70, decode),
    Step("sft", "sft-gpu-1.7b, trainfit's MFU (bench/run.py --sides trainfit, 5 steps)", "MFU >= 45%", 120, 40, 45,
         sft),
    Step("grpo", "grpo-gpu-0.5b, trainfit vs TRL, HF generation (bench/run.py, 1 repetition of 3 steps)",
         ">= 2x steps/s, <= 0.8x memory", 240, 100, 155, grpo),
    Step("grpo-vllm", "grpo-gpu-0.5b-vllm, colocated vLLM with sleep (bench/run.py)",
         ">= 2x steps/s, <= 0.8x memory", 300, 0, 0, grpo_vllm),
    Step("plan-grid", "bench/plan_accuracy.py's GPU grid of SFT steps", "median <= 5%", 540, 60, 400, plan_grid),
]}
BATCHES = {"cases": cases_batch}
# One command runs these groups in order; the steps of a group run side by side (the trainer cases'
# memory is admitted by plan, the tests use the CPU cores); timed steps (decode, sft, grpo) run alone.
GROUPS = [["tests", "plan", "plan-new", "oom"], ["decode"], ["sft"], ["grpo"], ["grpo-vllm"], ["plan-grid"]]
DEFAULT = [s for g in GROUPS for s in g if s != "plan-grid"]   # one command of at most 9 minutes
