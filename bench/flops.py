"""Model FLOPs per benchmark step and MFU, the same count for both sides.

MFU = model FLOPs per optimizer step / step seconds / the card's dense bf16 peak (trainfit's GPU
catalog, trainfit/plan/hardware.py, looked up from torch.cuda.get_device_name). Model FLOPs count the
work the workload needs, not what an implementation spends: recomputation, padding and extra
forwards (e.g. old-policy log-probs) are not counted, so they show up as lower MFU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

FORMULA = (
    "N = parameters that multiply activations (all weights but the input embedding; a tied embedding "
    "counts once, as the LM head; LoRA adapters left out), A(S) = 2 x layers x heads x head_dim x S^2, "
    "the causal attention (QK^T and AV) of one S-token sequence's forward. Training: fb x N x T + 3 x "
    "sum A(S) over sequences, fb = 6 for full fine-tuning, 4 with LoRA (frozen weights: forward and "
    "input gradients only). GRPO generation adds 2 x N x T + sum A(S) (every prompt and completion token "
    "through the model once). T = tokens trained per step (SFT: global batch x seq_len; GRPO: prompt + "
    "completion tokens, completions through the first eos), S for GRPO = T / sequences (mean length). "
    "MFU = FLOPs of the steps after the first / their seconds / dense bf16 peak; mfu_train counts the "
    "training FLOPs over the step time outside generate.")


def model_facts(model_dir: str) -> dict:
    """Counts the FLOP formula needs, from the model directory's config (meta device, no weights)."""
    from transformers import AutoConfig

    from trainfit.models.shapes import build_meta

    cfg = AutoConfig.from_pretrained(model_dir)
    model = build_meta(cfg)
    total = sum(p.numel() for p in model.parameters())  # a tied weight is one parameter
    embed = model.get_input_embeddings().weight.numel()
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    tied = bool(getattr(text, "tie_word_embeddings", False))
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return {"params": total, "matmul_params": total if tied else total - embed, "layers": text.num_hidden_layers,
            "heads": heads, "head_dim": head_dim, "tied_embeddings": tied}


def attention(facts: dict, seq: float) -> float:
    """Causal attention FLOPs of one forward over one `seq`-token sequence."""
    return 2.0 * facts["layers"] * facts["heads"] * facts["head_dim"] * seq * seq


def step_flops(kind: str, lora: bool, facts: dict, train_tokens: int, sequences: int) -> dict:
    """{"train": ..., "generate": ..., "total": ...} model FLOPs of one optimizer step."""
    n = facts["matmul_params"]
    seq = train_tokens / max(sequences, 1)
    attn = sequences * attention(facts, seq)
    train = (4 if lora else 6) * n * train_tokens + 3 * attn
    gen = 2.0 * n * train_tokens + attn if kind == "grpo" else 0.0
    return {"train": train, "generate": gen, "total": train + gen}


def peak_flops(gpu_name: Optional[str]) -> Optional[float]:
    """Dense bf16 FLOP/s of the named card from trainfit's catalog; None off-GPU or for an unknown card."""
    if not gpu_name:
        return None
    from trainfit.plan.hardware import from_device_name

    card = from_device_name(gpu_name)
    return None if card is None else card.bf16_tflops * 1e12


def run_mfu(spec, facts: dict, r: dict) -> dict:
    """MFU of one side's run (steps after the first), or Nones when not on a catalogued GPU."""
    peak = peak_flops(r.get("gpu_name"))
    keep = slice(1, None) if len(r["step_s"]) > 1 else slice(None)
    steps, gen_s, tokens = r["step_s"][keep], r["gen_s"][keep], r["train_tokens"][keep]
    flops = [step_flops(spec.kind, bool(spec.lora_r), facts, t, spec.global_batch) for t in tokens]
    out = {"peak_flops": peak, "flops_per_step": sum(f["total"] for f in flops) / max(len(flops), 1),
           "mfu": None, "mfu_train": None}
    if peak and sum(steps) > 0:
        out["mfu"] = sum(f["total"] for f in flops) / sum(steps) / peak
        train_s = sum(s - g for s, g in zip(steps, gen_s))
        if train_s > 0:
            out["mfu_train"] = sum(f["train"] for f in flops) / train_s / peak
    return out


def facts_for(spec) -> Optional[dict]:
    """model_facts of a prepared spec, None when it has no model directory."""
    return model_facts(spec.model_dir) if spec.model_dir and Path(spec.model_dir).exists() else None
