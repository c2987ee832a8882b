"""LoRA on a bf16 base computes in bf16 (peft.adapter_compute=model) with fp32 adapter weights.

peft keeps the adapters fp32 and casts each adapted layer's input to fp32, and autograd keeps that
copy for backward; trainfit casts the small adapter weights instead (models.lora_compute_in_input_dtype).
These tests check on a real CPU step of preset:tiny in bf16: no fp32 copy of a layer input is saved
for backward (peft.adapter_compute=fp32 saves them), the adapter weights, their gradients and AdamW's
state stay fp32, the gradients agree with the fp32 computation to bf16 precision, and the saved
adapter has the same keys.
"""

import pytest
import torch

from trainfit.config import ModelConfig, PeftConfig
from trainfit.models.policy import load_policy

B, T = 2, 24


def step(compute: str):
    """(saved-for-backward (dtype, shape) list, {adapter name: grad}, model) of one forward+backward."""
    mc = ModelConfig(name="preset:tiny", dtype="bf16", attn_implementation="sdpa")
    loaded = load_policy(mc, PeftConfig(method="lora", r=8, alpha=16, adapter_compute=compute),
                         torch.device("cpu"), seed=0)
    model = loaded.model.train()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # LoRA B starts at zero: give it values so both factors get gradients
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    ids = torch.randint(3, len(loaded.tokenizer), (B, T), generator=g)
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(input_ids=ids).logits
    logits.float().logsumexp(-1).mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return saved, grads, model


def test_bf16_lora_keeps_no_fp32_layer_inputs_and_fp32_master_weights():
    cfg = load_policy(ModelConfig(name="preset:tiny"), PeftConfig(), torch.device("cpu")).model.config
    d, inter = cfg.hidden_size, cfg.intermediate_size
    saved, grads, model = step("model")
    saved_fp32, grads_fp32, _ = step("fp32")

    def fp32_acts(entries, width):
        # [B, T, width] or its [B*T, width] view (what a linear's matmul saves)
        return sum(1 for dt, sh in entries if dt == torch.float32 and sh and sh[-1] == width
                   and torch.Size(sh[:-1]).numel() == B * T)

    # peft's cast: one fp32 copy of down_proj's [B, T, intermediate] input per layer, plus one per other
    # adapted module on top of the RMSNorms' own fp32 [B, T, d] tensors.
    assert fp32_acts(saved_fp32, inter) == cfg.num_hidden_layers
    assert fp32_acts(saved, inter) == 0
    assert fp32_acts(saved, d) < fp32_acts(saved_fp32, d)
    # Master weights and gradients stay fp32; only the matmuls run in bf16.
    assert grads and all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)
    assert all(g is not None and g.dtype == torch.float32 for g in grads.values())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    opt.step()
    assert all(v.dtype == torch.float32 for s in opt.state.values() for k, v in s.items() if k != "step")
    # Same gradients as the fp32 adapter computation, to bf16 precision.
    num = sum(float((grads[k] - grads_fp32[k]).pow(2).sum()) for k in grads)
    den = sum(float(grads_fp32[k].pow(2).sum()) for k in grads)
    assert 0 < (num / den) ** 0.5 < 0.05
    # The adapter saves as peft's (the weights are plain fp32 parameters under the usual names).
    from peft import get_peft_model_state_dict

    sd = get_peft_model_state_dict(model)
    assert sd and all(v.dtype == torch.float32 for v in sd.values())


@pytest.mark.parametrize("method,dtype", [("dora", "bf16"), ("lora", "fp32")])
def test_other_adapters_keep_peft_compute(method, dtype):
    from trainfit.models.lora_compute import InputDtypeLinear

    loaded = load_policy(ModelConfig(name="preset:tiny", dtype=dtype), PeftConfig(method=method, r=4),
                         torch.device("cpu"))
    assert not any(isinstance(m, InputDtypeLinear) for m in loaded.model.modules())
