"""The planner's entry: a bare plan (memory.py), then, when it does not fit, the changes that make it fit
(suggest.py, which plans each candidate bare)."""

from __future__ import annotations

from typing import Optional

from trainfit.config import Config
from trainfit.plan.memory import Plan, plan_on
from trainfit.plan.suggest import suggestions


def plan(cfg: Config, gpu: Optional[str] = None, num_gpus: Optional[int] = None, *, suggest: bool = True,
         margin: Optional[float] = None, from_data: bool = True) -> Plan:
    """Plan the per-GPU memory of `cfg` on `gpu` (name, else hardware.gpu, else NVML, else H100 80GB).

    Sequences are planned at the lengths the data gives (lengths.py: the run's tokenizer on its
    prompts / items; `from_data=False` or unknown data: the caps); when those are shorter than the
    caps, the plan at the caps is attached as `worst_case`. `suggest`: a plan that does not fit
    carries the cheapest changes that make it fit."""
    p, card = plan_on(cfg, gpu, num_gpus, margin=margin, from_data=from_data)
    if suggest and p.fits is False:
        p.suggestions = suggestions(cfg, p, card)
    return p
