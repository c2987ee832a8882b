"""Lint of DeepSpeed JSON: batch arithmetic, `auto` values, precision, offload RAM and companions,
agreement with trainfit; then the file through DeepSpeed's own config classes (ds_validate.py).

The checks written here are for what DeepSpeed's config classes accept but the job then gets wrong
or the engine refuses later (at initialize, or at the first swap), with the world size and the
launcher the other files give. The batch rules are DeepSpeed's own (runtime/config.py,
_set_batch_related_parameters): with two of
train_batch_size / train_micro_batch_size_per_gpu / gradient_accumulation_steps it derives the third
by integer division and then asserts train_batch_size == micro x accumulation x world size.
"""

from __future__ import annotations

from typing import Any, Optional

from trainfit.app.doctor.context import Context, lr_scaling_findings, offload_ram_rule
from trainfit.app.doctor.ds_validate import validate
from trainfit.app.doctor.files import Doc
from trainfit.app.doctor.findings import Finding

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def find_auto(d: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose value is the string "auto"."""
    out = []
    if isinstance(d, dict):
        for k, v in d.items():
            out += find_auto(v, f"{prefix}{k}.")
    elif isinstance(d, list):
        for i, v in enumerate(d):
            out += find_auto(v, f"{prefix}{i}.")
    elif isinstance(d, str) and d.strip().lower() == "auto":
        out.append(prefix.rstrip("."))
    return out


def _enabled(section: Any) -> Optional[bool]:
    if isinstance(section, dict):
        v = section.get("enabled", False)
        return None if v == "auto" else bool(v)
    return None


def _num(v: Any) -> Optional[int]:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def batch_findings(d: dict, world: Optional[int], wsrc: str, path: str) -> list[Finding]:
    tbs, mb, ga = (_num(d.get(k)) for k in BATCH_KEYS)
    autos = {k for k in BATCH_KEYS if d.get(k) == "auto"}
    bad = [k for k in BATCH_KEYS if k in d and k not in autos and (_num(d[k]) is None or d[k] < 1)]
    if bad:
        return [Finding("ds.batch_mismatch", "error", f"{', '.join(f'{k}={d[k]!r}' for k in bad)} must be "
                        "positive integers.", "Write whole numbers (or derive them with `trainfit export`).", path)]
    if tbs is None and mb is None and not autos & {"train_batch_size", "train_micro_batch_size_per_gpu"}:
        return [Finding("ds.batch_missing", "error", "Neither train_batch_size nor train_micro_batch_size_per_gpu "
                        "is set; DeepSpeed refuses to start.", "Set train_micro_batch_size_per_gpu and "
                        "gradient_accumulation_steps (train_batch_size = their product x world size).", path)]
    w = f"world size {world} ({wsrc})" if world else ""
    if tbs and mb and ga:
        if world and tbs != mb * ga * world:
            alt = f", or gradient_accumulation_steps={tbs // (mb * world)}" if tbs % (mb * world) == 0 else ""
            return [Finding("ds.batch_mismatch", "error", f"train_batch_size={tbs} != train_micro_batch_size_per_gpu="
                            f"{mb} x gradient_accumulation_steps={ga} x {w} = {mb * ga * world}; DeepSpeed asserts "
                            "this at initialize.", f"Set train_batch_size={mb * ga * world}{alt}.", path)]
        if not world and tbs % (mb * ga):
            return [Finding("ds.batch_mismatch", "error", f"train_batch_size={tbs} is not a multiple of micro {mb} x "
                            f"accumulation {ga} = {mb * ga}, so no world size makes them consistent.",
                            f"Set train_batch_size to {mb * ga} x the number of GPUs.", path)]
        if not world:
            n = tbs // (mb * ga)
            return [_unchecked(f"train_batch_size={tbs} = micro {mb} x accumulation {ga} x world size holds only on "
                               f"{n} GPU{'s' if n > 1 else ''} in all", path)]
        return []
    if not world:
        if tbs:  # DeepSpeed derives the missing value from the world size, which must divide evenly
            return [_unchecked(f"train_batch_size={tbs} must divide evenly by the world size"
                               + (f" x {'micro-batch' if mb else 'accumulation'} {mb or ga}" if mb or ga else ""), path)]
        return []
    if tbs and (mb or ga):
        other, val = ("train_micro_batch_size_per_gpu", mb) if mb else ("gradient_accumulation_steps", ga)
        if tbs % (val * world):
            return [Finding("ds.batch_world", "error", f"train_batch_size={tbs} is not divisible by {other}={val} x "
                            f"{w}, so DeepSpeed's derived {'accumulation' if mb else 'micro-batch'} is not whole.",
                            f"Set train_batch_size to a multiple of {val * world}, e.g. "
                            f"{-(-tbs // (val * world)) * val * world}.", path)]
    elif tbs and tbs % world:
        return [Finding("ds.batch_world", "error", f"train_batch_size={tbs} is not divisible by {w}.",
                        f"Set train_batch_size to a multiple of {world}, e.g. {-(-tbs // world) * world}.", path)]
    return []


def _unchecked(what: str, path: str) -> Finding:
    """The batch check needs the job's world size, and nothing given says it: say so, and what to pass."""
    return Finding("ds.batch_unchecked", "warning", f"{what}, but the job's world size is unknown, so the batch "
                   "arithmetic was not checked (DeepSpeed asserts it at initialize).",
                   "Pass --num-gpus N (GPUs per node; with num_nodes from a config), or give the job's trainfit "
                   "config, accelerate YAML or launch line in the same call, e.g. `trainfit doctor ds.json "
                   "accelerate.yaml`.", path)


def lint_deepspeed(doc: Doc, ctx: Context) -> list[Finding]:
    if doc.error:
        return [Finding("ds.invalid", "error", f"{doc.path}: {doc.error}.", "Fix the JSON syntax at the position "
                        "shown (DeepSpeed also accepts HJSON: # comments, unquoted keys).", doc.path)]
    d: dict = doc.data
    world, wsrc = ctx.world()
    out = batch_findings(d, world, wsrc, doc.path)
    out += _auto(doc, ctx, d)
    out += _precision(doc, ctx, d)
    zero = d.get("zero_optimization") if isinstance(d.get("zero_optimization"), dict) else {}
    stage = _num(zero.get("stage")) or 0
    off_opt = _device(zero.get("offload_optimizer")) in ("cpu", "nvme")
    off_par = _device(zero.get("offload_param")) in ("cpu", "nvme")
    if off_par and stage != 3:
        out.append(Finding("ds.offload_param_stage", "warning", f"zero_optimization.offload_param is set with stage "
                           f"{stage}; parameters are only partitioned, so only offloaded, under ZeRO-3.",
                           "Set zero_optimization.stage=3, or remove offload_param.", doc.path))
    if stage and (_device(zero.get("offload_optimizer")) == "cpu" or _device(zero.get("offload_param")) == "cpu"):
        out += _offload_ram(doc, ctx, off_par and stage == 3)
    out += _offload_companions(doc, ctx, d, zero, stage, off_opt)
    out += _vs_trainfit(doc, ctx, d, stage, off_opt, off_par)
    opt = d.get("optimizer") if isinstance(d.get("optimizer"), dict) else {}
    lr = (opt.get("params") or {}).get("lr") if isinstance(opt.get("params"), dict) else None
    tbs, mb, ga = (_num(d.get(k)) for k in BATCH_KEYS)
    gbatch = tbs or (mb * (ga or 1) * world if mb and world else None)
    out += lr_scaling_findings(ctx, doc, lr, gbatch, "optimizer.params.lr")
    return out + validate(d, doc.path)  # DeepSpeed's own config classes, where DeepSpeed imports (ds_validate.py)


def _device(section: Any) -> Optional[str]:
    return str(section.get("device", "none")).lower() if isinstance(section, dict) else None


def _auto(doc: Doc, ctx: Context, d: dict) -> list[Finding]:
    autos = find_auto(d)
    if not autos:
        return []
    kind = ctx.ds_launch_kind(doc)
    if kind == "hf":
        return []  # the HF Trainer / accelerate integration replaces them from TrainingArguments
    keys = ", ".join(autos[:8]) + (" ..." if len(autos) > 8 else "")
    who = {"trainfit": "trainfit (which writes explicit values)",
           "native": "deepspeed.initialize with --deepspeed_config"}.get(kind, "no launcher given with it")
    sev = "warning" if kind is None else "error"
    return [Finding("ds.auto_unfilled", sev, f"\"auto\" is left in {keys}; only the HF Trainer / accelerate "
                    f"integration fills it, and this file is read by {who}: DeepSpeed fails on the string.",
                    "Write numbers (`trainfit export CONFIG -o DIR` writes a consistent file), or launch through "
                    "the HF Trainer (--deepspeed FILE) / accelerate.", doc.path)]


def _precision(doc: Doc, ctx: Context, d: dict) -> list[Finding]:
    fp16 = _enabled(d.get("fp16"))
    bf16 = _enabled(d.get("bf16")) or _enabled(d.get("bfloat16"))
    if fp16 and bf16:
        return [Finding("ds.fp16_and_bf16", "error", "fp16.enabled and bf16.enabled are both true; DeepSpeed "
                        "asserts that only one is on.", "Keep bf16.enabled=true and set fp16.enabled=false "
                        "(bf16 needs no loss scaling on Ampere or newer).", doc.path)]
    mine = "fp16" if fp16 else ("bf16" if bf16 else None)
    if mine is None:
        return []
    for theirs, src in ctx.precisions():
        if theirs in ("fp16", "bf16") and theirs != mine:
            return [Finding("ds.precision_mismatch", "error", f"This file enables {mine} but {src} says {theirs}.",
                            f"Set {theirs}.enabled=true and {mine}.enabled=false here, or change {src} to "
                            f"{mine}.", doc.path)]
    card = ctx.card()
    if mine == "fp16" and card is not None and card.bf16:
        return [Finding("ds.fp16_on_bf16_card", "warning", f"fp16 (with loss scaling) on {card.name} ({card.source}), "
                        "which supports bf16: fp16 overflows where bf16 does not.",
                        "Set bf16.enabled=true and fp16.enabled=false.", doc.path)]
    return []


def _offload_ram(doc: Doc, ctx: Context, offload_param: bool) -> list[Finding]:
    name = ctx.model_name()
    params = ctx.model_info(name)["params"]
    ram, sure, src = ctx.ram()
    if not params or not ram:
        return []
    nodes = ctx.nodes()
    need = offload_ram_rule(params, offload_param, nodes)
    if need <= ram:
        return []
    bare = offload_ram_rule(params, offload_param, nodes, buffer=1.0)
    return [Finding("ds.offload_cpu_ram", "error" if sure and bare > ram else "warning",
                    f"ZeRO offload of {name} ({params / 1e9:.1f}B parameters) needs about {need / 1e9:.0f} GB of CPU "
                    f"RAM per node ({16 + (2 if offload_param else 0)} bytes a parameter x 1.5 buffer"
                    f"{f' / {nodes} nodes' if nodes > 1 else ''}, DeepSpeed's estimator) but {src} has "
                    f"{ram / 1e9:.0f} GB" + ("" if sure else " (not known to be the training node)") + ".",
                    "Offload only the optimizer (remove offload_param), add nodes, use LoRA, or run on a node with "
                    "more RAM.", doc.path)]


def _vs_trainfit(doc: Doc, ctx: Context, d: dict, stage: int, off_opt: bool, off_par: bool) -> list[Finding]:
    cfg = ctx.cfg
    if cfg is None:
        return []
    from trainfit.app.export import deepspeed_config

    want = deepspeed_config(cfg)
    diffs = [f"{k}={d[k]} (trainfit: {want[k]})" for k in BATCH_KEYS
             if _num(d.get(k)) is not None and d[k] != want[k]]
    wz = want["zero_optimization"]
    if "zero_optimization" in d and stage != wz["stage"]:
        diffs.append(f"zero_optimization.stage={stage} (trainfit: {wz['stage']})")
    if "zero_optimization" in d and off_opt != ("offload_optimizer" in wz):
        diffs.append(f"offload_optimizer {'on' if off_opt else 'off'} (trainfit: distributed.offload_optimizer="
                     f"{cfg.distributed.offload_optimizer})")
    if "zero_optimization" in d and off_par != ("offload_param" in wz):
        diffs.append(f"offload_param {'on' if off_par else 'off'} (trainfit: distributed.offload_params="
                     f"{cfg.distributed.offload_params})")
    if not diffs:
        return []
    return [Finding("ds.trainfit_mismatch", "error", "This DeepSpeed file disagrees with the trainfit config given "
                    f"with it: {'; '.join(diffs)}.", "Regenerate it from the config: `trainfit export CONFIG -o DIR`.",
                    doc.path)]


def _offload_companions(doc: Doc, ctx: Context, d: dict, zero: dict, stage: int, off_opt: bool) -> list[Finding]:
    """Offload settings DeepSpeed's config accepts but the engine refuses at start without a companion key."""
    out = []
    kind = ctx.ds_launch_kind(doc)
    # engine._configure_optimizer: ZeRO-Offload with a client torch optimizer raises ZeRORuntimeException
    # unless zero_force_ds_cpu_optimizer is false. Without an optimizer block the script must pass one.
    # accelerate and the HF Trainer map a torch Adam/AdamW to DeepSpeedCPUAdam (map_pytorch_optim_to_deepspeed)
    # and trainfit passes DeepSpeedCPUAdam (train/zero.py): only a script calling deepspeed.initialize itself is hit.
    if stage and off_opt and not isinstance(d.get("optimizer"), dict) and d.get("zero_force_ds_cpu_optimizer", True) \
            is not False and kind not in ("hf", "trainfit"):
        out.append(Finding("ds.offload_client_optimizer", "warning",
                           "zero_optimization.offload_optimizer is on and the file has no `optimizer` block, so the "
                           "script must pass its own optimizer to deepspeed.initialize; DeepSpeed refuses any but "
                           "DeepSpeedCPUAdam / DeepSpeedCPULion next to ZeRO-Offload (ZeRORuntimeException at "
                           "initialize) unless zero_force_ds_cpu_optimizer is false"
                           + ("" if kind else "; accelerate and the HF Trainer convert a torch AdamW themselves") + ".",
                           "Add an optimizer block (e.g. \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": "
                           "2e-5}}) so DeepSpeed builds its CPU Adam, pass deepspeed.ops.adam.DeepSpeedCPUAdam, or "
                           "set \"zero_force_ds_cpu_optimizer\": false (the torch optimizer then steps on the CPU, "
                           "slowly).", doc.path))
    for part in ("offload_optimizer", "offload_param"):
        sec = zero.get(part)
        if _device(sec) == "nvme" and not sec.get("nvme_path"):
            out.append(Finding("ds.nvme_path_missing", "error", f"zero_optimization.{part}.device is nvme without "
                               f"nvme_path; DeepSpeed accepts the file but fails when the engine builds its NVMe "
                               "swap folder (os.path.join(None, ...)).", f"Set zero_optimization.{part}.nvme_path "
                               "to a directory on a local NVMe drive (e.g. /local_nvme), or set device to cpu.",
                               doc.path))
    return out
