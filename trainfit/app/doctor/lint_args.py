"""Lint of vLLM engine arguments and of launch command lines / training scripts.

vLLM arguments come from a YAML/JSON of engine args or a `vllm serve MODEL --flag value` line; keys
are read with dashes as underscores, as vLLM does. A vLLM file given together with a trainfit config
is taken to share its GPUs (the colocated setup): the trainer's planned peak plus vLLM's share must
fit the card, and vLLM itself refuses to start when free memory is below its share.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Optional

import yaml

from trainfit.config.stages import stage_spec
from trainfit.app.doctor.context import Context, lr_scaling_findings
from trainfit.app.doctor.files import Command, Doc, norm_key
from trainfit.app.doctor.findings import Finding
from trainfit.app.doctor.lint_accelerate import gpu_id_list

VLLM_DEFAULT_UTIL = 0.9
_DEVICE_MAP_AUTO = re.compile(r"device_map\s*=\s*['\"]auto['\"]")
_TRAINING = re.compile(r"\b(Trainer|SFTTrainer|GRPOTrainer|DPOTrainer|\.backward\(|optimizer\.step\(|\.train\(\))")


def _human_int(v: Any) -> Optional[int]:
    """vLLM's human-readable ints: 32k = 32000, 32K = 32768 (lower case decimal, upper case binary)."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgKMG]?)\s*", str(v))
    if not m:
        return None
    mult = {"": 1, "k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}[m.group(2)]
    return int(float(m.group(1)) * mult)


def _float(v: Any) -> Optional[float]:
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def lint_vllm_args(args: dict, path: str, ctx: Context) -> list[Finding]:
    args = {norm_key(str(k)): v for k, v in args.items()}
    if isinstance(args.get("config"), str) and Path(args["config"]).is_file():
        try:  # `vllm serve --config FILE`: the file's values, overridden by the command line
            args = {**{norm_key(str(k)): v for k, v in (yaml.safe_load(Path(args["config"]).read_text()) or {}).items()},
                    **args}
        except (yaml.YAMLError, AttributeError):
            pass
    out: list[Finding] = []
    util = _float(args.get("gpu_memory_utilization", VLLM_DEFAULT_UTIL))
    if util is None or not 0 < util <= 1:
        return [Finding("vllm.gpu_mem_range", "error", f"gpu_memory_utilization={args.get('gpu_memory_utilization')!r} "
                        "is the share of one GPU's memory vLLM may take and must be in (0, 1].",
                        "Set gpu_memory_utilization to e.g. 0.9 (alone on the card) or 0.3-0.5 (next to a trainer).",
                        path)]
    tp = _human_int(args.get("tensor_parallel_size", 1)) or 1
    pp = _human_int(args.get("pipeline_parallel_size", 1)) or 1
    dp = _human_int(args.get("data_parallel_size", 1)) or 1
    visible = ctx.visible_gpus()
    if visible and tp * pp * dp > visible:
        out.append(Finding("vllm.tp_over_gpus", "error", f"tensor_parallel_size {tp} x pipeline_parallel_size {pp} x "
                           f"data_parallel_size {dp} = {tp * pp * dp} GPUs, but {visible} are "
                           f"{'given (--num-gpus)' if ctx.opts.num_gpus else 'visible'}.",
                           f"Set tensor_parallel_size to at most {visible} (a divisor of the attention heads).", path))
    model = args.get("model") if isinstance(args.get("model"), str) else ctx.model_name()
    mml = args.get("max_model_len")
    if mml is not None and str(mml).strip() not in ("-1", "auto"):
        n = _human_int(mml)
        limit = ctx.model_info(model)["max_pos"] if model else None
        if limit is None or n is None:
            out.append(Finding("vllm.model_unknown", "info", f"max_model_len={mml} was not checked: the context limit "
                               f"of {model or 'the model (not named)'} is not in trainfit's catalog or a local "
                               "config.json.", "Pass --model NAME_OR_DIR, or check max_position_embeddings in the "
                               "model's config.json.", path))
        elif n > limit:
            out.append(Finding("vllm.max_model_len", "error", f"max_model_len={n} is above {model}'s "
                               f"max_position_embeddings={limit}; vLLM refuses to start (positions past the trained "
                               "range give garbage).", f"Set max_model_len to at most {limit} (or enable the model's "
                               "RoPE scaling, e.g. YaRN via hf_overrides, if it supports it).", path))
    out += _with_trainer(args, util, path, ctx)
    return out


def _with_trainer(args: dict, util: float, path: str, ctx: Context) -> list[Finding]:
    out: list[Finding] = []
    if not ctx.configs:
        gpus = ctx.machine.get("gpus") if ctx.machine else None
        if gpus and gpus[0]["free_gb"] < util * gpus[0]["total_gb"]:
            g = gpus[0]
            out.append(Finding("vllm.over_card", "error", f"gpu_memory_utilization={util} asks for "
                               f"{util * g['total_gb']:.1f} GB of GPU 0 ({g['name']}) but only {g['free_gb']:.1f} GB is "
                               "free now; vLLM checks this at startup and exits.", f"Set gpu_memory_utilization to at "
                               f"most {math.floor(g['free_gb'] / g['total_gb'] * 100) / 100:.2f}, or free the GPU.",
                               path))
        return out
    for cpath, cfg in ctx.configs.items():
        rl = stage_spec(cfg.stage).rollout
        # The server is vLLM's own process: plan the trainer alone (remote generation) and add vLLM's share.
        p, why = ctx.plan(cfg, **({"rollout": {"engine": "openai"}} if rl else {}))
        if p is None:
            out.append(Finding("vllm.unchecked", "info", f"Trainer ({cpath}) + vLLM memory was not checked: {why}.",
                               f"Run `trainfit plan {cpath}` and keep its peak + gpu_memory_utilization x card under "
                               "the card.", path))
            continue
        card, share = p.gpu_memory, util * p.gpu_memory
        total = p.peak + share
        if total <= p.budget:
            continue
        assumed = p.gpu_source == "assumed"
        room = math.floor((p.budget - p.peak) / card * 100) / 100
        fix = (f"Set gpu_memory_utilization to at most {room:.2f}" if room > 0 else
               "The trainer alone fills the card: give vLLM its own GPU (CUDA_VISIBLE_DEVICES)") + \
            f", or shrink the trainer (`trainfit fit {cpath}`), or run vLLM on another GPU."
        out.append(Finding("vllm.over_card", "error" if total > card and not assumed else "warning",
                           f"On {p.gpu} ({'assumed' if assumed else p.gpu_source}) the trainer's planned peak "
                           f"{p.peak / 1e9:.1f} GB ({cpath}) + vLLM's gpu_memory_utilization={util} x "
                           f"{card / 1e9:.1f} GB = {total / 1e9:.1f} GB, over "
                           + (f"the card's {card / 1e9:.1f} GB." if total > card else
                              f"the {p.budget / 1e9:.1f} GB budget ({p.margin:.0%} margin)."), fix, path))
    return out


def _procs(c: Command, ctx: Context) -> Optional[int]:
    ppn = c.procs_per_node()
    if ppn is None and c.launcher == "accelerate" and ctx.accel is not None:
        ppn = max(int(ctx.accel.get("num_processes", 1) or 1) // int(ctx.accel.get("num_machines", 1) or 1), 1)
    if ppn is None and c.launcher == "deepspeed":
        ppn = ctx.visible_gpus()  # the DeepSpeed launcher uses every visible GPU by default
    if ppn is None and c.launcher == "torchrun":
        ppn = 1
    return ppn


def _visible(ctx: Context, env: Optional[dict] = None) -> Optional[int]:
    cvd = (env or {}).get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return len([x for x in cvd.split(",") if x.strip() and x.strip() != "-1"])
    if ctx.accel is not None and gpu_id_list(ctx.accel.get("gpu_ids")) is not None:
        return len(gpu_id_list(ctx.accel.get("gpu_ids")))
    return ctx.visible_gpus()


def device_map_finding(path: str, procs: Optional[int], visible: Optional[int], where: str) -> list[Finding]:
    if procs and procs > 1:
        return [Finding("args.device_map_auto", "error", f"device_map='auto' ({where}) in a {procs}-process job: "
                        "every rank spreads the model over all its visible GPUs, and the HF Trainer refuses to train "
                        "such a model in distributed mode.", "Remove device_map (the Trainer/DDP place the model), "
                        "or use device_map={'': int(os.environ['LOCAL_RANK'])}.", path)]
    if visible and visible > 1:
        return [Finding("args.device_map_auto", "warning", f"device_map='auto' ({where}) in a single training process "
                        f"with {visible} GPUs visible: the layers are split across them and run one GPU at a time "
                        "(naive pipeline), not data-parallel.", f"Launch data-parallel instead (torchrun "
                        f"--nproc_per_node {visible} / accelerate launch) without device_map; or set "
                        "CUDA_VISIBLE_DEVICES=0 if one GPU is meant. Keep 'auto' only for a model no single GPU "
                        "holds.", path)]
    return []


def lint_command(c: Command, path: str, ctx: Context) -> list[Finding]:
    if c.launcher == "vllm":
        return lint_vllm_args({k: v for k, v in c.args.items() if k != "_pos"}, path, ctx)
    if c.launcher not in ("python", "torchrun", "accelerate", "deepspeed"):
        return []
    out: list[Finding] = []
    procs, a = _procs(c, ctx), c.args
    if str(a.get("device_map", "")).lower() == "auto":
        out += device_map_finding(path, procs, _visible(ctx, c.env), f"--device_map auto to {c.script}")
    world = procs * c.nodes() if procs else None
    per_dev = _int(a.get("per_device_train_batch_size"))
    ga = _int(a.get("gradient_accumulation_steps")) or 1
    if "num_generations" in a and world:
        g = _int(a["num_generations"])
        spg = _int(a.get("steps_per_generation")) or ga
        gen = _int(a.get("generation_batch_size")) or (per_dev or 8) * world * spg
        if g and gen % g:
            how = "generation_batch_size" if a.get("generation_batch_size") else \
                f"per_device_train_batch_size {per_dev or 8} x {world} processes x steps_per_generation {spg}"
            out.append(Finding("args.grpo_groups", "error", f"The GRPO generation batch {gen} ({how}) is not a multiple "
                               f"of num_generations={g}: a prompt's group would be split (TRL raises at start).",
                               f"Make it a multiple of {g}, e.g. per_device_train_batch_size "
                               f"{_fit(g, world * spg)}.", path))
    if per_dev and world:
        out += lr_scaling_findings(ctx, _doc_for(path, ctx), _float(a.get("learning_rate")), per_dev * ga * world,
                                   "--learning_rate")
    return out


def _fit(g: int, mult: int) -> int:
    # Smallest per-device batch b with b x mult a multiple of g.
    return g // math.gcd(g, mult)


def _int(v: Any) -> Optional[int]:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _doc_for(path: str, ctx: Context) -> Doc:
    return next(d for d in ctx.docs if d.path == path)


def lint_python(doc: Doc, ctx: Context) -> list[Finding]:
    m = _DEVICE_MAP_AUTO.search(doc.text)
    if not m or not _TRAINING.search(doc.text):
        return []  # inference scripts may spread a model on purpose
    line = doc.text[: m.start()].count("\n") + 1
    name = Path(doc.path).name
    runs = [c for c in ctx.commands if c.script and Path(c.script).name == name]
    procs = _procs(runs[0], ctx) if runs else None
    if procs is None and ctx.accel is not None:
        procs = max(int(ctx.accel.get("num_processes", 1) or 1) // int(ctx.accel.get("num_machines", 1) or 1), 1)
    return device_map_finding(doc.path, procs or 1, _visible(ctx, runs[0].env if runs else None),
                              f"{name}:{line}")


def lint_commands(doc: Doc, ctx: Context) -> list[Finding]:
    if doc.error:
        return [Finding("args.invalid", "info", f"{doc.path}: {doc.error}.", "Pass configs as .yaml/.json and command "
                        "lines in a .sh/.txt file.", doc.path)]
    return [f for c in doc.commands for f in lint_command(c, doc.path, ctx)]
