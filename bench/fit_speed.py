"""How long `trainfit fit` takes on a multi-node search, and what it finds for published recipes.

    .venv/bin/python bench/fit_speed.py [multinode] [recipes] [--repeat 2]

multinode: issue 48's command (Qwen2.5-72B GRPO, full fine-tune, vLLM, 4 nodes x 8 H100), each run a fresh
process as a user runs it: cold (an empty TRAINFIT_CACHE: the architecture is traced) then warm. Wall
and CPU seconds, planner calls, what was skipped and why, the fitted knobs, and whether `trainfit train
--dry-run`'s checks accept the fitted config (preflight without the plan, the vllm package counted as
installed: it is the training machine's). Target: <= 30 s cold on a quiet 2-core machine.
-> bench/results/fit_speed.json

recipes: each examples/recipes/*.yaml fitted on its own card and GPU count (in-process, warm after the
first plan of each model): the recipe as written against fit's choice (estimated step time, peak), and
the dry-run check of the fitted config. -> bench/results/recipes_fit.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
COMMAND = ["examples/grpo_gsm8k.yaml", "model.name=Qwen/Qwen2.5-72B-Instruct", "peft.method=none",
           "rollout.engine=vllm", "distributed.num_nodes=4", "train.global_batch_size=512",
           "--gpu", "h100", "--num-gpus", "8"]
# `trainfit train --dry-run`'s checks on a config, in a fresh process: the vllm package counted as installed (the
# training machine's) and the catalog's config.json of each hub model in a Hugging Face cache of its own (the
# weights are the training machine's too), as tests/conftest.py's hub_cache does.
DRY_RUN = """
import json, os, sys
from pathlib import Path
root = Path(os.environ["HF_HUB_CACHE"])
from trainfit.core import extras
extras.installed = lambda module: True
from trainfit.config import expand_stages, load_config
from trainfit.models.catalog import catalog_entries, catalog_lookup
from trainfit.train import storage
from trainfit.train.preflight import preflight
# The run dir's disk as the training machine's (a 70B final model is ~130 GiB): the config is judged, not this disk.
storage.free_bytes = lambda path: 2 ** 50
cfg = load_config(sys.argv[1])
for s in expand_stages(cfg):
    for name in (s.model.name, s.rl_models.reward_model, s.rl_models.value_model):
        stem = catalog_lookup(name) if name else None
        if stem:
            snap = root / ("models--" + name.replace("/", "--")) / "snapshots" / ("0" * 40)
            snap.mkdir(parents=True, exist_ok=True)
            (snap / "config.json").write_text(json.dumps(catalog_entries()[stem]["config"]))
            (snap.parents[1] / "refs").mkdir(exist_ok=True)
            (snap.parents[1] / "refs" / "main").write_text("0" * 40)
preflight(cfg, "dry-run", plan=False)
print("accepted")
"""


def _env(cache: Path) -> dict:
    return dict(os.environ, TRAINFIT_CACHE=str(cache), HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT), COLUMNS="200")


def dry_run_accepts(config: Path, env: dict) -> tuple[bool, str]:
    """`trainfit train --dry-run`'s config checks on a fitted config, in a fresh process."""
    env = dict(env, HF_HUB_CACHE=tempfile.mkdtemp(prefix="trainfit-hub-"), HF_HUB_OFFLINE="1")
    p = subprocess.run([sys.executable, "-c", DRY_RUN, str(config)], env=env, capture_output=True, text=True, cwd=ROOT)
    return p.returncode == 0 and "accepted" in p.stdout, (p.stdout + p.stderr).strip()[-400:]


def _timed_fit(out: Path, env: dict) -> dict:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "trainfit.app.cli", "fit", *COMMAND, "-o", str(out), "--json"],
                       env=env, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    res = json.loads(p.stdout) if p.stdout.strip().startswith("{") else {}
    fitted = res.get("fitted") or {}
    return {"exit": p.returncode, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "fits": res.get("fits"),
            "plan_calls": res.get("plan_calls"), "pruned_combinations": res.get("pruned_combinations"),
            "skipped": res.get("skipped"), "search_s": round(res.get("seconds") or 0, 2),
            "fitted_overrides": fitted.get("overrides"), "fitted_peak_gib": fitted.get("peak_gib"),
            "fitted_step_s": fitted.get("step_s_estimate")}


def multinode(repeat: int) -> dict:
    runs = []
    for i in range(repeat):
        work = Path(tempfile.mkdtemp(prefix="trainfit-fit-speed-"))
        env = _env(work / "cache")
        cold, warm = _timed_fit(work / "cold", env), _timed_fit(work / "warm", env)
        ok, said = dry_run_accepts(work / "cold" / "config.yaml", env) if cold["fits"] else (False, "nothing fitted")
        runs.append({"cold": cold, "warm": warm, "dry_run_accepts": ok, "dry_run_said": said})
    return {"command": "trainfit fit " + " ".join(COMMAND), "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "load_average_at_end": os.getloadavg(), "runs": runs,
            "cold_wall_s": [r["cold"]["wall_s"] for r in runs], "cold_cpu_s": [r["cold"]["cpu_s"] for r in runs],
            "warm_wall_s": [r["warm"]["wall_s"] for r in runs], "warm_cpu_s": [r["warm"]["cpu_s"] for r in runs]}


def recipes() -> dict:
    from trainfit.config import load_config, to_yaml
    from trainfit.plan.fit import fit

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    work = Path(tempfile.mkdtemp(prefix="trainfit-recipes-"))
    rows = []
    for path in sorted((ROOT / "examples" / "recipes").glob("*.yaml")):
        cfg = load_config(path)
        t = time.perf_counter()
        r = fit(cfg)
        row = {"recipe": path.name, "gpu": r.card.key, "gpus": cfg.world_size,
               "recipe_fits": bool(r.user and r.user.fits),
               "recipe_peak_gib": round(r.user.plan.peak / 2**30, 1) if r.user else None,
               "recipe_step_s": round(r.user.step.total, 2) if r.user else None, "fit_finds": r.best is not None,
               "fit_seconds": round(time.perf_counter() - t, 2), "plan_calls": r.plan_calls, "skipped": r.skipped}
        if r.best is not None:
            row.update(fitted_peak_gib=round(r.best.plan.peak / 2**30, 1), fitted_step_s=round(r.best.step.total, 2),
                       fitted_overrides=[f"{k}={v}" for k, v in r.best.overrides.items()],
                       no_slower=r.user is None or not r.user.fits or r.best.step.total <= r.user.step.total * 1.0001)
            out = work / path.stem / "config.yaml"
            out.parent.mkdir(parents=True)
            out.write_text(to_yaml(r.best.cfg))
            row["dry_run_accepts"], said = dry_run_accepts(out, dict(os.environ, PYTHONPATH=str(ROOT)))
            if not row["dry_run_accepts"]:
                row["dry_run_said"] = said
        elif r.closest is not None:
            row["closest_peak_gib"] = round(r.closest.plan.peak / 2**30, 1)
            row["closest_problems"] = r.closest.plan.problems
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "recipes": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", nargs="*", default=["multinode", "recipes"])
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    if "multinode" in args.what:
        res = multinode(args.repeat)
        (RESULTS / "fit_speed.json").write_text(json.dumps(res, indent=2) + "\n")
        print(json.dumps(res, indent=2))
    if "recipes" in args.what:
        res = recipes()
        (RESULTS / "recipes_fit.json").write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
