"""`trainfit plan`, `trainfit fit` and `trainfit hardware`: registered on the CLI app by trainfit.app.cli when present."""

from __future__ import annotations

import json
from typing import List, Optional

import typer

from trainfit.app.working import working
from trainfit.config import ConfigError
from trainfit.core.extras import training_machine_line


def register(app: typer.Typer) -> None:
    app.command("plan")(plan_command)
    app.command("fit")(fit_command)
    app.command("hardware")(hardware_command)


def _check_outputs(as_json: bool = False, **opts: Optional[str]) -> None:
    """Exit 2 before any planning when a file option's folder does not exist (a user mistake, not a traceback)."""
    from pathlib import Path

    from trainfit.app.cli import fail

    for opt, value in opts.items():
        if value and not Path(value).resolve().parent.is_dir():
            fail(f"--{opt} {value}: the folder {Path(value).parent} does not exist; create it or pass a path in an "
                 f"existing folder, e.g. --{opt} plan.{opt}.", as_json=as_json)


def plan_command(
    config: str = typer.Argument(..., help="YAML config file."),
    overrides: Optional[List[str]] = typer.Argument(None, help="Overrides such as train.micro_batch_size=2."),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="GPU to plan for (h200, h100, a100-40gb, rtx4090, 48GB...)."),
    num_gpus: Optional[int] = typer.Option(None, "--num-gpus", min=1, help="GPUs per node (overrides distributed.num_gpus)."),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
    png: Optional[str] = typer.Option(None, "--png", help="Write a stacked bar chart per phase (a row per stage) to "
                                      "this PNG file."),
    html_out: Optional[str] = typer.Option(None, "--html", help="Write the plan as an offline HTML page (plotly): "
                                           "each phase a stacked bar against the card, one panel per stage."),
    margin: Optional[float] = typer.Option(None, "--margin", min=0.0, max=0.9, help="Share of the card kept free (default hardware.memory_margin)."),
) -> None:
    """Predict per-GPU memory of a training config, by component and phase, before anything runs.
    Runs the check `train` makes (trainfit/train/preflight.py) first; packages only the training machine
    needs (vLLM, bitsandbytes, DeepSpeed...) are listed, not required here. Exit code 0 when it fits (or
    the card is only assumed: none named or detected), 1 when any stage DOES NOT FIT, 2 on an error."""
    from trainfit.app.cli import err_console, fail, gpu_or_exit, load_or_exit

    _check_outputs(as_json, html=html_out, png=png)
    gpu_or_exit(gpu, as_json)
    cfg = load_or_exit(config, overrides, as_json)
    from trainfit.train.preflight import preflight  # the planner and its model code: after the checks that need none
    try:
        with working(err_console, f"plan: checking {config}"):
            ready = preflight(cfg, "plan", gpu=gpu, num_gpus=num_gpus, margin=margin)
    except ConfigError as e:
        fail(str(e), as_json=as_json)
    plans = ready.plans
    for p, needs in zip(plans, ready.training_machine):
        p.training_machine = needs
        # what the check found worth saying (a large file checked at its start, weights not here)
        p.notes.extend(n for n in ready.notes if n not in p.notes)
    _show_plans(plans, as_json, png, html_out, config)
    if ready.code:  # scripts can gate a launch on `trainfit plan`
        raise typer.Exit(1)


def _show_plans(plans: list, as_json: bool, png: Optional[str], html_out: Optional[str] = None,
                source: str = "") -> None:
    from trainfit.app.cli import console
    from trainfit.plan.report import render, to_json

    if as_json:  # one object, or a list for a pipeline of stages
        print(to_json(plans[0]) if len(plans) == 1 else "[" + ",\n".join(to_json(p) for p in plans) + "]")
    else:
        for p in plans:
            render(p, console)
    written = []
    if png:
        from trainfit.plan.chart_png import save_png   # matplotlib: imported only for --png

        save_png(plans, png)
        written.append(png)
    if html_out:
        from trainfit.app.plan_html import write_plan_html   # plotly: imported only for --html

        written.append(str(write_plan_html(plans, html_out, source)))
    if not as_json:
        for path in written:
            console.print(f"wrote {path}", highlight=False)


