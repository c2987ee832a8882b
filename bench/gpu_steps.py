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
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional

PY = sys.executable
# The rehearsal's tests: two gpu-marked files (collected, skipped on CPU) and one default-suite test.
DRY_TESTS = ["tests/test_static_cache.py", "tests/test_fused_head.py",
             "tests/test_oom_recovery.py::test_smaller_micro_and_giving_up"]
# On the GPU machine: the whole default suite plus the gpu-marked tests, GPU visible, xdist workers four
# short of the machine's cores (the trainer cases beside them run at most four at a time, one core each).
GPU_MARKERS = "not slow and not cua and not deepspeed"
# Run first (after the gpu-marked tests, bench/pytest_live.py --run-first): what landed since the last GPU
# run, so a run cut at its limit has run it -- the single-function static decode step and the
# padding-free RL micro-batches, both CUDA-unverified.
FIRST_TESTS = ("tests/test_static_cache.py", "tests/test_padding_free.py")
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
           "-rfE", "--run-first", ",".join(FIRST_TESTS)] + (["--timeout", "240"] if has("pytest_timeout") else [])
    if ctx.dry:
        cmd += ["-m", "", *DRY_TESTS]
    else:
        workers = max(2, len(os.sched_getaffinity(0)) - 4)
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

# The kit's engines, the most wanted first: a run cut at its limit loses the last (HF generate's
# figure is the least new: TRL's side of the grpo step decodes the same way).
DECODE_ENGINES = ("cuda-graphs", "cuda-graphs-nocodegen", "hf-generate")
GRAPH_ENGINES = ("cuda-graphs", "cuda-graphs-nocodegen")
DECODE_TOKENS_GOAL = 40_000      # issue 35: within 10x of the bandwidth limit on grpo-gpu-0.5b's shapes
FIRST_CALL_GOAL_S = 10.0         # issue 35: the first call (capture, compile) within 10 s of a later one


def decode(ctx, limit: float) -> dict:
    """bench/decode_speed.py over DECODE_ENGINES; rows: graphs vs generate, tokens/s against the card's
    bandwidth, the first call's cost. An engine the limit cut is named as cut in each row that needs it."""
    out = ctx.work / "decode.json"
    out.unlink(missing_ok=True)
    r = ctx.run([PY, "-m", "bench.decode_speed", "--out", str(out), "--work", str(ctx.work / "decode"),
                 "--engines", ",".join(DECODE_ENGINES)]
                + (["--quick"] if ctx.dry else []), limit, "decode")
    if not out.exists():
        why = f"no result (exit {r['rc']}" + (", timed out" if r["timed_out"] else "") + ")"
        return {"rows": [row("decode: CUDA graphs vs HF generate", "CUDA-graph decoding >= 2x HF generate tokens/s",
                             why, "cut" if r["timed_out"] else "fail")], "details": {"run": r}}
    d = json.loads(out.read_text())
    return {"rows": decode_rows(d, ctx.dry), "details": {"result": d, "run": r}}


