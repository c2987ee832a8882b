"""Which modules LoRA adapts, one rule for the trainer (models.py) and the planner (models/shapes.py).

peft refuses LoRA on the mixer's `out_proj` and `conv1d` of Mamba-family models, so `all-linear`
there means every other linear layer (in_proj, x_proj, dt_proj), and naming those two is an error.
On vision-language models `all-linear` means the language model's linear layers only (vlm_all_linear),
unless the config trains the vision tower or projector too.
"""

from __future__ import annotations

import re

from trainfit.config import ConfigError

MAMBA_TYPES = frozenset({"mamba", "mamba2", "falcon_mamba", "falcon_h1", "nemotron_h"})
LORA_INCOMPATIBLE = frozenset({"out_proj", "conv1d"})


def skipped_by_all_linear(model_type: str, module_name: str) -> bool:
    """Whether `all-linear` leaves out this linear module (named by its full or last name)."""
    return model_type in MAMBA_TYPES and module_name.rsplit(".", 1)[-1] in LORA_INCOMPATIBLE


def check_targets(model_type: str, targets) -> None:
    """A ConfigError for explicit targets peft refuses on this architecture."""
    if model_type not in MAMBA_TYPES or (isinstance(targets, str) and targets.lower() == "all-linear"):
        return
    names = {targets} if isinstance(targets, str) else set(targets)
    bad = sorted(n for n in names if n.rsplit(".", 1)[-1] in LORA_INCOMPATIBLE)
    if bad:
        raise ConfigError(f"peft.target_modules={sorted(names)} includes {bad}, which peft does not adapt on "
                          f"Mamba-family models ({model_type}); remove them (the default all-linear leaves them out).")


# Vision-language models: which part of the model a module belongs to, by its name. The projector is
# matched first (Qwen-VL's mergers sit inside the vision tower `visual`).
_PROJECTOR_RE = re.compile(r"(^|\.)(merger|deepstack_merger_list|multi_modal_projector|mm_projector|connector)(\.|$)")
_TOWER_RE = re.compile(r"(^|\.)(visual|vision_tower|vision_model|vision_encoder)(\.|$)")


def module_part(name: str) -> str:
    """`projector`, `tower` (vision encoder) or `language` for a parameter or module name."""
    if _PROJECTOR_RE.search(name):
        return "projector"
    return "tower" if _TOWER_RE.search(name) else "language"


def vlm_all_linear(linear_names: list[str], tower: bool = False, projector: bool = False) -> str:
    """peft `target_modules` (a regex peft full-matches against module names) for `all-linear` on a
    vision-language model: the language model's linear layers (output head excluded by the caller),
    plus the vision tower's / projector's where those are trained (model.freeze_vision_tower /
    freeze_projector false). Layer indices become \\d+, so the regex stays short for any depth and
    the planner's layer patterns (`layers.*.q_proj`, read with * as 0) match it too."""
    keep = {"language": True, "tower": tower, "projector": projector}
    pats = sorted({re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", re.escape(n)) for n in linear_names if keep[module_part(n)]})
    return "|".join(f"(?:{p})" for p in pats)


def lora_in_model_dtype(method: str, adapter_compute: str, dtype: str, quantization: str) -> bool:
    """Whether LoRA computes in the base's bf16 (`peft.adapter_compute=model`): LoRA (not DoRA, whose
    peft code uses the adapter weights directly) on an unquantized bf16 model. An fp16 base keeps
    peft's fp32 adapter compute (fp16's narrow range), and a k-bit base's inputs are fp32 already."""
    return method == "lora" and adapter_compute == "model" and dtype == "bf16" and quantization == "none"