def hardware_command(
    config: str = typer.Argument(..., help="YAML config file."),
    overrides: Optional[List[str]] = typer.Argument(None, help="Overrides such as peft.method=lora."),
    as_json: bool = typer.Option(False, "--json", help="Print the ranking as JSON."),
    html_out: Optional[str] = typer.Option(None, "--html", help="Write the setups side by side (peak memory and "
                                           "estimated step time) as an offline HTML page."),
) -> None:
    """Rank GPU setups (catalog cards x 1, 2, 4, 8, and 2, 4, 8 nodes of 8 where one node does not fit) by fit
    and by an estimate of step time (the roofline with efficiencies measured on real GPUs; each row says
    what its estimate rests on)."""
    from rich.table import Table

    from trainfit.app.cli import console, err_console, fail, load_or_exit

    _check_outputs(as_json, html=html_out)
    cfg = load_or_exit(config, overrides, as_json)
    from trainfit.plan.setups import NODE_COUNTS, rank_setups  # after the config: a config error answers first
    try:
        with working(err_console, f"hardware: planning {config} on every card"):
            rows = rank_setups(cfg, nodes=NODE_COUNTS)
    except ConfigError as e:
        fail(str(e), as_json=as_json)
    if html_out:
        from trainfit.app.setups_html import write_hardware_html   # plotly: imported only for --html

        write_hardware_html(html_out, config, rows)
        if not as_json:
            console.print(f"wrote {html_out}", highlight=False)
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    t = Table(title=f"GPU setups for {cfg.model.name} ({cfg.stage}); step time is an estimate (the roofline "
              "with measured efficiencies), not a measurement", title_justify="left")
    for col, just in (("setup", "left"), ("peak GiB/GPU", "right"), ("budget GiB", "right"), ("fits", "left"),
                      ("est. step s", "right"), ("estimate basis", "left"), ("note", "left")):
        t.add_column(col, justify=just)
    for r in rows:
        fits = {True: "[green]yes[/]", False: "[red]no[/]", None: "-"}[r["fits"]]
        t.add_row(r["setup"], f"{r['peak_gb']:.1f}" if r["peak_gb"] else "-",
                  f"{r['budget_gb']:.1f}" if r["budget_gb"] else "-", fits,
                  f"{r['step_s']:.1f}" if r["step_s"] else "-", (r["step_basis"] or "-").split(":")[0], r["note"])
    console.print(t)
    # One line per basis, not per card: "uncalibrated on X: <how>" shares its <how>.
    for basis in dict.fromkeys(("uncalibrated cards: " if ": " in b else "") + b.split(": ", 1)[-1]
                               for r in rows if (b := r["step_basis"])):
        console.print(f"estimate basis: {basis}", highlight=False, markup=False)
    needs = training_machine_line([cfg])
    if needs:
        console.print(needs, highlight=False, markup=False, soft_wrap=True)


