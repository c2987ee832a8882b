"""Which model configs change the logits after the LM head (softcapping, logit scales), so that the fused
head (models/fused_head.py) would not compute the model's own logits.

Read from the config alone, without torch: the planner's suggestions ask it on every plan.
"""

from __future__ import annotations

from typing import Optional

# Config attributes of models that change the logits after the head (transformers' Gemma 2/3/4,
# Cohere, Granite, Falcon-H1...): the identity head would skip that step.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "lm_head_multiplier",
                     "output_multiplier_scale", "attn_logit_softcapping_final")


def config_head_problem(config) -> Optional[str]:
    """Why a transformers config (object or dict) describes logits the fused head would not compute
    (a transform after the head), else None. Also what the planner's suggestions check."""
    get = config.get if isinstance(config, dict) else (lambda k: getattr(config, k, None))
    for key in _LOGIT_TRANSFORMS:
        val = get(key)
        if isinstance(val, (int, float)) and not isinstance(val, bool) and val not in (0, 1):
            return f"its config has {key}={val}: the model changes the logits after the head"
    return None
