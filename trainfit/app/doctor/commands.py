"""`trainfit doctor` and `trainfit export`: registered on the CLI app by trainfit.app.cli when present."""

from __future__ import annotations

import json
from typing import List, Optional

import typer
from rich.markup import escape

from trainfit.app.doctor.findings import Report
from trainfit.config.words import count
from trainfit.plan.items import gib

_STYLE = {"error": "bold red", "warning": "yellow", "info": "cyan"}


def register(app: typer.Typer) -> None:
    app.command("doctor")(doctor_command)
    app.command("export")(export_command)


def doctor_command(
    files: Optional[List[str]] = typer.Argument(None, help="Files to lint as one job: trainfit YAML, DeepSpeed JSON, "
                                                "accelerate YAML, vLLM args (YAML/JSON or a `vllm serve` line), "
                                                "launch lines (.sh/.txt), training scripts (.py)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    num_gpus: Optional[int] = typer.Option(None, "--num-gpus", min=1, help="GPUs per node the job runs on (sets the "
                                           "world size the files are checked against)."),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="Card to check memory against (h200, h100, a100-40gb, 48GB...)."),
    model: Optional[str] = typer.Option(None, "--model", help="Model the files are for, when none of them names it."),
    cpu_ram_gb: Optional[float] = typer.Option(None, "--cpu-ram-gb", help="CPU RAM of a training node (default: this "
                                               "machine's, trusted only when it has GPUs)."),
    no_plan: bool = typer.Option(False, "--no-plan", help="Skip the memory planner (faster on a cold cache)."),
    no_machine: bool = typer.Option(False, "--no-machine", help="Skip the checks of this machine (lint only, for CI)."),
) -> None:
    """Check this machine (GPUs, drivers, NCCL, memory, ports, extras) and lint configs; exit 1 on any error."""
    from trainfit.app.cli import console, gpu_or_exit
    from trainfit.app.doctor import Options, run

    gpu_or_exit(gpu, as_json)
    opts = Options(num_gpus=num_gpus, gpu=gpu, model=model, cpu_ram_gb=cpu_ram_gb, plan=not no_plan)
    report = run(files or [], opts, machine=not no_machine)
    if as_json:
        print(json.dumps(report.to_dict(), indent=2, default=str))
    else:
        render(report, console)
    raise typer.Exit(report.exit_code)


def _gib(v: Optional[float]) -> str:
    """CPU RAM in the unit plans and findings print it."""
    return "?" if v is None else f"{gib(v)} GiB"


def render(report: Report, console) -> None:
    m = report.machine
    if m:
        t = m["torch"]
        build = "not installed" if not t["installed"] else (
            f"{t['version']} (" + (f"CUDA {t['cuda']}" if t["cuda"] else f"ROCm {t['hip']}" if t["hip"] else "CPU-only")
            + " build)")
        console.print("[bold]Machine[/]")
        console.print(f"  Python {m['python']}   torch {build}   NCCL {m['nccl'] or 'not found'}   driver "
                      f"{m['driver'] or 'none'}" + (f" (CUDA {m['cuda_driver']})" if m["cuda_driver"] else ""),
                      highlight=False, soft_wrap=True)
        if m["gpus"]:
            for g in m["gpus"]:
                procs = ", ".join(f"{p['name']}:{p['pid']} ({p['used_gb'] if p['used_gb'] is not None else '?'} GB)"
                                  for p in g["processes"]) or "no processes"
                console.print(f"  GPU {g['index']}: {g['name']}  {g['total_gb']:.1f} GB total, {g['used_gb']:.1f} used, "
                              f"{g['free_gb']:.1f} free  (sm {g['compute_capability']}; {procs})", highlight=False, soft_wrap=True)
            if m["cuda_visible_devices"] is not None:
                console.print(f"  CUDA_VISIBLE_DEVICES={m['cuda_visible_devices']} ({m['visible_gpus']} visible)",
                              highlight=False, soft_wrap=True)
        else:
            console.print(f"  [bold]No GPU[/]: {m['gpu_status']}.", highlight=False, soft_wrap=True)
        ram = m["cpu_ram"]
        console.print(f"  CPU RAM {_gib(ram['total'])} total, {_gib(ram['available'])} available   "
                      f"{m['alloc_conf']['variable']}={m['alloc_conf']['value'] or '(unset)'}   port "
                      f"{m['port']['port']} {'free' if m['port']['free'] else 'IN USE'}", highlight=False, soft_wrap=True)
        console.print("  extras: " + ", ".join(f"{k} {v or 'missing'}" for k, v in m["extras"].items()),
                      highlight=False, soft_wrap=True)
    if report.files:
        console.print("[bold]Files[/]")
        for f in report.files:
            console.print(f"  {f['path']} ({f['kind']})", highlight=False, soft_wrap=True)
    if report.findings:
        console.print("[bold]Findings[/]")
    for f in report.sorted():
        where = f" ({escape(f.file)})" if f.file else ""
        console.print(f"  [{_STYLE[f.severity]}]{f.severity.upper()}[/] {f.code}{where}: {escape(f.message)}",
                      highlight=False, soft_wrap=True)
        console.print(f"      fix: {escape(f.fix)}", highlight=False, soft_wrap=True)
    n = {s: report.count(s) for s in _STYLE}
    console.print(f"{count(n['error'], 'error')}, {count(n['warning'], 'warning')}, {n['info']} info", highlight=False,
                  soft_wrap=True)


def export_command(
    config: str = typer.Argument(..., help="trainfit YAML config."),
    overrides: Optional[List[str]] = typer.Argument(None, help="Overrides such as distributed.num_gpus=4."),
    out_dir: str = typer.Option(..., "-o", "--out", help="Folder to write into (created if missing)."),
) -> None:
    """Write DeepSpeed JSON, accelerate YAML and a launch script consistent with one trainfit config."""
    from trainfit.app.cli import console, fail, load_or_exit
    from trainfit.config import ConfigError
    from trainfit.app.doctor import Options, lint_docs
    from trainfit.app.doctor.files import load_doc
    from trainfit.app.export import export_all

    cfg = load_or_exit(config, overrides)
    try:
        files = export_all(cfg, out_dir)  # refuses what `trainfit train` would refuse
    except ConfigError as e:
        fail(f"not exported: {e}")
    console.print(f"{cfg.batch_plan().describe()}", highlight=False, soft_wrap=True)
    for kind, path in files.items():
        console.print(f"  wrote {path} ({kind})", highlight=False, soft_wrap=True)
    # The files are consistent by construction; linting them here keeps that promise checked.
    errors = [f for f in lint_docs([load_doc(str(p)) for p in files.values()], Options(plan=False), {})
              if f.severity == "error"]
    if errors:
        fail("the exported files do not pass `trainfit doctor` (a bug in trainfit export): "
             + "; ".join(f"{f.code}: {f.message}" for f in errors), code=1)
