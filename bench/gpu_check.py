"""Every GPU check in one command: the measurements trainfit owes from a GPU machine, each under its
own time limit, each writing a JSON file; one summary table at the end.

    make gpu-check                                   # = python3 -m bench.gpu_check: every row, <= 9 minutes
    make gpu-check STEPS=plan-grid GPU_CHECK_OUT=$OUT          # the optional second command
    make gpu-check GPU_CHECK_DRY=1                   # CPU rehearsal: toy shapes, the same steps and files
    python3 -m bench.gpu_check --summary-only --out bench/results/gpu-check     # the table again

First it installs the wheels `make gpu-wheels` put in .gpu-kit/wheels (offline, into /tmp, on
PYTHONPATH for every step) and copies the SmolLM2 tokenizer (.gpu-kit/smollm2-tokenizer) where the
bench looks for it. Where the parts of `make gpu-vllm-kit` were carried (.gpu-kit/vllm/, one part a
call: bench/NOTES.md), it verifies and unpacks them too (bench/gpu_vllm_kit.py, into /tmp, on PYTHONPATH
after the wheels) and writes what imports (vllm-kit-import.json) before the first step. Steps (bench/gpu_steps.py), in groups (GROUPS there) run one after another:

  tests      the default suite and the gpu-marked tests, GPU visible, xdist across the cores; every
             outcome written as it happens (bench/pytest_live.py), so a cut run names its failures;
             the gpu-marked tests and the files not yet run on a GPU (FIRST_TESTS) first
  plan       planner vs trainer on the 9 recorded H100 cases, CUDA memory snapshots (bench/gpu_cases.py)
  plan-new   planner vs trainer on PPO with its four models, DPO, ZeRO-3 on one GPU, a VLM SFT step
  oom        real out-of-memory errors from oversized micro-batches in a capped share of the card, recovered
             -- these four side by side: the trainer cases share the card, admitted by their planned
             memory (bench/gpu_pool.py), while the tests use the CPU cores
  decode     decoding tokens/s: CUDA graphs (inductor; captured without code generation) and plain
             HF generate, against the card's bandwidth, and the first call's cost (bench/decode_speed.py)
                                                                                             -- alone
  sft        sft-gpu-1.7b, trainfit's MFU (bench/run.py)                                      -- alone
  grpo       grpo-gpu-0.5b against TRL, HF generation on both sides; then trainfit with
             train.padding_free=on against its default run                                   -- alone
  grpo-vllm  grpo-gpu-0.5b-vllm (colocated vLLM, asleep while training); not run without vllm
  plan-grid  bench/plan_accuracy.py's GPU grid (SFT steps, full / LoRA / QLoRA): not in the default
             command; the optional second one

A step that fails, times out or crashes is recorded and the next one starts: nothing stops the run.
Each step writes <out>/check-<step>.json: status, the rows of the summary table, details, the log
tail, and the machine (device, driver, torch, CUDA, package versions, commit). The whole command stays
inside --budget seconds (default 540 on a GPU): while a group runs, the time the later groups took on
an H100 (Step.expect_s) is kept for them; a step that cannot start with its minimum time left is
written as not-run, naming the command to run it in, and a case or test run cut at its limit is
`cut`, with what it measured. --tar packs every file into one archive (a machine that returns few files).
The rehearsal (--dry) runs everything on CPU at toy shapes, with CUDA hidden, and marks what only CUDA
can measure `rehearsal`; its files go to runs/gpu-check-dry/ unless --out says otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from bench import gpu_vllm_kit

ROOT = Path(__file__).resolve().parents[1]
KIT = ROOT / ".gpu-kit"
SITE = Path(tempfile.gettempdir()) / "trainfit-gpu-site"
RESERVE_S = 5                         # kept for writing the last JSON and the table (well under a second)
RANK = {"error": 0, "fail": 1, "cut": 2, "not-run": 2, "rehearsal": 3, "info": 4, "pass": 5}


@dataclass
class Ctx:
    dry: bool
    out: Path
    work: Path
    deadline: float
    env: dict = field(default_factory=dict)
    machine: dict = field(default_factory=dict)

    def left(self) -> float:
        return self.deadline - time.time() - RESERVE_S

    def run(self, cmd: list[str], timeout: float, log: str) -> dict:
        return run_limited(cmd, min(timeout, self.left()), self.env, self.work / "logs" / f"{log}.log")


def run_limited(cmd: list[str], timeout: float, env: dict, log: Path) -> dict:
    """Run `cmd` in its own process group; past `timeout` kill the whole group (torchrun ranks, bench
    sides). Output goes to `log`; the result keeps its last 4000 characters."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with open(log, "w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc, timed_out = proc.wait(timeout=max(timeout, 1.0)), False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc, timed_out = proc.wait(), True
    text = log.read_text(errors="replace")
    return {"cmd": " ".join(cmd), "rc": rc, "timed_out": timed_out, "seconds": round(time.time() - t0, 1),
            "limit_s": round(timeout), "tail": text[-4000:]}


