"""A k-bit (bitsandbytes) base prepared for training adapters: which parameters are quantized, the norms and
head kept in fp32 (as peft's prepare_model_for_kbit_training does), and gradient checkpointing on inputs."""

from __future__ import annotations

import torch


def is_quantized_param(p: torch.nn.Parameter) -> bool:
    """A bitsandbytes-quantized weight (4-bit `Params4bit`, 8-bit `Int8Params`)."""
    return type(p).__name__ in ("Params4bit", "Int8Params")


def kbit_upcast(model, quantized=is_quantized_param) -> list[str]:
    """Cast to fp32 every fp16/bf16 parameter that is not quantized (`quantized(p)` false): the
    embeddings, the norms, biases and the LM head, tied or not. This is what peft's
    `prepare_model_for_kbit_training` does to dtypes; the planner applies this same function to its
    meta-device model (plan/trace.py) with its own rule for which weights bitsandbytes quantizes, so
    the traced dtypes are the trained ones. Returns the names of the parameters cast."""
    cast = []
    for name, p in model.named_parameters():
        if p.dtype in (torch.float16, torch.bfloat16) and not quantized(p):
            p.data = p.data.to(torch.float32)
            cast.append(name)
    return cast


def prepare_kbit(model, gradient_checkpointing: bool):
    """A quantized base made ready for adapters (peft's `prepare_model_for_kbit_training` steps):
    frozen, its non-quantized parameters in fp32 (`kbit_upcast`), and with checkpointing, inputs
    that need grad. Checkpointing itself stays as `load_policy` set it (non-reentrant); peft's helper
    would switch it to torch's reentrant default."""
    for p in model.parameters():
        p.requires_grad_(False)
    kbit_upcast(model)
    if gradient_checkpointing:
        model.enable_input_require_grads()
    return model
