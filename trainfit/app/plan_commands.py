"""`trainfit plan`, `trainfit fit` and `trainfit hardware`: registered on the CLI app by trainfit.app.cli when present."""

from __future__ import annotations

import json
from typing import List, Optional

import typer

from trainfit.config.stages import stage_spec
from trainfit.app.working import working
from trainfit.config import ConfigError
from trainfit.core.extras import training_machine_line


def register(app: typer.Typer) -> None:
    app.command("plan")(plan_command)
    app.command("fit")(fit_command)
    app.command("hardware")(hardware_command)


def _check_outputs(**opts: Optional[str]) -> None:
    """Exit 2 before any planning when a file option's folder does not exist (a user mistake, not a traceback)."""
    from pathlib import Path

    from trainfit.app.cli import fail

    for opt, value in opts.items():
        if value and not Path(value).resolve().parent.is_dir():
            fail(f"--{opt} {value}: the folder {Path(value).parent} does not exist; create it or pass a path in an "
                 f"existing folder, e.g. --{opt} plan.{opt}.")


def _check_gpu(gpu: Optional[str]) -> None:
    """Exit 2 at once on a --gpu the catalog does not know, before the data and the models are looked at."""
    from trainfit.app.cli import fail
    from trainfit.plan.hardware import find_gpu

    if gpu:
        try:
            find_gpu(gpu)
        except (ValueError, ConfigError) as e:
            fail(str(e))


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
    from trainfit.app.cli import err_console, fail, load_or_exit

    _check_outputs(html=html_out, png=png)
    cfg = load_or_exit(config, overrides)
    _check_gpu(gpu)
    from trainfit.train.preflight import preflight  # after the config: a config error answers before it loads
    try:
        with working(err_console, f"plan: checking {config}"):
            ready = preflight(cfg, "plan", gpu=gpu, num_gpus=num_gpus, margin=margin)
    except ConfigError as e:
        fail(str(e))
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
    from trainfit.plan.report import render, save_png, to_json

    if as_json:  # one object, or a list for a pipeline of stages
        print(to_json(plans[0]) if len(plans) == 1 else "[" + ",\n".join(to_json(p) for p in plans) + "]")
    else:
        for p in plans:
            render(p, console)
    written = []
    if png:
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
    """Rank GPU setups (catalog cards x 1, 2, 4, 8) by fit and by an estimate of step time (the roofline
    with efficiencies measured on real GPUs; each row says what its estimate rests on)."""
    from rich.table import Table

    from trainfit.app.cli import console, err_console, fail, load_or_exit

    _check_outputs(html=html_out)
    cfg = load_or_exit(config, overrides)
    from trainfit.plan.setups import rank_setups  # after the config: a config error answers before it loads
    try:
        with working(err_console, f"hardware: planning {config} on every card"):
            rows = rank_setups(cfg)
    except ConfigError as e:
        fail(str(e))
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
                                       "state (and parameters) to CPU RAM: slower, needs host RAM."),
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

    from trainfit.app.cli import console, err_console, fail, load_or_exit

    _check_outputs(html=html_out)
    cfg = load_or_exit(config, overrides)
    _check_gpu(gpu)
    from trainfit.app.export import export_all  # after the config: a config error answers before they load
    from trainfit.plan.fit import Allow, fit
    out = Path(out_dir or f"{Path(config).stem}-fit")
    if not as_json:  # said before the search: where the files will go (JSON lists them under "files")
        where = f"{out}/" + ("" if out.is_absolute() else f" (in {Path.cwd()})")
        console.print(f"fit: a config that fits is written with its launch files to {where}; -o DIR chooses "
                      "the folder.", highlight=False, markup=False, soft_wrap=True)
    try:
        allow = Allow(allow_method, allow_offload, allow_optimizer, allow_screens)
        # Shown at once: a search always takes seconds, and a cold one imports torch for its traces.
        with working(err_console, f"fit: searching plans for {config}", after_s=0):
            res = fit(cfg, gpu=gpu, num_gpus=num_gpus, allow=allow, margin=margin, cpu_ram_gb=cpu_ram_gb)
    except ConfigError as e:
        fail(str(e))
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
        raise typer.Exit(1)


GiB = 2 ** 30


