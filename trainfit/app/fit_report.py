"""What `trainfit fit` says: the table of knobs (your config against the fitted or closest one), the reason
lines (each change and why, the alternatives, the splits, the planner's change when nothing fits) and the
JSON. The table and the reasons read the same knobs (`knobs`, `changes`), so they cannot disagree; the
written config is the fitted one they describe."""

from __future__ import annotations

from trainfit.config.stages import stage_spec
from trainfit.config.words import count
from trainfit.core.extras import training_machine_line

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
    n = arch_facts(model_source(m)).n_layers
    ck = m.checkpointed_layers(n)
    out = {"micro-batch": f"{bp.micro_batch} x accum {bp.accumulation} x {count(bp.world_size, 'GPU')}",
           "gradient checkpointing": "off" if not ck else (f"all {n} layers" if ck == n else f"first {ck} of {n} layers"),
           "log-probs in chunks": f"{cfg.train.logits_chunk_rows} rows" if cfg.train.logits_chunk_rows else "off",
           "fused LM head": cfg.train.fused_head,
           "parallelism": par, "method": method, "optimizer": cfg.train.optimizer}
    rl = stage_spec(cfg.stage).rollout
    if rl and r.engine == "vllm":
        out["vLLM memory share"] = f"{r.gpu_memory_utilization:.0%}"
        out["vLLM sleep level"] = str(r.sleep_level)
        out["vLLM tensor parallel"] = f"{r.tensor_parallel_size} GPU{'s' if r.tensor_parallel_size > 1 else ''}"
    elif rl and r.engine == "hf":
        out["sequences generated together"] = str(min(r.batch_size or bp.per_device_batch, bp.per_device_batch))
    if plans_screens(cfg, arch_facts(model_source(m))):
        out["screenshots kept an episode"] = str(kept_screens(r))
        out["screenshot max_pixels"] = str(m.max_pixels or "processor default")
    return out


# The row of `knobs` each key fit may change shows it (tests/test_advice_holds.py checks every key fit
# changed moves its row, so the table, the message and the written file agree).
KNOB_OF = {"train.micro_batch_size": "micro-batch", "model.gradient_checkpointing": "gradient checkpointing",
           "train.logits_chunk_rows": "log-probs in chunks", "train.fused_head": "fused LM head",
           "peft.method": "method", "model.quantization": "method", "train.optimizer": "optimizer",
           "rollout.gpu_memory_utilization": "vLLM memory share", "rollout.sleep_level": "vLLM sleep level",
           "rollout.tensor_parallel_size": "vLLM tensor parallel",
           "rollout.batch_size": "sequences generated together",
           "rollout.max_images_per_episode": "screenshots kept an episode", "model.max_pixels": "screenshot max_pixels",
           **{f"distributed.{k}": "parallelism" for k in ("strategy", "zero_stage", "offload_optimizer",
                                                        "offload_params")}}


def changes(a, b) -> list[tuple[str, str, str]]:
    """(knob, before, after) for each row of `knobs` that differs between configs a and b."""
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
            # a closest miss that does not run has no measure of the memory missing
            "missing_gib": None if res.closest is not None and res.closest.plan.problems else res.missing / GiB,
            "would_fit_with": res.would_fit_with, "plan_calls": res.plan_calls,
            "pruned_combinations": res.pruned, "skipped": res.skipped, "seconds": res.seconds,
            "screens_floor": res.screens_floor,
            "splits": [o.to_dict() for o in res.splits],
            "split_suggestion": res.split_pick.to_dict() if res.split_pick else None,
            "planner_fix": res.planner_fix.__dict__ if res.planner_fix else None,
            "step_time_note": f"estimate ({_basis(res)}): the roofline with efficiency constants measured on "
                              "real GPUs (trainfit/plan/steptime.py), not a measurement"}


def _basis(res) -> str:
    """What the step-time estimates of a fit rest on (one card, so one basis)."""
    c = res.best or res.user or res.closest
    return c.step.basis if c is not None else "roofline, uncalibrated"