def decode_rows(d: dict, dry: bool) -> list[dict]:
    e = d["engines"]
    missing = [k for k in DECODE_ENGINES if k not in e]
    cut = "cut at the step's limit before " + ", ".join(missing) if missing else ""

    def judged(ok: bool, needs: tuple) -> str:
        if any(k not in e for k in needs):
            return "cut"
        return "rehearsal" if dry else "pass" if ok else "fail"

    def tok(k: str) -> str:
        v = e[k]
        bw = f", {v['bandwidth_fraction']:.1%} of the bandwidth limit" if v.get("bandwidth_fraction") else ""
        return f"{k} {v['tokens_per_s']:.0f} tok/s ({1e3 * v['s_per_decode_step']:.2f} ms/step{bw})"

    rows = []
    shape = f"{d.get('rows_per_call')} rows x {d.get('max_new_tokens')} new"
    if "cuda-graphs" in e and "hf-generate" in e:
        ratio = e["cuda-graphs"]["tokens_per_s"] / e["hf-generate"]["tokens_per_s"]
        measured = (f"{e['cuda-graphs']['tokens_per_s']:.0f} vs {e['hf-generate']['tokens_per_s']:.0f} tok/s = "
                    f"{ratio:.2f}x ({shape})")
        prof = e["cuda-graphs"].get("profile") or {}
        if prof.get("gpu_busy_fraction") is not None:
            measured += f"; GPU busy {prof['gpu_busy_fraction']:.0%} of a profiled step"
        ok = ratio >= d.get("goal", 2.0) and e["cuda-graphs"]["cuda_graphs"]
    else:
        measured, ok = "; ".join([cut] + [tok(k) for k in e]), False
    rows.append(row("decode: CUDA graphs vs HF generate", "CUDA-graph decoding >= 2x HF generate tokens/s", measured,
                    judged(ok, ("cuda-graphs", "hf-generate"))))
    limit = d.get("bandwidth_limit_tokens_per_s")
    measured = "; ".join(([f"limit {limit:.0f} tok/s"] if limit else []) + [tok(k) for k in DECODE_ENGINES if k in e]
                         + ([cut] if cut else []))
    best = max((e[k]["tokens_per_s"] for k in GRAPH_ENGINES if k in e), default=0.0)
    rows.append(row("decode: tokens/s against the card's bandwidth", f">= {DECODE_TOKENS_GOAL:,} tok/s (10x of the "
                    "limit)", measured, judged(best >= DECODE_TOKENS_GOAL, GRAPH_ENGINES[:1])))
    # The first call captures (and, under inductor, compiles) the step: its cost is warm-up - a later call.
    extra = {k: e[k]["warmup_s"] - statistics.median(c["seconds"] for c in e[k]["calls"]) for k in GRAPH_ENGINES if k in e}
    measured = "; ".join([f"{k} first call {e[k]['warmup_s']:.1f} s, {x:+.1f} s over a later one" for k, x in extra.items()]
                         + ([cut] if cut else []))
    rows.append(row("decode: first call over a later one", f"<= {FIRST_CALL_GOAL_S:.0f} s more (the default, "
                    "cuda-graphs)", measured, judged(extra.get("cuda-graphs", 1e9) <= FIRST_CALL_GOAL_S, GRAPH_ENGINES)))
    return rows


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
    snapshots = keep_snapshots(ctx)
    res = {}
    for n in names:
        mine = [c for c in d["cases"] if c.get("set") == CASE_SETS[n]]
        rows = [case_row(c, CASE_SETS[n]) for c in mine]
        if r["timed_out"]:
            rows.append(row(f"trainer cases ({CASE_SETS[n]})", "all cases within the step's limit",
                            f"timed out after {r['seconds']} s", "fail"))
        res[n] = {"rows": rows, "details": {"result": {**d, "cases": mine}, "snapshots": snapshots, "run": r}}
    return res


def keep_snapshots(ctx) -> dict:
    """Gzip the CUDA memory snapshots the cases wrote into ctx.out; one over the 16 MiB a GPU machine
    returns stays there, and bench/snapshot_peak.py reads it there first (seconds): its peak comes back."""
    snapshots = {}
    for snap in ctx.out.glob("snapshot-*.pickle"):  # gzip: a pickled trace compresses several times
        gz = snap.with_suffix(".pickle.gz")
        with open(snap, "rb") as f, gzip.open(gz, "wb", compresslevel=1) as g:
            g.write(f.read())
        snap.unlink()
        snapshots[gz.name] = f"{gz.stat().st_size / 2**20:.1f} MiB"
        if gz.stat().st_size > MAX_FILE:
            peak = ctx.out / gz.name.replace(".pickle.gz", ".peak.json")
            ctx.run([PY, "-m", "bench.snapshot_peak", str(gz), "--json", str(peak)], 60, f"peak-{gz.stem}")
            gz.rename(ctx.work / gz.name)
            snapshots[gz.name] += (f", over 16 MiB: left in {ctx.work} on that machine"
                                   + (f"; what was alive at its peak in {peak.name}" if peak.exists() else ""))
    return snapshots


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

