"""The planner against the real trainer: every trainer case, run by `trainfit train`, planned vs used.

    python -m bench.gpu_cases --out plan.json                 # the 9 cases of the 2026-11-22 H100 file
    python -m bench.gpu_cases --set new --out plan-new.json   # PPO, ZeRO-3 on one GPU, a VLM SFT step
    python -m bench.gpu_cases --quick --out /tmp/p.json       # CPU rehearsal: toy shapes, 2 steps

Cases: `recorded` = the trainer runs of bench/results/gpu_h100_2026-11-22.json (`trainer_runs.cases`:
pretraining with and without checkpointing, LoRA, QLoRA, GRPO with LoRA and in full with a KL
reference), rebuilt as that file says, with today's defaults (so today's planner meets today's
trainer); `new` = the paths no GPU has run yet (NEW below). Each case runs `python -m trainfit.app.cli
train` in a fresh process; the trainer itself writes the planner's figure and what it used per
memory phase (rollout, scoring, train) into metrics.jsonl (trainfit/train/memstats.py: on CUDA
torch.cuda.max_memory_allocated against the plan's `allocated`). Here: error = planned / used - 1
per phase; a case passes when every phase is within -5% .. +10% (bench/plan_accuracy.py's targets).
A case planned more than 5% under in any phase is run again for 2 steps under bench/gpu_snapshot.py,
which saves a CUDA memory snapshot (the allocations and their Python stacks) to read afterwards.

The output JSON also has a `trainer_runs` section shaped like the 2026-11-22 file (config, planned,
measured, step times, tokens/s), so a new GPU run can become the next bench/results/gpu_<card>_<date>.json.
Model directories (random weights, the SmolLM2 tokenizer) are cached under $TRAINFIT_BENCH_CACHE
(bench/workloads.py); full fine-tuning cases use `model.init: random` on a config-only directory.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import random
import shutil
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import yaml

from bench.gpu_case_table import QUICK_VLM, REWARD, admission_gib, cases
from bench.gpu_pool import Job, Pool
from bench.screens_service import serve_screens
from bench.workloads import catalog_config_dir, catalog_model_dir
from trainfit.config import validate

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"under": -0.05, "over": 0.10}          # planned / used - 1, per phase
LOGGING = {"tensorboard": False, "progress": False, "plot": False}

def words_file(root: Path) -> Path:
    """Text of random common words, 50-200 words a line (the recorded runs' data), ~1.5 MB."""
    out = root / "words.txt"
    if not out.exists():
        root.mkdir(parents=True, exist_ok=True)   # the first case to need it may be the first case built
        rng = random.Random(0)
        vocab = ("the of and to in is it that was for on are with as his they be at one have this from or had "
                 "by word but what some we can out other were all there when up use your how said an each she "
                 "which do their time if will way about many then them write would like so these her long make "
                 "thing see him two has look more day could go come did number sound no most people my over").split()
        out.write_text("".join(" ".join(rng.choice(vocab) for _ in range(rng.randint(50, 200))) + "\n"
                               for _ in range(2000)))
    return out


SERVICES: dict = {}


def screens_url(width: int, height: int) -> str:
    """The URL of a screenshot service of this size (bench/screens_service.py), started once, serving
    the trainer processes of this run until it ends."""
    if (width, height) not in SERVICES:
        SERVICES[width, height] = serve_screens(width, height)
    return SERVICES[width, height].url


def one_score_dir(lm: Path) -> Path:
    """`lm` (a causal LM directory) as a reward model: the same files, linked, with a config of one
    label, so the sequence classifier built on its body has the one output PPO reads."""
    out = lm.with_name(lm.name + "-score1")
    if not (out / "config.json").exists():
        out.mkdir(parents=True, exist_ok=True)
        for f in lm.iterdir():
            if f.name != "config.json" and not (out / f.name).exists():
                (out / f.name).symlink_to(f.resolve())
        config = json.loads((lm / "config.json").read_text())
        config.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
        (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def materialise(case: dict, root: Path, quick: bool) -> dict:
    """The case's config with real paths: model directory, data file, reward function, run dir."""
    raw = copy.deepcopy(case["config"])
    m = raw["model"]
    name = m["name"]
    stem = name.split("catalog ", 1)[1].split(".json")[0] if name.startswith("<local dir") else \
        name.split(":", 1)[1] if name.startswith("catalog:") else None
    full = raw.get("peft", {}).get("method", "none") == "none" and m.get("quantization", "none") == "none"
    if stem and full:  # the trainer builds the weights itself: no 1-8 GB directory to write first
        m.update(name=str(catalog_config_dir(stem, quick, root)), init="random")
    elif stem:
        m["name"] = str(catalog_model_dir(stem, m.get("dtype", "bf16"), quick, root))
    if "data" in raw or raw["stage"] == "pretrain":
        raw.setdefault("data", {})["path"] = str(words_file(root))
    if "task" in raw and raw["task"].get("name") == "arithmetic" and raw["stage"] in ("grpo",):
        raw["task"]["rewards"] = [REWARD]
    rm = raw.get("rl_models", {}).get("reward_model") or ""
    if rm.startswith("catalog:"):   # a sequence classifier on the causal LM's body (its score head is new)
        lm = catalog_model_dir(rm.split(":", 1)[1], m.get("dtype", "bf16"), quick, root)
        raw["rl_models"]["reward_model"] = str(one_score_dir(lm))
    if raw.get("task", {}).get("path"):
        raw["task"]["path"] = str(ROOT / raw["task"]["path"])
    env = raw.get("env", {})
    if str(env.get("url", "")).startswith("screens:"):   # a screenshot service in this process, per size
        w, h = (64, 64) if quick else map(int, env["url"].split(":", 1)[1].split("x"))
        env["url"] = screens_url(w, h)
    raw.pop("hardware", None)                     # plan for the card the run is on
    raw["run_dir"] = str(root / "runs" / case["case"])
    raw["logging"] = dict(LOGGING)
    # Step 1 allocates the optimizer state, step 2 is the first steady one: 3 give two step times.
    raw["train"] = {**raw.get("train", {}), "save_every": 0, "eval_every": 0}
    raw["train"]["max_steps"] = min(raw["train"].get("max_steps", 3), 3)
    if quick:
        shrink(raw, keep_micro=case.get("expect") == "oom")
    return raw


def shrink(raw: dict, keep_micro: bool = False) -> None:
    """Toy shapes on CPU for the rehearsal: the same stages, methods and engines, seconds a case."""
    t = raw["train"]
    t.update(device="cpu", max_steps=2, micro_batch_size=4 if keep_micro else 2, global_batch_size=4)
    raw["model"]["dtype"] = "fp32"
    if "config_overrides" in raw["model"]:
        raw["model"].update(config_overrides=QUICK_VLM, min_pixels=64 * 64, max_pixels=64 * 64)
    if "data" in raw:
        raw["data"]["max_seq_length"] = min(raw["data"].get("max_seq_length", 64), 64)
    if raw["stage"] in ("grpo", "ppo"):
        raw.setdefault("rollout", {})["max_new_tokens"] = 8
        if raw["stage"] == "grpo":
            raw.setdefault("grpo", {})["num_generations"] = 2


def skip_reason(raw: dict, cuda: bool) -> str | None:
    if raw["model"].get("quantization", "none") != "none" and (not cuda or not importlib.util.find_spec("bitsandbytes")):
        return "QLoRA needs CUDA and bitsandbytes"
    if raw.get("distributed", {}).get("strategy") == "deepspeed" and not importlib.util.find_spec("deepspeed"):
        return "deepspeed is not installed"
    return None


def case_command(case: dict, raw: dict, root: Path, snapshot: Path | None = None, extra: tuple = (),
                 fraction: float | None = None) -> list[str]:
    """Write the case's config; the command that trains it: `trainfit train`, or under
    bench/gpu_snapshot.py for a CUDA memory snapshot (`snapshot`) or a capped allocator (`fraction`)."""
    cfg_path = root / "configs" / f"{case['case']}{'-snapshot' if snapshot else ''}.yaml"
    cfg_path.parent.mkdir(parents=True, exist_ok=True)
    cfg_path.write_text(yaml.safe_dump(raw, sort_keys=False))
    shutil.rmtree(raw["run_dir"], ignore_errors=True)
    if snapshot is None and fraction is None:
        return [sys.executable, "-m", "trainfit.app.cli", "train", str(cfg_path), *extra]
    wrap = ["--memory-fraction", str(fraction)] if fraction else []
    cmd = [sys.executable, "-m", "bench.gpu_snapshot", *wrap, str(snapshot) if snapshot else "-", "train",
           str(cfg_path), *extra]
    if raw.get("distributed", {}).get("strategy") == "deepspeed":  # one rank, started here (see gpu_snapshot)
        cmd[1:2] = ["-m", "torch.distributed.run", "--nproc_per_node=1", f"--master_port={free_port()}", "-m"]
    return cmd


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def compare(rows: list[dict]) -> dict:
    """Planned vs used per phase from the trainer's memory row; error = planned / used - 1."""
    mem = next((r for r in rows if r.get("kind") == "memory"), None)
    train = [r for r in rows if r.get("kind") == "train"]
    out = {"steps": len(train), "step_time_s": [r.get("step_time") for r in train],
           "tokens_per_s": [r.get("tokens_per_s") for r in train], "ooms": sum(r.get("kind") == "oom" for r in rows),
           "micro_after_oom": [r.get("micro_batch_size") for r in rows if r.get("kind") == "oom"]}
    if mem is None:
        return {**out, "phases": {}, "basis": None}
    phases = {}
    for key, planned in mem.items():
        if key.startswith("planned_") and key.endswith("_gib"):
            ph = key[len("planned_"):-len("_gib")]
            used = mem.get(f"used_{ph}_gib")
            cuda = mem.get("basis", "").startswith("cuda")
            err = planned / used - 1 if cuda and planned and used else None
            phases[ph] = {"planned_gib": planned, "used_gib": used, "error": None if err is None else round(err, 4)}
    return {**out, "phases": phases, "basis": mem.get("basis"), "plan_error": mem.get("plan_error"),
            "reserved_gib": mem.get("reserved_gib")}


def verdict(result: dict, quick: bool = False) -> str:
    if result.get("skipped"):
        return "not-run"
    if result["run"].get("cut"):   # the budget's deadline ended it: what it measured stands, no verdict
        return "cut"
    if result.get("expect") == "oom":  # recovered: OOM logged, every step done, clean exit
        ok = result["run"]["rc"] == 0 and result["ooms"] >= 1 and result["steps"] == result["config"]["train"]["max_steps"]
        return "fail" if not ok else "rehearsal" if quick else "pass"
    if result.get("ooms"):   # run out of memory beside other cases: measured at a smaller micro-batch
        return "fail"
    if result["run"]["rc"] != 0 or not result["phases"]:
        return "fail"
    errs = [p["error"] for p in result["phases"].values() if p["error"] is not None]
    if not errs:
        return "rehearsal"
    return "pass" if all(TARGETS["under"] <= e <= TARGETS["over"] for e in errs) else "fail"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", default="recorded", help="comma-separated sets: recorded, new, oom")
    ap.add_argument("--max-snapshots", type=int, default=2, help="CUDA memory snapshots per run at most")
    ap.add_argument("--quick", action="store_true", help="toy shapes on CPU (the rehearsal)")
    ap.add_argument("--only", default="", help="comma-separated case names (default: all of the set)")
    ap.add_argument("--work", default="/tmp/trainfit-gpu-cases")
    ap.add_argument("--snapshot-all", action="store_true",
                    help="snapshot trained cases whatever their error (the rehearsal: CPU has no CUDA error to go by)")
    ap.add_argument("--snapshots", default="", help="directory for CUDA memory snapshots (default: next to --out)")
    ap.add_argument("--deadline", type=float, default=0.0, help="unix time at which running cases are cut")
    ap.add_argument("--capacity-gib", type=float, default=None,
                    help="GPU memory the cases may share (default: 85%% of the card on CUDA, the rest for the tests "
                         "beside them; 0 = one case at a time)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available() and not args.quick
    if args.capacity_gib is None:
        args.capacity_gib = 0.85 * torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else 0.0
    root, out = Path(args.work), Path(args.out)
    snaps = Path(args.snapshots) if args.snapshots else out.parent
    only = {x for x in args.only.split(",") if x}
    sets = [x for x in args.set.split(",") if x]
    result = {"set": args.set, "rehearsal": args.quick, "targets": TARGETS, "capacity_gib": round(args.capacity_gib, 1),
              "cases": []}
    deadline = args.deadline or time.time() + 3600.0
    pool = Pool(args.capacity_gib, deadline - 5, ROOT, max_running=4 if cuda else 1)
    lock = threading.Lock()

    def save() -> None:   # after every case: a cut-off run keeps what it measured
        with lock:
            out.write_text(json.dumps(result, indent=1))

    # The pool starts each case as soon as it is built: the first (full fine-tuning, config-only
    # directories) train while the LoRA cases' weight directories are written.
    runner = threading.Thread(target=pool.run, daemon=True)
    runner.start()
    for which in sets:
        for case in cases(which):
            if only and case["case"] not in only and not args.quick:
                continue
            entry = {"set": which, "case": case["case"], "why": case["why"], "recorded_GiB": case.get("recorded_GiB"),
                     "expect": case.get("expect")}
            result["cases"].append(entry)
            try:
                raw = materialise(case, root, args.quick)
                entry["config"] = raw
                reason = skip_reason(raw, cuda)
                if only and case["case"] not in only:  # the rehearsal still builds and validates every case
                    validate(json.loads(json.dumps(raw)))
                    reason = "built and validated; the rehearsal trains a subset (--only)"
            except Exception as e:  # noqa: BLE001 - a case that cannot be built is a result; the next one runs
                entry.update(skipped=f"could not build the case: {type(e).__name__}: {str(e)[:300]}", result="fail")
                continue
            if reason:
                entry.update(skipped=reason, result="rehearsal" if args.quick else "not-run")
                continue
            pool.add(case_job(case, raw, entry, root, args, snaps, pool, result, save))
    save()
    pool.close()
    runner.join()
    for job in pool.pending:   # never started: the budget ran out first
        why = "not started: no time left in this command's budget"
        if job.tier:   # a snapshot rerun: its case keeps what it measured
            job.meta["entry"]["snapshot"] = {"file": None, "skipped": why}
        else:
            job.meta["entry"].update(skipped=why, result="not-run")
    for entry in result["cases"]:
        if "result" in entry:
            print(f"{entry['case']:28s} {entry['result']:9s} " + ", ".join(
                f"{ph} planned {p['planned_gib']:.3g} used {p['used_gib']:.3g} GiB" + (f" ({p['error']:+.1%})" if p["error"] is not None else "")
                for ph, p in entry.get("phases", {}).items() if p["planned_gib"] is not None and p["used_gib"] is not None)
                + (f" [{entry['skipped']}]" if entry.get("skipped") else ""), flush=True)
    result["trainer_runs"] = trainer_runs(result)
    save()
    return result


def share_gib(case: dict, args) -> float:
    """What the pool admits the case with: its admission share, or nothing when cases run one at a time."""
    return admission_gib(case) if args.capacity_gib else 0.0


def case_job(case: dict, raw: dict, entry: dict, root: Path, args, snaps: Path, pool: Pool, result: dict,
             save: Callable[[], None]) -> Job:
    """The case's trainer run as a pool job; when it ends, its entry gets the comparison, and a case
    planned > 5% under queues its snapshot rerun (2 steps under bench/gpu_snapshot.py)."""
    # The rehearsal cannot run a card out of memory: it injects the same exception type instead. On
    # CUDA the OOM case runs under an allocator capped at its admission share of the card, so its real
    # torch.OutOfMemoryError happens inside that share while other cases run beside it.
    oom = case.get("expect") == "oom"
    extra = ("--fault", "oom_at_micro:1") if args.quick and oom else ()
    fraction = None
    if oom and not args.quick and args.capacity_gib:
        import torch

        fraction = round(admission_gib(case) / (torch.cuda.get_device_properties(0).total_memory / 2**30), 3)
    # A case planned under on the last GPU run records its CUDA memory history in its first run: the
    # snapshot is the measurement most wanted, and a rerun may find no time left.
    first = (snaps / f"snapshot-{case['case']}.pickle" if case.get("snapshot_first")
             and sum(1 for e in result["cases"] if e.get("snapshot_first")) < args.max_snapshots else None)
    if first:
        entry["snapshot_first"] = True
    cmd = case_command(case, raw, root, extra=extra, fraction=fraction, snapshot=first)

    def done(job: Job) -> None:
        entry.update(compare(read_rows(Path(raw["run_dir"]) / "metrics.jsonl")), injected_oom=bool(extra),
                     run={"rc": job.rc, "seconds": job.seconds, "cut": job.cut, "log_tail": job.tail(),
                          **({"memory_fraction": fraction} if fraction else {})})
        entry["result"] = verdict(entry, args.quick)
        if first:
            entry["snapshot"] = {"file": first.name if first.exists() and not job.cut else None, "rc": job.rc,
                                 "seconds": job.seconds, "steps": entry["steps"], "in_the_measured_run": True}
            save()
            return
        under = [e["error"] for e in entry["phases"].values() if e["error"] is not None and e["error"] < TARGETS["under"]]
        taken = sum(1 for e in result["cases"] if "snapshot" in e)
        if (under or (args.snapshot_all and entry["result"] not in ("fail", "cut"))) and not oom:
            if taken >= args.max_snapshots:
                entry["snapshot"] = {"file": None, "skipped": f"{args.max_snapshots} snapshots already taken in "
                                                               "this run (--max-snapshots)"}
            else:
                entry["snapshot"] = {"file": None, "skipped": "queued"}
                pool.add(snapshot_job(case, raw, entry, root, snaps, args, save))
        save()

    # Cases measured within the targets on the last GPU run start after the ones not yet measured so.
    return Job(case["case"], cmd, share_gib(case, args),
               root / "logs" / f"{case['case']}.log", tier=1 if case.get("passed_before") else 0, done=done,
               meta={"entry": entry})


def snapshot_job(case: dict, raw: dict, entry: dict, root: Path, snaps: Path, args, save) -> Job:
    snap = snaps / f"snapshot-{case['case']}.pickle"
    raw = {**raw, "run_dir": raw["run_dir"] + "-snapshot", "train": {**raw["train"], "max_steps": 2}}
    cmd = case_command(case, raw, root, snapshot=snap)

    def done(job: Job) -> None:
        entry["snapshot"] = {"file": snap.name if snap.exists() and not job.cut else None, "rc": job.rc,
                             "seconds": job.seconds, "steps": 2, **({"cut": True} if job.cut else {}),
                             **({} if job.rc == 0 else {"log_tail": job.tail()})}
        if args.quick and (job.rc != 0 or not snap.exists()):
            entry["result"] = "fail"  # the rehearsal's snapshot run is the path the GPU run takes
        save()

    return Job(case["case"] + "-snapshot", cmd, share_gib(case, args),
               root / "logs" / f"{case['case']}-snapshot.log", tier=2, done=done, meta={"entry": entry})


def trainer_runs(result: dict) -> dict:
    """The cases in the shape of bench/results/gpu_h100_2026-11-22.json's `trainer_runs` section."""
    rows = []
    for e in result["cases"]:
        if not e.get("phases"):
            continue
        rows.append({"case": e["case"], "config": e.get("config"),
                     "planner_allocated_GiB": {ph: p["planned_gib"] for ph, p in e["phases"].items()},
                     "measured_max_memory_allocated_GiB": max((p["used_gib"] or 0) for p in e["phases"].values()),
                     "measured_max_memory_reserved_GiB": e.get("reserved_gib"),
                     "step_time_s": e["step_time_s"], "tokens_per_s": e["tokens_per_s"]})
    return {"how": "python -m trainfit.app.cli train per case in a fresh process; per memory phase the trainer's "
                   "torch.cuda.max_memory_allocated against the plan's allocated (trainfit/train/memstats.py)",
            "cases": rows}


if __name__ == "__main__":
    main()
