"""Lint of trainfit YAML: the loader's own errors as findings, then doctor-only checks.

The rules of the schema and between fields live in trainfit.config and only there: a file is loaded
with `load_config`; when that fails on a cross-field rule, the file is validated once more without
the cross-field validator and each message of `cross_field_errors` becomes its own finding. Doctor
adds what needs more than the file: the memory plan against the card, CPU RAM for offload, extras
that must import, and learning-rate scaling.
"""

from __future__ import annotations

from pydantic import ValidationError, model_validator

from trainfit.config.stages import stage_spec
from trainfit.config import Config, ConfigError, cross_field_errors, expand_stages, load_config
from trainfit.app.doctor.context import Context, lr_scaling_findings, offload_ram_rule
from trainfit.app.doctor.files import Doc
from trainfit.app.doctor.findings import Finding
from trainfit.plan.items import gib

_EXTRA_FOR = {"bitsandbytes": "the `bnb` extra (pip install 'trainfit[bnb]')",
              "deepspeed": "the `deepspeed` extra (pip install 'trainfit[deepspeed]')",
              "vllm": "the `vllm` extra (pip install 'trainfit[vllm]')",
              "flash_attn": "flash-attn (pip install flash-attn --no-build-isolation)",
              "gguf": "the `gguf` extra (pip install 'trainfit[gguf]')", "peft": "peft (pip install peft)"}


class _Unchecked(Config):
    """The schema without its cross-field validator (same name overrides it), so each cross-field
    problem can be listed on its own."""

    @model_validator(mode="after")
    def _cross_checks(self) -> "_Unchecked":
        return self


def split_message(msg: str) -> tuple[str, str]:
    """trainfit.config messages end with their fix after the last '; ' (or ': set ...')."""
    if "; " in msg:
        reason, fix = msg.rsplit("; ", 1)
        return reason + ".", fix[:1].upper() + fix[1:]
    if ": set " in msg:
        reason, fix = msg.split(": set ", 1)
        return reason + ".", "Set " + fix
    return msg, "Change the keys named in the message as it says."


def cross_code(msg: str) -> str:
    """The rule's code, carried by trainfit.config's messages (tf.cross_field for any other text)."""
    return getattr(msg, "code", "tf.cross_field")


def load_findings(doc: Doc, ctx: Context):
    """Load the file as `trainfit train` would: (Config or None, findings)."""
    try:
        cfg = load_config(doc.path)
    except ConfigError as e:
        raw = doc.data if isinstance(doc.data, dict) and doc.error is None else None
        if raw is not None and raw.get("stages"):
            raw = None  # a pipeline's rules hold per merged stage: the loader's message names the stage
        errs: list[str] = []
        if raw is not None:
            try:
                errs = cross_field_errors(_Unchecked.model_validate(raw))
            except ValidationError:
                errs = []
        if not errs:
            return None, [Finding("tf.schema", "error", str(e), "Fix the key or value named in the message "
                                  "(`trainfit keys` lists every key with its meaning).", doc.path)]
        out = []
        for msg in errs:
            reason, fix = split_message(msg)
            out.append(Finding(cross_code(msg), "error", reason, fix, doc.path))
        return None, out
    try:
        ctx.stages[doc.path] = expand_stages(cfg)
    except ConfigError as e:
        return cfg, [Finding("tf.stages", "error", str(e), "Fix that stage's overrides as the message says.",
                             doc.path)]
    return cfg, []


def lint_trainfit(doc: Doc, ctx: Context) -> list[Finding]:
    cfg, out = load_findings(doc, ctx)
    if cfg is None:
        return out
    ctx.root.configs[doc.path] = cfg
    ctx.configs = {doc.path: cfg, **ctx.configs}  # its own config first: card, world and precision are its
    out += _extras(doc, ctx, cfg)
    card = ctx.card()
    visible = ctx.machine.get("visible_gpus") if ctx.machine else None
    if visible and cfg.distributed.num_gpus > visible and not ctx.opts.num_gpus:
        out.append(Finding("tf.more_gpus_than_visible", "warning", f"distributed.num_gpus={cfg.distributed.num_gpus} "
                           f"but this machine shows {visible} GPU(s) (CUDA_VISIBLE_DEVICES included).",
                           f"Set distributed.num_gpus={visible} (keeping train.global_batch_size, so the math is "
                           "unchanged), or run on a node with more GPUs.", doc.path))
    if cfg.model.dtype == "fp16" and card is not None and card.bf16:
        out.append(Finding("tf.fp16_on_bf16_card", "warning", f"model.dtype=fp16 on {card.name} ({card.source}), "
                           "which supports bf16: fp16 needs loss scaling and overflows where bf16 does not.",
                           "Set model.dtype=bf16.", doc.path))
    stages = ctx.stages.get(doc.path, [cfg])
    for scfg in stages:  # a pipeline is planned stage by stage: each runs with its own batch and model
        if scfg.train.device != "cpu":
            out += _plan_findings(doc, ctx, scfg, f"stage {scfg.stage}: " if len(stages) > 1 else "")
    out += lr_scaling_findings(ctx, doc, cfg.train.lr, cfg.train.global_batch_size, "train.lr", cfg.distributed)
    return out