def fit_command(
    config: str = typer.Argument(..., help="YAML config file."),
    overrides: Optional[List[str]] = typer.Argument(None, help="Overrides such as rollout.max_new_tokens=512."),
    gpu: Optional[str] = typer.Option(None, "--gpu", help="GPU to fit (h200, h100, a100-40gb, rtx4090, 48GB...)."),
    num_gpus: Optional[int] = typer.Option(None, "--num-gpus", min=1, help="GPUs per node (overrides distributed.num_gpus)."),
    out_dir: Optional[str] = typer.Option(None, "-o", "--out", help="Folder for the fitted files (default: "
                                          "CONFIG-fit in the current directory, CONFIG the file's name without .yaml)."),
    allow_method: bool = typer.Option(False, "--allow-method", help="Allow LoRA instead of full fine-tuning and a "
                                      "4-bit base (QLoRA), when nothing fits with your method."),
    allow_offload: bool = typer.Option(False, "--allow-offload", help="Allow DeepSpeed ZeRO offload of optimizer "
                                       "state (and parameters), or FSDP2's offload of parameters, gradients and "
                                       "optimizer, to CPU RAM: slower, needs host RAM."),
    allow_optimizer: bool = typer.Option(False, "--allow-optimizer", help="Allow 8-bit AdamW (bitsandbytes) for full "
                                         "fine-tuning, when nothing fits with AdamW."),
    allow_screens: bool = typer.Option(False, "--allow-screens", help="Allow fewer kept environment screenshots "
                                       "(rollout.max_images_per_episode) and lower model.max_pixels, down to "
                                       "rollout.fit_min_images_per_episode and model.fit_min_pixels, when nothing "
                                       "else fits (they change what the agent sees)."),
    margin: Optional[float] = typer.Option(None, "--margin", min=0.0, max=0.9, help="Share of the card kept free "
                                           "(default hardware.memory_margin)."),
    cpu_ram_gb: Optional[float] = typer.Option(None, "--cpu-ram-gb", help="CPU RAM per node that offload may use (GiB)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    html_out: Optional[str] = typer.Option(None, "--html", help="Write your config and the fitted one side by side "
                                           "(peak memory, estimated step time, their plans) as an offline HTML page."),
) -> None:
    """Search micro-batch, checkpointing, ZeRO, offload, LoRA/QLoRA and rollout memory for the fastest
    plan that fits (and, with --allow-screens, the screenshots an episode keeps and their pixels), and
    write the fitted config with DeepSpeed / accelerate / launch files into CONFIG-fit/ in the current
    directory (-o DIR for another folder)."""
    from pathlib import Path

    from trainfit.app.cli import console, err_console, fail, gpu_or_exit, load_or_exit
    from trainfit.app.fit_report import explain, fit_dict, render_fit

    _check_outputs(as_json, html=html_out)
    gpu_or_exit(gpu, as_json)
    cfg = load_or_exit(config, overrides, as_json)
    from trainfit.app.export import export_all  # the planner and its model code: after the checks that need none
    from trainfit.plan.fit import Allow, fit
    out = Path(out_dir or f"{Path(config).stem}-fit")
    if not as_json:  # said before the search: where the files will go (JSON lists them under "files")
        where = f"{out}/" + ("" if out.is_absolute() else f" (in {Path.cwd()})")
        console.print(f"fit: if a config fits, it is written with its launch files to {where}; -o DIR chooses "
                      "the folder.", highlight=False, markup=False, soft_wrap=True)
    try:
        allow = Allow(allow_method, allow_offload, allow_optimizer, allow_screens)
        # Shown at once: a search always takes seconds, and a cold one imports torch for its traces.
        with working(err_console, f"fit: searching plans for {config}", after_s=0):
            res = fit(cfg, gpu=gpu, num_gpus=num_gpus, allow=allow, margin=margin, cpu_ram_gb=cpu_ram_gb)
    except ConfigError as e:
        fail(str(e), as_json=as_json)
    files = {}
    if res.best is not None:
        files = {k: str(v) for k, v in export_all(res.best.cfg, out).items()}
    reasons = explain(res, config)
    if html_out:
        from trainfit.app.setups_html import write_fit_html   # plotly: imported only for --html

        write_fit_html(html_out, config, res, reasons)
        if not as_json:
            console.print(f"wrote {html_out}", highlight=False)
    if as_json:
        print(json.dumps({**fit_dict(res), "reasons": reasons, "files": files}, indent=2, default=str))
    else:
        render_fit(res, reasons, files, console)
    if res.best is None:
        if not as_json:
            console.print(f"nothing written to {out}/: no config searched fits.", highlight=False, markup=False)
        raise typer.Exit(1)
