"""train.fused_head: the LM head fused with the log-probs, so no `[n, V]` logits are kept.

The model is still called as itself (through DDP / DeepSpeed / PEFT wrappers, so their hooks run),
with its output embedding's forward made the identity for that call: the model's `logits` are then
the final hidden rows `[n, d]` at the scored positions, and the head is applied by
`algos.linear_token_logprobs` (`chunked`, any device) or Liger's fused linear cross-entropy
(`liger`, CUDA + the `liger` extra), both with `model.get_output_embeddings().weight`.

That is only the model's own head when the head is a plain linear layer whose output the model
returns unchanged. Refused (ConfigError, at stage start): a head that is not a plain `nn.Linear`
(LoRA-adapted, quantized), a model that transforms its logits after the head (softcapping, logit
scales, a final bias), a head weight sharded outside the forward (FSDP, DeepSpeed ZeRO-3; the
config rules refuse those engines before a model is loaded).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from trainfit.config.stages import stage_spec
from trainfit.config import Config, ConfigError
from trainfit.models.head_transforms import config_head_problem
from trainfit.models.policy import unwrap

MODES = ("off", "chunked", "liger")


def liger_available() -> bool:
    try:
        import liger_kernel.ops.fused_linear_cross_entropy  # noqa: F401
    except Exception:   # not installed, or no triton / CUDA build behind it
        return False
    return True


def head_problem(model) -> Optional[str]:
    """Why the fused head cannot stand in for `model`'s own head, or None when it can."""
    base = unwrap(model, peft=True)
    get = getattr(base, "get_output_embeddings", None)
    head = get() if get is not None else None
    if head is None:
        return f"{type(base).__name__} has no output embedding (get_output_embeddings() is None)"
    if type(head) is not torch.nn.Linear:
        return (f"its LM head is a {type(head).__module__}.{type(head).__name__}, not a plain torch.nn.Linear "
                "(a LoRA-adapted or quantized head computes more than hidden @ weight.T)")
    cfgs = [getattr(base, "config", None)]
    text = getattr(cfgs[0], "get_text_config", None)
    cfgs.append(text() if text is not None else None)
    for c in filter(None, cfgs):
        why = config_head_problem(c)
        if why is not None:
            return why
    if getattr(base, "final_logits_bias", None) is not None:
        return "it adds final_logits_bias to the logits after the head"
    w = head.weight
    if hasattr(w, "ds_id") or type(w).__name__ == "DTensor":
        return "its head weight is sharded (DeepSpeed ZeRO-3 / FSDP) and whole only inside the forward"
    return None


def resolve(cfg: Config, model, device) -> str:
    """The head path a stage uses: `off`, `chunked` or `liger` (train.fused_head resolved).

    `auto` is `liger` on CUDA when the liger extra imports and the model allows it, else `off` (the
    plain head: CPU runs and models the fused head cannot serve keep today's path). An explicit
    `chunked` / `liger` that cannot run is a ConfigError naming the reason and the fix."""
    mode = cfg.train.fused_head
    cuda = torch.device(device).type == "cuda"
    if mode == "off" or stage_spec(cfg.stage).plain_head:  # e.g. rm: no LM head (config rule for explicit modes)
        return "off"
    if mode == "auto":
        ok = cuda and cfg.engine() not in ("fsdp",) and not (cfg.engine() == "deepspeed"
                                                             and cfg.distributed.zero_stage == 3)
        return "liger" if ok and liger_available() and head_problem(model) is None else "off"
    if mode == "liger" and not cuda:
        raise ConfigError(f"train.fused_head=liger runs Liger's Triton kernel, which needs a CUDA device, but this "
                          f"stage trains on {torch.device(device).type}; use train.fused_head=chunked (any device) "
                          "or off.")
    if mode == "liger" and not liger_available():
        raise ConfigError("train.fused_head=liger needs liger-kernel (with triton): pip install 'trainfit[liger]', "
                          "or use train.fused_head=chunked (no extra package) or off.")
    why = head_problem(model)
    if why is not None:
        raise ConfigError(f"train.fused_head={mode} cannot replace the LM head of model.name={cfg.model.name!r}: "
                          f"{why}. Set train.fused_head=off (or auto) for this model.")
    return mode


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


@contextlib.contextmanager
def identity_head(model):
    """Context: `model`'s output embedding returns its input, so a forward's `logits` are the final
    hidden rows `[..., d]`; yields the head module (its weight and bias are the head's)."""
    head = unwrap(model, peft=True).get_output_embeddings()
    own = head.__dict__.get("forward")  # a forward some library set on the instance (accelerate's hooks)
    head.forward = _identity            # an instance attribute shadows nn.Linear.forward for this call
    try:
        yield head
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own


def liger_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
                   temperature: float) -> torch.Tensor:
    """log p(target) `[n]` (fp32) from Liger's fused linear cross-entropy, reduction none (its
    per-row loss is -log p). The temperature divides the hidden rows: (h / T) W^T = (h W^T) / T
    (a bias is divided too, so (h W^T + b) / T holds with one)."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    scaled = temperature > 0 and temperature != 1.0
    h = hidden.to(weight.dtype)
    if scaled:
        h = h / temperature
        bias = None if bias is None else bias / temperature
    loss = liger_fused_linear_cross_entropy(h, weight, targets, bias=bias, reduction="none")   # [n]
    return -loss.float()
