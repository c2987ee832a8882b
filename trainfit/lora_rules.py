"""Which modules LoRA adapts, one rule for the trainer (models.py) and the planner (plan/shapes.py).

peft refuses LoRA on the mixer's `out_proj` and `conv1d` of Mamba-family models, so `all-linear`
there means every other linear layer (in_proj, x_proj, dt_proj), and naming those two is an error.
"""

from __future__ import annotations

MAMBA_TYPES = frozenset({"mamba", "mamba2", "falcon_mamba", "falcon_h1", "nemotron_h"})
LORA_INCOMPATIBLE = frozenset({"out_proj", "conv1d"})


def skipped_by_all_linear(model_type: str, module_name: str) -> bool:
    """Whether `all-linear` leaves out this linear module (named by its full or last name)."""
    return model_type in MAMBA_TYPES and module_name.rsplit(".", 1)[-1] in LORA_INCOMPATIBLE


def check_targets(model_type: str, targets) -> None:
    """A ConfigError for explicit targets peft refuses on this architecture."""
    from trainfit.config import ConfigError

    if model_type not in MAMBA_TYPES or (isinstance(targets, str) and targets.lower() == "all-linear"):
        return
    names = {targets} if isinstance(targets, str) else set(targets)
    bad = sorted(n for n in names if n.rsplit(".", 1)[-1] in LORA_INCOMPATIBLE)
    if bad:
        raise ConfigError(f"peft.target_modules={sorted(names)} includes {bad}, which peft does not adapt on "
                          f"Mamba-family models ({model_type}); remove them (the default all-linear leaves them out).")