def knobs(cfg) -> dict[str, str]:
    """The knobs `fit` searches, in short words (rows of the table; `changes` compares them)."""
    from trainfit.models.shapes import arch_facts, model_source
    from trainfit.plan.screens import kept_screens, plans_screens

    bp, d, m, pe, r = cfg.batch_plan(), cfg.distributed, cfg.model, cfg.peft, cfg.rollout
    eng = cfg.engine()
    par = {"single": "single GPU", "ddp": "DDP", "fsdp": "FSDP"}.get(eng) or f"DeepSpeed ZeRO-{d.zero_stage}"
    if eng in ("deepspeed", "fsdp") and d.offload_optimizer:
        par += " + optimizer offload"
    if eng in ("deepspeed", "fsdp") and d.offload_params and (eng == "fsdp" or d.zero_stage == 3):
        par += " + parameter offload"
    method = "full" if pe.method == "none" else f"{'LoRA' if pe.method == 'lora' else 'DoRA'} r={pe.r}"
    if m.quantization != "none":
        method = ("Q" if pe.method == "lora" else "") + method + f" ({m.quantization} base)"
    out = {"micro-batch": f"{bp.micro_batch} x accum {bp.accumulation} x {bp.world_size} GPU",
           "gradient checkpointing": "on" if m.gradient_checkpointing else "off",
           "log-probs in chunks": f"{cfg.train.logits_chunk_rows} rows" if cfg.train.logits_chunk_rows else "off",
           "parallelism": par, "method": method, "optimizer": cfg.train.optimizer}
    rl = stage_spec(cfg.stage).rollout
    if rl and r.engine == "vllm":
        out["vLLM memory share"] = f"{r.gpu_memory_utilization:.0%}"
        out["vLLM sleep level"] = str(r.sleep_level)
    elif rl and r.engine == "hf":
        out["sequences generated together"] = str(min(r.batch_size or bp.per_device_batch, bp.per_device_batch))
    if plans_screens(cfg, arch_facts(model_source(m))):
        out["screenshots kept an episode"] = str(kept_screens(r))
        out["screenshot max_pixels"] = str(m.max_pixels or "processor default")
    return out


def changes(a, b) -> list[tuple[str, str, str]]:
    ka, kb = knobs(a), knobs(b)
    return [(k, ka.get(k, "-"), v) for k, v in kb.items() if ka.get(k) != v]


def fit_dict(res) -> dict:
    from trainfit.plan.fit import override_list
    from trainfit.plan.memory import verdict

    def side(c):
        if c is None:
            return None
        p = c.plan
        return {"verdict": verdict(p), "peak_gib": p.peak / GiB, "budget_gib": (p.budget or 0) / GiB,
                "headroom_gib": (p.headroom or 0) / GiB, "cpu_ram_gib": p.cpu_ram / GiB, "problems": p.problems,
                "step_s_estimate": c.step.total, "step_s_basis": c.step.basis, "rollout_s_estimate": c.step.rollout,
                "train_s_estimate": c.step.train, "comm_s_estimate": c.step.comm, "tier": c.tier,
                "knobs": knobs(c.cfg), "changes": changes(res.user.cfg, c.cfg) if res.user else [],
                "overrides": override_list(c.overrides)}
    return {"gpu": res.card.name, "gpu_key": res.card.key, "gpu_source": res.how, "fits": res.best is not None,
            "user": side(res.user), "fitted": side(res.best), "closest": side(res.closest),
            "missing_gib": res.missing / GiB, "would_fit_with": res.would_fit_with, "plan_calls": res.plan_calls,
            "pruned_combinations": res.pruned, "seconds": res.seconds, "screens_floor": res.screens_floor,
            "splits": [o.to_dict() for o in res.splits],
            "split_suggestion": res.split_pick.to_dict() if res.split_pick else None,
            "step_time_note": f"estimate ({_basis(res)}): the roofline with efficiency constants measured on "
                              "real GPUs (trainfit/plan/steptime.py), not a measurement"}


def _basis(res) -> str:
    """What the step-time estimates of a fit rest on (one card, so one basis)."""
    c = res.best or res.user or res.closest
    return c.step.basis if c is not None else "roofline, uncalibrated"