def _why(knob: str, u, b) -> str:
    """Why a knob moved, from the two configs (u: the user's, b: the fitted one)."""
    from trainfit.models.shapes import arch_facts, model_source

    ub, bb = u.batch_plan(), b.batch_plan()
    if knob == "micro-batch":
        if bb.micro_batch > ub.micro_batch:
            return "fewer micro-steps per optimizer step read the weights fewer times; same global batch, same gradient"
        return (f"a smaller micro-batch holds fewer activations; accumulation {bb.accumulation} keeps the global batch "
                f"{bb.global_batch} (same gradient)")
    if knob == "gradient checkpointing":
        n = arch_facts(model_source(b.model)).n_layers
        before, after = u.model.checkpointed_layers(n), b.model.checkpointed_layers(n)
        if not after:
            return "it fits without, and skips recomputing the forward in backward (about a third more training FLOPs)"
        if after < before:
            return (f"{before - after} fewer layers recompute their forward in backward (faster); the activations "
                    "they keep still fit")
        return "only each checkpointed layer's input is kept for backward; needed to fit"
    if knob == "log-probs in chunks":
        return "no full fp32 [tokens, vocab] copy of the logits is kept for backward; same math"
    if knob == "fused LM head":
        return "the head and the log-probs are computed in chunks, so no [tokens, vocab] logits are held; same math"
    if knob == "parallelism":
        d = b.distributed
        if d.offload_params:
            return "parameters live in CPU RAM and cross PCIe in every forward and backward (the slowest option)"
        if d.offload_optimizer:
            return "optimizer state and fp32 master weights move to CPU RAM (DeepSpeed CPU Adam, PCIe in the estimate)"
        if u.distributed.offload_optimizer or u.distributed.offload_params:
            return "it fits without offload, so nothing crosses PCIe"
        if b.engine() == "fsdp":
            return (f"FSDP2 shards weights, gradients and optimizer state over {bb.world_size} GPUs with DDP's bf16 "
                    "AdamW math, and hands the engine one tensor at a time (no whole copy gathered)")
        if b.engine() == "ddp":
            return "every GPU holds the whole model: no gathers, the fastest that fits"
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
    if knob == "vLLM tensor parallel":
        t = b.rollout.tensor_parallel_size
        return (f"each group of {t} GPUs runs one engine holding 1/{t} of the weights and KV cache per GPU, so the "
                "share fits a KV cache and each decode step reads fewer bytes per GPU")
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
    from trainfit.plan.split import describe_splits, split_advice

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
            out.append("Of the knobs fit changes on its own, nothing is faster by more than 1% (estimate): your "
                       "settings are kept." if res.alternatives or res.split_pick else
                       "Nothing searched is faster by more than 1% (estimate): your settings are kept.")
        for knob, before, after in diff:
            out.append(f"{knob}: {before} -> {after}: {_why(knob, u.cfg, b.cfg)}.")
        for a in res.alternatives:
            what = {k: v for k, v in a.overrides.items() if k in _WHAT}
            m = knobs(a.cfg)["method"] + (f", {a.cfg.train.optimizer}" if "train.optimizer" in what else "")
            out.append(f"Faster but changes what is trained: {m} (estimated step {a.step.total:.1f} s vs "
                       f"{b.step.total:.1f} s); your method is kept because it fits. To fit that instead: "
                       f"{_again(res, path)} " + " ".join(override_list(what)))
        out += describe_splits(res.splits)
        if res.split_pick is not None:
            out.append(split_advice(res.split_pick, b.step.total, _again(res, path)))
        if b.cfg.distributed.offload_optimizer or b.cfg.distributed.offload_params:
            out.append(f"Offload needs about {b.plan.cpu_ram / GiB:.0f} GiB of CPU RAM per node.")
        if u is not None:
            out.append(f"Estimated step {b.step.total:.1f} s (rollout {b.step.rollout:.1f}, train {b.step.train:.1f}, "
                       f"comm/offload {b.step.comm:.1f}) vs {u.step.total:.1f} s for yours.")
    else:
        c = res.closest
        if c is None:
            out.append(f"Nothing fits {res.card.name}: no config searched could be planned.")
        elif c.plan.problems:  # it does not run: its peak is no measure of the memory missing
            out.append(f"Nothing fits {res.card.name} with the knobs searched, and none of them runs. Closest ("
                       + ", ".join(f"{k} {v}" for k, v in knobs(c.cfg).items()) + ") does not run: "
                       + "; ".join(prob.rstrip(".") for prob in c.plan.problems) + ".")
        else:
            out.append(f"Nothing fits {res.card.name} with the knobs searched. Closest: {c.plan.peak / GiB:.1f} GiB "
                       f"peak, {res.missing / GiB:.1f} GiB missing ("
                       + ", ".join(f"{k} {v}" for k, v in knobs(c.cfg).items()) + ").")
        if res.screens_floor:
            out.append(f"Screenshots were searched down to their floors ({res.screens_floor}) and nothing fits; "
                       "lower those floors to let fit show the agent less.")
        if res.would_fit_with:
            out.append(f"It would fit with {' '.join(res.would_fit_with)}.")
        fix = res.planner_fix
        if fix is not None:
            out.append(f"Beyond the knobs fit searches, the planner's change {fix.change} fits (planned: peak "
                       f"{fix.peak / GiB:.1f} GiB). To fit with it: {_again(res, path)} {' '.join(fix.overrides)}")
        out.append(f"`trainfit hardware {path}` ranks other cards and GPU counts.")
    shown = b or res.closest or u
    needs = training_machine_line([shown.cfg]) if shown is not None else None
    if needs:
        out.append(needs[0].upper() + needs[1:] + ".")
    out.append(f"Step times are estimates ({_basis(res)}): the roofline corrected by efficiencies measured on "
               "real GPUs (within 8% of the H100 runs they were fitted on, 12% on a run left out of the fit: "
               "bench/calibrate.py); they rank plans, they are not measurements.")
    out.append(f"Searched with {count(res.plan_calls, 'planner call')} ({count(res.pruned, 'combination')} pruned) in "
               f"{res.seconds:.2f} s." + (f" Not planned: {_skipped(res.skipped)}." if res.skipped else ""))
    return out


def _skipped(skipped: dict) -> str:
    from trainfit.plan.fit_search import Skipped

    return Skipped(skipped).text()


def _again(res, path: str) -> str:
    """The `trainfit fit` command that searches the same card and GPU count again (overrides follow it)."""
    c = res.best or res.user
    n = f" --num-gpus {c.cfg.distributed.num_gpus}" if c is not None else ""
    gpu = "" if res.card.detected else f" --gpu {res.card.key}"   # a detected card is found again; a size by its key
    return f"trainfit fit {path}{gpu}{n}"


def render_fit(res, reasons: list[str], files: dict, console) -> None:
    from rich.table import Table

    from trainfit.plan.memory import verdict

    cols = [("your config", res.user), ("fitted" if res.best else "closest (does not fit)", res.best or res.closest)]
    world = (res.best or res.closest or res.user).plan.world
    t = Table(title=f"trainfit fit: {res.card.name} x {count(world, 'GPU')}",
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