def workload(ctx, limit: float, name: str, reps: int, steps: int, trl: bool = True, variants: tuple = ()) -> dict:
    sides = "trainfit,trl" if trl and has("trl") else "trainfit"
    out = ctx.out / f"{name}.json"
    out.unlink(missing_ok=True)
    cmd = [PY, "-m", "bench.run", name, "--sides", sides, "--max-load", "0", "--max-others", "0", "--no-md",
           "--out-dir", str(ctx.out), "--work", str(ctx.work / "bw"), "--timeout", str(int(limit))]
    cmd += [a for v in variants for a in ("--variant", v)]
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
    rows += [variant_row(name, v, (d.get("variants") or {}).get(v), tf, r["timed_out"], ctx.dry) for v in variants]
    return {"rows": rows, "details": {"file": out.name, "goal": g, "ratio": ra, "variants": d.get("variants"), "run": r}}


def variant_row(name: str, variant: str, v: dict | None, default: dict, timed_out: bool, dry: bool) -> dict:
    """trainfit with `variant` against its default run: steps/s, training tokens/s (what packing changes:
    generation is the same) and peak memory. Data for a default, not a goal: `info`."""
    goal = "measured (decides the default)"
    if v is None:
        why = "cut at the step's limit before it ended" if timed_out else "not in bench.run's result (see the log tail)"
        return row(f"{name}: trainfit {variant} vs the default", goal, why, "cut" if timed_out else "fail")
    f, over = v["figures"], v["over_default"]

    def x(key: str) -> str:
        return "?" if over.get(key) is None else f"{over[key]:.2f}x"

    def dflt(key: str):   # the default run's figure
        return (default.get(key) or {}).get("median")

    tt = f["train_tokens_per_s"], dflt("train_tokens_per_s")
    measured = (f"steps/s {f['steps_per_s']:.3f} vs {dflt('steps_per_s') or 0:.3f} ({x('steps_per_s')}); training "
                f"tok/s {tt[0] or 0:.0f} vs {tt[1] or 0:.0f} ({x('train_tokens_per_s')}); peak {f['peak_mem_mb']:.0f} vs "
                f"{dflt('peak_mem_mb') or 0:.0f} MiB ({x('peak_mem_mb')}); first step {v['first_step_s']:.1f} s")
    return row(f"{name}: trainfit {variant} vs the default", goal, measured, "rehearsal" if dry else "info")


def sft(ctx, limit: float) -> dict:
    # The row is trainfit's MFU; TRL's side (measured 2026-11-27: 0.985 steps/s against trainfit's 0.982)
    # is bench.run's, and would double the step's time.
    return workload(ctx, limit, "sft-gpu-1.7b", reps=1, steps=5, trl=False)


# Padding-free RL micro-batches with sdpa on CUDA: `train.padding_free: auto` packs only with
# flash-attention until this says whether `on` pays there (trainfit's side once more, after TRL's).
GRPO_VARIANTS = ("train.padding_free=on",)


def grpo(ctx, limit: float) -> dict:
    return workload(ctx, limit, "grpo-gpu-0.5b", reps=1, steps=3, variants=GRPO_VARIANTS)


def grpo_vllm(ctx, limit: float) -> dict:
    if not has("vllm"):
        why = ("not run: vllm is not importable here (the GPU image has no vllm: carry the parts of "
               "`make gpu-vllm-kit`, one a call, bench/NOTES.md); the vLLM engine, its sleep/wake and the "
               "vllm-marked tests stay unmeasured")
        return {"rows": [row("grpo-gpu-0.5b-vllm: steps/s over TRL", ">= 2x", why, "not-run"),
                         row("grpo-gpu-0.5b-vllm: peak memory over TRL", "<= 0.8x", why, "not-run")]}
    if limit < 120:
        why = f"not started: {limit:.0f} s left; run it in a command of its own: make gpu-check STEPS=grpo-vllm"
        return {"rows": [row("grpo-gpu-0.5b-vllm", ">= 2x steps/s, <= 0.8x memory", why, "not-run")]}
    return workload(ctx, limit, "grpo-gpu-0.5b-vllm", reps=1, steps=3)