def _extras(doc: Doc, ctx: Context, cfg) -> list[Finding]:
    extras = ctx.machine.get("extras") if ctx.machine else None
    if not extras:
        return []
    need = []
    m = cfg.model
    if m.quantization != "none" or cfg.train.optimizer != "adamw":
        need.append(("bitsandbytes", f"model.quantization={m.quantization}, train.optimizer={cfg.train.optimizer}"))
    if cfg.distributed.strategy == "deepspeed" or cfg.distributed.zero_stage > 0:
        need.append(("deepspeed", f"distributed.strategy={cfg.distributed.strategy}, zero_stage="
                     f"{cfg.distributed.zero_stage}"))
    if cfg.rollout.engine == "vllm" and stage_spec(cfg.stage).rollout:
        need.append(("vllm", "rollout.engine=vllm"))
    if m.attn_implementation.startswith("flash_attention"):
        need.append(("flash_attn", f"model.attn_implementation={m.attn_implementation}"))
    if m.name.endswith(".gguf") or m.gguf_file:
        need.append(("gguf", "a GGUF model"))
    if cfg.peft.method != "none":
        need.append(("peft", f"peft.method={cfg.peft.method}"))
    return [Finding("tf.extra_missing", "warning", f"{why} needs {mod}, which does not import in this Python.",
                    f"Install {_EXTRA_FOR[mod]}, or change the setting.", doc.path)
            for mod, why in need if extras.get(mod) is None]


def _plan_findings(doc: Doc, ctx: Context, cfg, label: str = "") -> list[Finding]:
    if not ctx.opts.plan:  # asked for no planner: only the rule-of-thumb RAM check, no note about it
        return _offload_rule(doc, ctx, cfg)
    p, why = ctx.plan(cfg)
    out: list[Finding] = []
    if p is None:
        out.append(Finding("tf.plan_unavailable", "info", f"{label}Memory was not checked against the card: {why}.",
                           f"Run `trainfit plan {doc.path} --gpu NAME` to see the plan, or fix what the "
                           "message names.", doc.path))
        return out + _offload_rule(doc, ctx, cfg)
    card_mem = p.gpu_memory or 0
    assumed = p.gpu_source == "assumed"
    gb = lambda b: f"{gib(b)} GiB"  # noqa: E731  (the plan's own figures, as `trainfit plan` prints them)
    for name, ph in p.phases.items():
        if ph.total <= p.budget:
            continue
        vllm_phase = name == "rollout" and cfg.rollout.engine == "vllm"
        over_card = ph.total > card_mem
        sev = "error" if over_card and not assumed else "warning"
        where = f"{p.gpu} ({'assumed: no card given or detected' if assumed else p.gpu_source})"
        limit = f"the card's {gb(card_mem)}" if over_card else \
            f"the {gb(p.budget)} budget ({p.margin:.0%} margin kept free)"
        share = (f" (vLLM takes rollout.gpu_memory_utilization={cfg.rollout.gpu_memory_utilization} x "
                 f"{gb(card_mem)})") if vllm_phase else ""
        out.append(Finding("vllm.over_card" if vllm_phase else "tf.plan_over_card", sev,
                           f"{label}The planned {name} peak per GPU is {gb(ph.total)}{share}, over {limit} of {where}.",
                           f"Run `trainfit fit {doc.path}` for a config that fits, or see `trainfit plan "
                           f"{doc.path}` for the cheapest changes" + (
                               "; lower rollout.gpu_memory_utilization or raise sleep_level" if vllm_phase else "")
                           + ".", doc.path))
    for prob in p.problems:
        out.append(Finding("vllm.no_kv_room" if "vLLM" in prob else "tf.plan_over_card", "error",
                           label + prob, f"See `trainfit plan {doc.path}`.", doc.path))
    ram, sure, src = ctx.ram()
    if p.cpu_ram and ram and p.cpu_ram > ram:
        out.append(Finding("tf.offload_cpu_ram", "error" if sure else "warning",
                           f"{label}The plan keeps {gb(p.cpu_ram)} per node in CPU RAM (offloaded states, sleeping vLLM "
                           f"weights) but {src} has {gb(ram)}" + ("" if sure else
                                                                 " (not known to be the training node)") + ".",
                           "Offload less (distributed.offload_params=false, then offload_optimizer=false), use more "
                           "GPUs or nodes (ZeRO partitions the states), or run on a node with more RAM.", doc.path))
    return out


def _offload_rule(doc: Doc, ctx: Context, cfg) -> list[Finding]:
    d = cfg.distributed
    if not (d.offload_optimizer or d.offload_params) or cfg.peft.method != "none":
        return []
    params = ctx.model_info(cfg.model.name)["params"]
    ram, sure, src = ctx.ram()
    if not params or not ram:
        return []
    need = offload_ram_rule(params, d.offload_params and d.zero_stage == 3, d.num_nodes)
    if need <= ram:
        return []
    bare = offload_ram_rule(params, d.offload_params and d.zero_stage == 3, d.num_nodes, buffer=1.0)
    return [Finding("tf.offload_cpu_ram", "error" if sure and bare > ram else "warning",
                    f"Offloading {params / 1e9:.1f}B parameters needs about {need / 1e9:.0f} GB of CPU RAM per node "
                    f"(rule of thumb, no plan) but {src} has {ram / 1e9:.0f} GB.",
                    "Offload less, add nodes, or use a node with more RAM; `trainfit plan` gives the exact figure.",
                    doc.path)]
