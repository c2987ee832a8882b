"""QLoRA in the planner: the fp32 upcast of every non-quantized parameter (shared with the trainer,
models.kbit.kbit_upcast), fp32 layer inputs saved under checkpointing, and the LM head in fp32."""

import importlib.util
import json
import os
import tempfile

os.environ.setdefault("TRAINFIT_CACHE", tempfile.mkdtemp(prefix="trainfit-plan-test-"))

import pytest
import torch

from trainfit.models.shapes import arch_facts, instantiate, locate
from trainfit.plan.states import base_weight_bytes, nf4_bytes
from trainfit.plan.trace import TraceSpec, kbit_body, trace
from trainfit.models.presets import preset_config

HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
# preset:tiny: hidden 64, 2 layers, head_dim 16, vocab 512, tied embeddings. Not quantized: the
# embedding [512, 64] and the norms (input / post-attention [64] and q / k norms [16] per layer,
# the final [64]).
TINY_FP32 = ["model.embed_tokens.weight", "model.norm.weight"] + [
    f"model.layers.{i}.{n}.weight" for i in range(2)
    for n in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm")]
TINY_FP32_NUMEL = 512 * 64 + 64 + 2 * (64 + 64 + 16 + 16)   # 33,152 -> 132,608 bytes in fp32


def _meta_tiny():
    with torch.device("meta"):
        return instantiate(preset_config("preset:tiny"), torch.bfloat16)


def test_upcast_rule_on_the_meta_model_and_the_weight_bytes():
    model = _meta_tiny()
    cast = kbit_body(model, TraceSpec("bf16", quantization="4bit"))
    assert sorted(cast) == sorted(TINY_FP32)
    params = dict(model.named_parameters())
    assert sum(params[n].numel() for n in cast) == TINY_FP32_NUMEL
    assert all(params[n].dtype == torch.float32 for n in cast)
    # The planner's weight bytes: the same fp32 parameters, every other linear as NF4 double-quant.
    quantized = [p.numel() for n, p in params.items() if n not in cast]
    buffers = 4 * sum(b.numel() for b in model.buffers() if b.is_floating_point())
    hand = 4 * TINY_FP32_NUMEL + sum(nf4_bytes(n, True) for n in quantized) + buffers
    assert base_weight_bytes(arch_facts("preset:tiny"), "bf16", "4bit", double_quant=True) == hand


@pytest.mark.skipif(not HAS_BNB, reason="needs bitsandbytes (4-bit loads on CPU from 0.49)")
def test_trainer_upcasts_exactly_what_the_planner_traces(tmp_path):
    from transformers import AutoModelForCausalLM

    from trainfit.config import ModelConfig, PeftConfig
    from trainfit.models.policy import attach_adapters, load_base_model

    AutoModelForCausalLM.from_config(preset_config("preset:tiny"), dtype=torch.bfloat16).save_pretrained(tmp_path)
    mc = ModelConfig(name=str(tmp_path), dtype="bf16", quantization="4bit")
    model, _ = load_base_model(mc, torch.device("cpu"))
    model = attach_adapters(model, PeftConfig(method="lora", r=8, alpha=16), mc, seed=0)
    base = model.get_base_model()
    fp32 = sorted(n.replace(".base_layer", "") for n, p in base.named_parameters()
                  if p.dtype == torch.float32 and "lora_" not in n)
    assert fp32 == sorted(TINY_FP32)
    assert all(type(p).__name__ == "Params4bit" for n, p in base.named_parameters()
               if "lora_" not in n and n.replace(".base_layer", "") not in TINY_FP32)


def test_quantized_trace_saves_fp32_layer_inputs_and_counts_dequantized_weights(tmp_path):
    cfg = preset_config("preset:small").to_dict()   # hidden 256, intermediate 768, 4 layers
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    src = locate(str(tmp_path))
    spec = dict(dtype="bf16", peft="lora", r=8, alpha=16, padded=False)
    bf16 = trace(src, TraceSpec(**spec), modes=("ckpt",))
    q4 = trace(src, TraceSpec(**spec, quantization="4bit"), modes=("ckpt",))
    # Checkpointing keeps each layer's input: [T, 256] in bf16 (512 B a token) or, with the fp32
    # embedding of a k-bit base, in fp32 (1024 B a token).
    assert bf16.per_token("ckpt_layer") == pytest.approx(2 * 256, rel=1e-6)
    assert q4.per_token("ckpt_layer") == pytest.approx(4 * 256, rel=1e-6)
    # A layer's backward dequantizes a weight: the largest is [768, 256] in bf16 (393,216 B) with its
    # fp32 absmax, twice with double quantization (2 x 4 x 3072 B): a constant the bf16 trace lacks.
    assert q4.coef["ckpt_transient"][0] - bf16.coef["ckpt_transient"][0] >= 768 * 256 * 2


def test_qlora_plan_has_fp32_weights_and_fp32_head(tmp_path):
    from trainfit.config.io import validate
    from trainfit.plan import plan
    from trainfit.plan.head import HeadSpec, head_memory

    cfg = preset_config("preset:small").to_dict()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "data.txt").write_text("hello world\n" * 4)
    raw = {"stage": "pretrain", "model": {"name": str(tmp_path), "quantization": "4bit", "gradient_checkpointing": True},
           "peft": {"method": "lora", "r": 8, "alpha": 16},
           "data": {"path": str(tmp_path / "data.txt"), "max_seq_length": 256, "eval_fraction": 0.0},
           "train": {"micro_batch_size": 2, "global_batch_size": 2, "device": "cpu"}}
    p = plan(validate(raw), gpu="h100-80gb", suggest=False)
    items = {i.name: i.train for i in p.items}
    facts = arch_facts(str(tmp_path))
    assert items["policy weights (NF4 double-quant)"] == base_weight_bytes(facts, "bf16", "4bit", True)
    head = head_memory(HeadSpec("sft", facts.vocab, facts.hidden, "fp32", 2, 256))["peak"]
    # The head runs in fp32 (the tied embedding, hence the LM head, is fp32): planned at that dtype.
    if "logits + loss peak" in items:
        assert items["logits + loss peak"] == head
    else:
        assert items["layer backward transient"] >= head