def _why(knob: str, u, b) -> str:
    """Why a knob moved, from the two configs (u: the user's, b: the fitted one)."""
    ub, bb = u.batch_plan(), b.batch_plan()
    if knob == "micro-batch":
        if bb.micro_batch > ub.micro_batch:
            return "fewer micro-steps per optimizer step read the weights fewer times; same global batch, same gradient"
        return (f"a smaller micro-batch holds fewer activations; accumulation {bb.accumulation} keeps the global batch "
                f"{bb.global_batch} (same gradient)")
    if knob == "gradient checkpointing":
        if b.model.gradient_checkpointing:
            return "only each layer's input is kept for backward; needed to fit"
        return "it fits without, and skips recomputing the forward in backward (about a third more training FLOPs)"
    if knob == "log-probs in chunks":
        return "no full fp32 [tokens, vocab] copy of the logits is kept for backward; same math"
    if knob == "parallelism":
        d = b.distributed
        if d.offload_params:
            return "parameters live in CPU RAM and cross PCIe in every forward and backward (the slowest option)"
        if d.offload_optimizer:
            return "optimizer state and fp32 master weights move to CPU RAM (DeepSpeed CPU Adam, PCIe in the estimate)"
        if u.distributed.offload_optimizer or u.distributed.offload_params:
            return "it fits without offload, so nothing crosses PCIe"
        return f"ZeRO-{d.zero_stage} partitions {['no', 'optimizer', 'optimizer and gradient', 'all'][d.zero_stage]} " \
               f"states over {bb.world_size} GPUs"
    if knob == "method":
        return "no plan with your method fits (allowed by --allow-method)"
    if knob == "optimizer":
        return "no plan with AdamW fits; 8-bit moments take a quarter of the bytes (allowed by --allow-optimizer)"
    if knob == "vLLM memory share":
        if b.rollout.gpu_memory_utilization < u.rollout.gpu_memory_utilization:
            return "the rollout phase (the engine's share and the resident policy) must fit the card"
        return "more KV cache for the engine, so fewer generation waves; the rollout phase still fits"
    if knob == "vLLM sleep level":
        return "a sleeping engine releases its share while the policy trains"
    if knob in ("screenshots kept an episode", "screenshot max_pixels"):
        return ("no plan with your screenshots fits (allowed by --allow-screens): the setting that fits with the most "
                "image tokens an episode, then the most pixels a screenshot; the agent sees less, not below "
                f"rollout.fit_min_images_per_episode={b.rollout.fit_min_images_per_episode}"
                + (f" and model.fit_min_pixels={b.model.fit_min_pixels}" if b.model.fit_min_pixels else ""))
    if knob == "sequences generated together":
        if (b.rollout.batch_size or bb.per_device_batch) > (u.rollout.batch_size or ub.per_device_batch):
            return "more sequences per decode step share each read of the weights"
        return "fewer sequences at a time hold less KV cache"
    return "needed to fit"


_WHAT = ("peft.method", "model.quantization", "train.optimizer")  # keys that change what is trained


