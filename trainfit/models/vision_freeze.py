"""Freezing the vision tower and the projector of a vision-language model (model.freeze_vision_tower,
model.freeze_projector); which module is which comes from lora_rules.module_part."""

from __future__ import annotations

from trainfit.models.lora_rules import module_part, vlm_all_linear


def trained_parts(mc) -> dict[str, bool]:
    """Which parts of a VLM a full fine-tune trains under model config `mc`."""
    return {"language": True, "tower": not mc.freeze_vision_tower, "projector": not mc.freeze_projector}


def apply_freeze(model, mc) -> dict[str, int]:
    """requires_grad off for the frozen parts' parameters; returns parameters frozen per part."""
    parts = trained_parts(mc)
    frozen = {"tower": 0, "projector": 0}
    for name, p in model.named_parameters():
        part = module_part(name)
        if not parts[part]:
            p.requires_grad_(False)
            frozen[part] += p.numel()
    return frozen


def lora_target_regex(model, mc) -> str:
    """peft target_modules for `all-linear` on a VLM: the language model's linears (and the tower's /
    projector's where trained), output head excluded."""
    import torch


    head = model.get_output_embeddings()
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head]
    parts = trained_parts(mc)
    return vlm_all_linear(names, tower=parts["tower"], projector=parts["projector"])