def install_wheels() -> dict:
    """pip install the kit's wheels into SITE (offline, no dependency resolution: the kit chose them)."""
    wheels = sorted((KIT / "wheels").glob("*.whl"))
    if not wheels:
        return {"wheels": [], "note": f"no wheels in {KIT / 'wheels'} (run `make gpu-wheels` where PyPI is reachable)"}
    stamp = SITE / ".installed"
    names = [w.name for w in wheels]
    if stamp.exists() and json.loads(stamp.read_text()) == names:
        return {"wheels": names, "note": "already installed"}
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(SITE), *map(str, wheels)],
                       capture_output=True, text=True)
    if p.returncode == 0:
        stamp.write_text(json.dumps(names))
    return {"wheels": names, "rc": p.returncode, "seconds": round(time.time() - t0, 1), "log_tail": p.stderr[-2000:]}


def child_env(ctx: Ctx) -> dict:
    path = [str(p) for p in (SITE, gpu_vllm_kit.SITE) if p.is_dir()]
    path += [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    cache = ctx.work / "bench-cache"
    env.setdefault("TRAINFIT_BENCH_CACHE", str(cache))
    tok = Path(env["TRAINFIT_BENCH_CACHE"]) / "smollm2-tokenizer"
    if (KIT / "smollm2-tokenizer" / "tokenizer.json").is_file() and not tok.exists():
        shutil.copytree(KIT / "smollm2-tokenizer", tok)
    if gpu_vllm_kit.SITE.is_dir():
        env.update(gpu_vllm_kit.ENV)
    if ctx.dry:
        env.setdefault("OMP_NUM_THREADS", "1")
        env["CUDA_VISIBLE_DEVICES"] = ""   # the rehearsal is the CPU's, also on a machine with a GPU
    return env


MACHINE = """
import json, platform, importlib.metadata as md, torch
cuda = torch.cuda.is_available()
info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu", "device_count": torch.cuda.device_count()}
if cuda:
    p = torch.cuda.get_device_properties(0)
    info.update(capability=f"{p.major}.{p.minor}", memory_gib=round(p.total_memory / 2**30, 1))
pk = {}
for n in ("transformers", "peft", "accelerate", "trl", "datasets", "bitsandbytes", "deepspeed", "liger-kernel",
          "vllm", "pydantic", "triton"):
    try:
        pk[n] = md.version(n)
    except md.PackageNotFoundError:
        pk[n] = None
info["packages"] = pk
print(json.dumps(info))
"""


def machine(env: dict) -> dict:
    p = subprocess.run([sys.executable, "-c", MACHINE], env=env, capture_output=True, text=True, timeout=120)
    info = json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {"error": p.stderr[-1000:]}
    smi = shutil.which("nvidia-smi")
    if smi:
        q = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True)
        info["driver"] = q.stdout.strip().splitlines()[0] if q.returncode == 0 and q.stdout.strip() else None
    info.update(commit(), host=os.uname().nodename)
    return info


def commit() -> dict:
    """The commit: git where .git travelled; else $GPU_CHECK_COMMIT; else the one `make gpu-wheels` saw.
    `source_sha256` hashes trainfit/, bench/ and tests/ (*.py) so runs of the same code match anyway."""
    h = hashlib.sha256()
    for f in sorted(p for d in ("trainfit", "bench", "tests") for p in (ROOT / d).rglob("*.py")):
        h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes())
    out = {"source_sha256": h.hexdigest()[:16]}
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        if rev.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--", "trainfit", "bench"], cwd=ROOT,
                                   capture_output=True, text=True).stdout.strip()
            return {**out, "commit": rev.stdout.strip() + ("+uncommitted" if dirty else ""), "commit_from": "git"}
    except OSError:
        pass
    if os.environ.get("GPU_CHECK_COMMIT"):
        return {**out, "commit": os.environ["GPU_CHECK_COMMIT"], "commit_from": "GPU_CHECK_COMMIT"}
    manifest = KIT / "MANIFEST.json"
    if manifest.exists():
        m = json.loads(manifest.read_text())
        return {**out, "commit": m.get("commit"), "commit_from": f"make gpu-wheels at {m.get('created')}"}
    return {**out, "commit": None, "commit_from": None}