# The split of the default command's 540 s, from the H100 run of 2026-11-27 (bench/results/
# gpu-check-h100-2026-11-27/, logs/ and gpu-check.log there): 18 s of wheel install and machine probe
# before the first group, 5 s kept at the end (RESERVE_S), and for the groups (expect_s):
# - decode 85 s (estimate): model build and load + `cuda-graphs` (warm-up 15.8 s, a 3.1 s call, the
#   profiled call) came to well under 70 s, and the third engine then (trainfit-dynamic, ~11 s a call)
#   was cut at 70 s before hf-generate; `cuda-graphs-nocodegen` takes trainfit-dynamic's place (no code
#   generation: a warm-up under inductor's, a call of a few seconds, ~12 s together) and hf-generate
#   decodes 32,768 tokens at about TRL's 2,400 tok/s (~15 s with its short warm-up).
# - sft 45 s: trainfit's side measured 34.1 s, plus bench.run's preparation.
# - grpo 205 s: 152 s measured (bench.run 17 s, trainfit 51.4 s, TRL 83.3 s) + trainfit once more with
#   train.padding_free=on, ~51 s as the default run (its first step finds inductor's cache warm).
# - the first group gets what is left, ~182 s (540 - 18 - 5 - 85 - 45 - 205): the tests took ~216 s on
#   10 workers (1290 of 1383 in 202 s), ~180 s on the 12 they have now; the cases started last (those
#   within the targets before) and the default suite's tail are what a cut takes first, with the
#   gpu-marked tests and FIRST_TESTS run at the start and the QLoRA case started first.
STEPS = {s.name: s for s in [
    Step("tests", "the default suite and the gpu-marked tests, GPU visible, xdist across the cores", "all pass",
         260, 60, 180, tests),
    Step("plan", "planner vs trainer, the 9 recorded H100 cases (bench/gpu_cases.py), side by side",
         "-5%..+10%", 260, 60, 180, batch="cases"),
    Step("plan-new", "planner vs trainer: PPO with its 4 models, DPO, ZeRO-3 on one GPU, VLM SFT "
         "(bench/gpu_cases.py --set new)", "-5%..+10%", 240, 60, 150, batch="cases"),
    Step("oom", "real OOMs from oversized micro-batches in a capped share of the card, recovered "
         "(bench/gpu_cases.py --set oom)", "recovered", 260, 45, 180, batch="cases"),
    Step("decode", "decoding: CUDA graphs (inductor, and captured without code generation) vs HF generate "
         "(bench/decode_speed.py)", ">= 2x tokens/s", 120, 45, 85, decode),
    Step("sft", "sft-gpu-1.7b, trainfit's MFU (bench/run.py --sides trainfit, 5 steps)", "MFU >= 45%", 120, 40, 45,
         sft),
    Step("grpo", "grpo-gpu-0.5b, trainfit vs TRL, HF generation (bench/run.py, 1 repetition of 3 steps), then "
         "trainfit with train.padding_free=on", ">= 2x steps/s, <= 0.8x memory", 270, 100, 205, grpo),
    Step("grpo-vllm", "grpo-gpu-0.5b-vllm, colocated vLLM with sleep (bench/run.py)",
         ">= 2x steps/s, <= 0.8x memory", 300, 0, 0, grpo_vllm),
    Step("plan-grid", "bench/plan_accuracy.py's GPU grid of SFT steps", "median <= 5%", 540, 60, 400, plan_grid),
]}
BATCHES = {"cases": cases_batch}
# One command runs these groups in order; the steps of a group run side by side (the trainer cases'
# memory is admitted by plan, the tests use the CPU cores); timed steps (decode, sft, grpo) run alone.
GROUPS = [["tests", "plan", "plan-new", "oom"], ["decode"], ["sft"], ["grpo"], ["grpo-vllm"], ["plan-grid"]]
DEFAULT = [s for g in GROUPS for s in g if s != "plan-grid"]   # one command of at most 9 minutes
