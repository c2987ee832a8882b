"""Finding a model's parts: the list of its decoder layers, for the trainer and the planner alike."""

from __future__ import annotations

import torch


def layer_list(model, n: int):
    best = None
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.ModuleList) and len(m) == n:
            if name.endswith("layers"):
                return m
            best = best or m
    if best is None:
        raise RuntimeError("no decoder layer list found")
    return best