def status_of(rows: list[dict]) -> str:
    return min((r["result"] for r in rows), key=lambda s: RANK.get(s, 0)) if rows else "not-run"


def command_of(name: str) -> str:
    return f"make gpu-check STEPS={name}"


def run_group(ctx: Ctx, steps: list, later_s: float) -> list[dict]:
    """The steps of one group side by side, each under min(its limit, what is left after keeping
    `later_s` for the groups after it); steps of one batch share one call. A JSON file per step."""
    from bench.gpu_steps import BATCHES, STEPS

    t0, started = time.time(), now()
    window = ctx.left() - later_s
    calls, results = [], {}
    for step in steps:
        # The rehearsal has no budget, and its toy cases run one at a time on a CPU: 4x the GPU limits.
        # A window shorter than the step's minimum gives it its minimum, not more: the rest stays kept.
        limit = min(step.limit_s * (4 if ctx.dry else 1), max(window, step.min_s), ctx.left())
        if limit < step.min_s:
            why = (f"not started: {max(ctx.left(), 0):.0f} s left of this command's budget, the step needs at least "
                   f"{step.min_s} s; run it in a command of its own: {command_of(step.name)}")
            results[step.name] = {"rows": [{"check": step.name, "goal": step.goal, "measured": why, "result": "not-run"}]}
        elif step.batch:
            known = next((c for c in calls if c[0] == step.batch), None)
            if known:
                known[2].append(step.name)
                known[1] = min(known[1], limit)
            else:
                calls.append([step.batch, limit, [step.name]])
        else:
            calls.append([step.fn, limit, [step.name]])

    def call(fn, limit, names):
        try:
            if isinstance(fn, str):
                return BATCHES[fn](ctx, limit, names)
            return {names[0]: fn(ctx, limit)}
        except Exception:  # noqa: BLE001 - a broken step is a result; the next step still runs
            crash = traceback.format_exc()[-4000:]
            return {n: {"rows": [{"check": n, "goal": STEPS[n].goal, "measured": "the step crashed (see log_tail)",
                                  "result": "error"}], "log_tail": crash} for n in names}

    with ThreadPoolExecutor(max_workers=max(len(calls), 1)) as ex:
        for done in ex.map(lambda c: call(*c), calls):
            results.update(done)
    docs = []
    for step in steps:
        res = results[step.name]
        doc = {"check": step.name, "what": step.what, "rehearsal": ctx.dry, "started": started, "machine": ctx.machine,
               "limit_s": step.limit_s, "alongside": [s.name for s in steps if s is not step], **res,
               "status": status_of(res["rows"]), "seconds": round(time.time() - t0, 1)}
        (ctx.out / f"check-{step.name}.json").write_text(json.dumps(doc, indent=1, default=str))
        docs.append(doc)
    return docs


