"""LoRA's matmuls in the base's bf16 with fp32 adapter weights (`peft.adapter_compute=model`).

peft keeps LoRA weights fp32 on a bf16 base (`autocast_adapter_dtype`) and casts each adapted layer's
input to fp32 for them; autograd then keeps that fp32 copy for lora_A's weight gradient, one per
adapted module, while the frozen base matmuls keep nothing. On Qwen2.5-0.5B that is 44.5 of the 80 KB
saved per token per layer (bench/memory_vs_trl.py). Casting the small weights to bf16 instead, as
torch autocast does, keeps the bf16 inputs already there (shared by q/k/v and by gate/up). The policy,
the reward model and the critic are patched after `get_peft_model`; the planner traces through the same
function (plan/trace.py).
"""

from __future__ import annotations

import torch


class InputDtypeLinear(torch.nn.Linear):
    """A LoRA A or B matrix whose fp32 weight is cast to its input's dtype for the matmul, as torch
    autocast does: x [..., in] (bf16) @ W.to(bf16).T -> [..., out] (bf16). The gradient reaches the
    fp32 weight through the cast, so `.grad` and the optimizer state stay fp32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return torch.nn.functional.linear(x, self.weight.to(x.dtype), bias)


def lora_compute_in_input_dtype(model) -> int:
    """Make peft's plain-LoRA linear layers compute in their input's dtype; returns how many: peft's
    input cast is switched off (its `cast_input_dtype_enabled` flag) and the A and B matrices become
    `InputDtypeLinear`s (same parameters and state-dict keys)."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    n = 0
    for m in model.modules():
        if isinstance(m, LoraLinear) and not getattr(m, "lora_variant", {}) and not any(m.use_dora.values()):
            m.cast_input_dtype_enabled = False
            for sub in [*m.lora_A.values(), *m.lora_B.values()]:
                if type(sub) is torch.nn.Linear:
                    sub.__class__ = InputDtypeLinear
            n += 1
    return n