def explain(res, path: str = "CONFIG") -> list[str]:
    """Reason lines: the user's verdict, each change and why, and the estimate's caveat."""
    from trainfit.plan.fit import override_list
    from trainfit.plan.memory import verdict
    from trainfit.plan.split import describe_splits

    out: list[str] = []
    u, b = res.user, res.best
    if res.micro_clamped_from:
        out.append(f"train.micro_batch_size={res.micro_clamped_from} does not divide the per-GPU batch "
                   f"{u.cfg.batch_plan().per_device_batch} on {u.cfg.world_size} GPUs: your config is shown with "
                   f"micro-batch {u.cfg.train.micro_batch_size}.")
    if res.how == "assumed":
        out.append(f"No GPU given or detected: fitted for {res.card.name}; pass --gpu NAME.")
    if u is not None:
        p = u.plan
        if p.fits:
            out.append(f"Your config fits {res.card.name}: peak {p.peak / GiB:.1f} GiB of a {p.budget / GiB:.1f} GiB "
                       f"budget (estimated step {u.step.total:.1f} s).")
        elif verdict(p) == "DOES NOT RUN":
            out.append(f"Your config does not run as configured on {res.card.name}: "
                       + "; ".join(prob.rstrip(".") for prob in p.problems) + f" (memory is not the problem: peak "
                       f"{p.peak / GiB:.1f} GiB within the {p.budget / GiB:.1f} GiB budget).")
        else:
            over = f"{(p.peak - p.budget) / GiB:.1f} GiB over" if p.peak > p.budget else "within"
            out.append(f"Your config does not fit {res.card.name}: peak {p.peak / GiB:.1f} GiB, {over} the "
                       f"{p.budget / GiB:.1f} GiB budget" + "".join(f"; {prob.rstrip('.')}" for prob in p.problems) + ".")
    if b is not None:
        diff = changes(u.cfg, b.cfg) if u else []
        if not diff:
            out.append("Nothing searched is faster by more than 1% (estimate): your settings are kept.")
        for knob, before, after in diff:
            out.append(f"{knob}: {before} -> {after}: {_why(knob, u.cfg, b.cfg)}.")
        for a in res.alternatives:
            what = {k: v for k, v in a.overrides.items() if k in _WHAT}
            m = knobs(a.cfg)["method"] + (f", {a.cfg.train.optimizer}" if "train.optimizer" in what else "")
            out.append(f"Faster but changes what is trained: {m} (estimated step {a.step.total:.1f} s vs "
                       f"{b.step.total:.1f} s); your method is kept because it fits. To fit that instead: "
                       f"trainfit fit {path} " + " ".join(override_list(what)))
        out += describe_splits(res.splits, res.split_pick)
        if b.cfg.distributed.offload_optimizer or b.cfg.distributed.offload_params:
            out.append(f"Offload needs about {b.plan.cpu_ram / GiB:.0f} GiB of CPU RAM per node.")
        if u is not None:
            out.append(f"Estimated step {b.step.total:.1f} s (rollout {b.step.rollout:.1f}, train {b.step.train:.1f}, "
                       f"comm/offload {b.step.comm:.1f}) vs {u.step.total:.1f} s for yours.")
    else:
        c = res.closest
        if c is None:
            out.append(f"Nothing fits {res.card.name}: no config searched could be planned.")
        else:
            out.append(f"Nothing fits {res.card.name} with the knobs searched. Closest: {c.plan.peak / GiB:.1f} GiB "
                       f"peak, {res.missing / GiB:.1f} GiB missing ("
                       + ", ".join(f"{k} {v}" for k, v in knobs(c.cfg).items()) + ")"
                       + "".join(f"; {prob.rstrip('.')}" for prob in c.plan.problems) + ".")
        if res.screens_floor:
            out.append(f"Screenshots were searched down to their floors ({res.screens_floor}) and nothing fits; "
                       "lower those floors to let fit show the agent less.")
        if res.would_fit_with:
            out.append(f"It would fit with {' '.join(res.would_fit_with)}.")
        out.append(f"`trainfit hardware {path}` ranks other cards and GPU counts.")
    shown = b or res.closest or u
    needs = training_machine_line([shown.cfg]) if shown is not None else None
    if needs:
        out.append(needs[0].upper() + needs[1:] + ".")
    out.append(f"Step times are estimates ({_basis(res)}): the roofline corrected by efficiencies measured on "
               "real GPUs (within 8% of the H100 runs they were fitted on, 12% on a run left out of the fit: "
               "bench/calibrate.py); they rank plans, they are not measurements.")
    out.append(f"Searched with {res.plan_calls} planner calls ({res.pruned} combinations pruned) in {res.seconds:.2f} s.")
    return out


def render_fit(res, reasons: list[str], files: dict, console) -> None:
    from rich.table import Table

    from trainfit.plan.memory import verdict

    cols = [("your config", res.user), ("fitted" if res.best else "closest (does not fit)", res.best or res.closest)]
    world = (res.best or res.closest or res.user).plan.world
    t = Table(title=f"trainfit fit: {res.card.name} x {world} GPU{'s' if world > 1 else ''}",
              title_justify="left")
    t.add_column("")
    for name, _ in cols:
        t.add_column(name)

    def row(label, f):
        t.add_row(label, *(f(c) if c is not None else "-" for _, c in cols))
    row("verdict", lambda c: {"FITS": "[green]FITS[/]"}.get(verdict(c.plan), f"[red]{verdict(c.plan)}[/]"))
    row("peak GiB / GPU", lambda c: f"{c.plan.peak / GiB:.1f}")
    row("headroom GiB", lambda c: f"{(c.plan.headroom or 0) / GiB:+.1f}")
    row(f"est. step s ({_basis(res).split(':')[0].split(';')[0]})", lambda c: f"{c.step.total:.1f}")  # in full below
    keys = list(knobs((res.best or res.closest or res.user).cfg))
    for k in keys:
        row(k, lambda c: knobs(c.cfg).get(k, "-"))
    row("knobs changed", lambda c: str(len(changes(res.user.cfg, c.cfg))) if res.user else "-")
    console.print(t)
    for line in reasons:
        console.print(f"- {line}", highlight=False, soft_wrap=True, markup=False)
    for kind, path in files.items():
        console.print(f"wrote {kind}: {path}", highlight=False)
    if "launch" in files:
        console.print(f"run it: {files['launch']}", highlight=False)