def pack(out: Path, tar: str) -> str:
    """Every file of `out` but the snapshots in one .tar.gz, for a machine that returns few files, written
    whole or not at all; the snapshots (up to 16 MiB each) are copied beside it."""
    part = Path(tar + ".partial")
    with tarfile.open(part, "w:gz") as t:
        for f in sorted(out.iterdir()):
            if f.is_file() and not f.name.endswith(".pickle.gz"):
                t.add(f, arcname=f.name)
    part.rename(tar)
    for snap in out.glob("*.pickle.gz"):
        if Path(tar).parent.resolve() != out.resolve():
            shutil.copy2(snap, Path(tar).parent / snap.name)
    return f"{tar} ({Path(tar).stat().st_size / 2**20:.1f} MiB)"


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def table(docs: list[dict]) -> str:
    rows = [("check", "goal", "measured", "result")]
    for d in docs:
        rows += [(r["check"], r["goal"], r["measured"], r["result"]) for r in d["rows"]]
    width = [min(max(len(str(r[i])) for r in rows), cap) for i, cap in enumerate((44, 50, 100, 9))]

    def cut(s, w):
        s = str(s).replace("\n", " ")
        return s if len(s) <= w else s[: w - 1] + "~"

    lines = ["| " + " | ".join(cut(c, w).ljust(w) for c, w in zip(r, width)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in width) + "|")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from bench.gpu_steps import DEFAULT, GROUPS, STEPS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default="", help=f"comma-separated, in any order (default all): {', '.join(STEPS)}")
    ap.add_argument("--dry", action="store_true", help="CPU rehearsal at toy shapes")
    ap.add_argument("--out", default="", help="where the JSON files go (default bench/results/gpu-check, or "
                                               "runs/gpu-check-dry with --dry)")
    ap.add_argument("--work", default="", help="scratch (models, runs, logs); default under the temp dir")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds for the whole command (default $GPU_CHECK_BUDGET, else 540; 0 = no limit)")
    ap.add_argument("--summary-only", action="store_true", help="print the table of the JSON files in --out")
    ap.add_argument("--tar", default="", help="also pack every file of --out into this .tar.gz at the end")
    args = ap.parse_args(argv)
    out = Path(args.out or (ROOT / ("runs/gpu-check-dry" if args.dry else "bench/results/gpu-check")))
    if args.summary_only:
        docs = [json.loads(p.read_text()) for p in sorted(out.glob("check-*.json"))]
        docs.sort(key=lambda d: list(STEPS).index(d["check"]) if d["check"] in STEPS else 99)
        print(table(docs))
        return 0
    names = [s for s in args.steps.split(",") if s] or list(DEFAULT)
    unknown = [s for s in names if s not in STEPS]
    if unknown:
        ap.error(f"unknown step(s) {unknown}; choose from {', '.join(STEPS)}")
    budget = args.budget if args.budget is not None else float(os.environ.get("GPU_CHECK_BUDGET", 0 if args.dry else 540))
    t0 = time.time()
    work = Path(args.work or Path(tempfile.gettempdir()) / ("trainfit-gpu-check-dry" if args.dry else "trainfit-gpu-check"))
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(dry=args.dry, out=out, work=work, deadline=t0 + budget if budget > 0 else float("inf"))
    install = {"note": "rehearsal: nothing installed"} if args.dry else install_wheels()
    if not args.dry:
        install["vllm_kit"] = gpu_vllm_kit.install()
    ctx.env = child_env(ctx)
    for site in () if args.dry else (gpu_vllm_kit.SITE, SITE):   # a rehearsal imports nothing from a kit left here
        if site.is_dir() and str(site) not in sys.path:
            sys.path.insert(0, str(site))  # the steps ask whether trl, vllm, xdist are importable
    if install.get("vllm_kit", {}).get("installed"):   # how far vllm imports, before any step needs it
        doc = gpu_vllm_kit.check(sys.executable, None, out / "vllm-kit-import.json", env=ctx.env,
                                 timeout=min(180, max(ctx.left(), 1)))
        install["vllm_kit"]["first_stop"] = doc["first_stop"]
    ctx.machine = {**machine(ctx.env), "install": install}
    print(f"gpu-check: {', '.join(names)} on {ctx.machine.get('device')} (torch {ctx.machine.get('torch')}, CUDA "
          f"{ctx.machine.get('cuda')}), budget {budget:.0f} s, out {out}", flush=True)
    docs = []
    groups = [[STEPS[n] for n in g if n in names] for g in GROUPS]
    groups = [g for g in groups if g]
    for i, group in enumerate(groups):
        later = sum(s.expect_s for g in groups[i + 1:] for s in g)
        print(f"--- {', '.join(s.name for s in group)} ({max(ctx.left(), 0):.0f} s left, {later:.0f} s kept for "
              "what follows)", flush=True)
        for d in run_group(ctx, group, later):
            docs.append(d)
            print(f"    {d['check']}: {d['status']} in {d['seconds']} s -> {out / ('check-' + d['check'] + '.json')}",
                  flush=True)
        if args.tar:   # after every group: a command killed later still leaves what was measured
            pack(out, args.tar)
    print(table(docs))
    files = sorted(f for f in out.iterdir() if f.is_file())
    print(f"total {time.time() - t0:.0f} s; {len(files)} files in {out}")
    if args.tar:
        print(f"packed into {pack(out, args.tar)}")
    # Failed measurements are results, but a crashed step is a broken kit, and so is any failure of
    # the rehearsal (toy shapes on CPU have no goals to miss): CI runs it (.ci/run).
    broken = [d["check"] for d in docs if d["status"] == "error" or (ctx.dry and d["status"] == "fail")]
    if broken:
        print(f"broken: {', '.join(broken)} (see their JSON files' log tails and {work / 'logs'})")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
