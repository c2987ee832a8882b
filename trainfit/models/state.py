"""A model's trainable state as a checkpoint saves it: the adapters of a PEFT model, else every tensor once."""

from __future__ import annotations

import torch


def trainable_state(model, is_peft: bool) -> dict[str, torch.Tensor]:
    if hasattr(model, "trainable_state_dict"):  # a module of several models (PPO's value_model.PolicyCritic)
        return model.trainable_state_dict()
    if is_peft:
        from peft import get_peft_model_state_dict
        return {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(model).items()}
    # Tied weights (embeddings = LM head) are one tensor; keep the first name only.
    seen, out = set(), {}
    for k, v in model.state_dict().items():
        if v.data_ptr() in seen:
            continue
        seen.add(v.data_ptr())
        out[k] = v.detach().cpu().contiguous()
    return out


def load_trainable_state(model, is_peft: bool, sd: dict[str, torch.Tensor]) -> None:
    if hasattr(model, "load_trainable_state_dict"):
        model.load_trainable_state_dict(sd)
        return
    if is_peft:
        from peft import set_peft_model_state_dict
        set_peft_model_state_dict(model, sd)
        return
    missing, unexpected = model.load_state_dict(sd, strict=False)
    tied = {k for k in missing if k.endswith("lm_head.weight")}
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"checkpoint does not match the model: missing {sorted(set(missing) - tied)[:5]}, "
                           f"unexpected {sorted(unexpected)[:5]}")
