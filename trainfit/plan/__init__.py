"""The memory planner: per-GPU memory of a training config by component and phase, before it runs.

    from trainfit.config import load_config
    from trainfit.plan import plan
    p = plan(load_config("examples/qwen3_8b_grpo_lora_h200.yaml"), gpu="h200")
    p.peak, p.fits, p.phases["rollout"].total, p.to_dict()

It reads the same config object as `trainfit train` and never imports the trainer. Modules:
api (the entry: a bare plan, then suggestions), memory (the assembler), states (weights, adapters,
gradients, optimizer), trace and head (activations traced under FakeTensorMode), lengths (from the data),
rollout (generation engines), work and steptime (the step's work and time), vision and screens (images),
preference (stage dpo), suggest (changes that make it fit), fit and setups (search), hardware (GPU catalog,
NVML, roofline), report (table, JSON, PNG). Architecture facts live in trainfit/models/shapes.py.
"""

from __future__ import annotations


def plan(cfg, gpu=None, num_gpus=None, **kw):
    """Plan `cfg` on `gpu` (a catalog name or size; default hardware.gpu, NVML, else H100 80GB): api.plan.
    Imported on call: the planner's modules (and, on a cold cache, torch and transformers for its traces)
    are more than `trainfit.plan.hardware` readers (doctor, detection) should pay for."""
    from trainfit.plan.api import plan as _plan

    return _plan(cfg, gpu=gpu, num_gpus=num_gpus, **kw)


__all__ = ["plan"]
