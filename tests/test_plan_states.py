"""Model-state bytes (weights, trainable parameters, gradients, optimizer state, master weights)
against the real tensors after one optimizer step, and the quantization / ZeRO arithmetic by hand."""

import importlib.util
import os
import tempfile

os.environ.setdefault("TRAINFIT_CACHE", tempfile.mkdtemp(prefix="trainfit-plan-test-"))

import pytest
import torch

from trainfit.models.shapes import arch_facts
from trainfit.plan.states import (BNB_QMAPS, Parallel, adam8bit_bytes, adam8bit_total, base_weight_bytes,
                                   model_states, nf4_bytes)

HAS_BNB = importlib.util.find_spec("bitsandbytes") is not None
DT = {"fp32": torch.float32, "bf16": torch.bfloat16}


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def unique_bytes(tensors) -> int:
    """Bytes of distinct storages: bitsandbytes' 8-bit states all reference one pair of quantization
    maps, which occupy memory once."""
    seen = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _quantized_tiny(tmp_path, dtype: str, method: str):
    """preset:tiny saved to a directory and loaded 4-bit by the trainer's own code (models.py)."""
    from transformers import AutoModelForCausalLM

    from trainfit.config import ModelConfig, PeftConfig
    from trainfit.models.policy import attach_adapters, load_base_model
    from trainfit.models.presets import preset_config

    AutoModelForCausalLM.from_config(preset_config("preset:tiny"), dtype=DT[dtype]).save_pretrained(tmp_path)
    mc = ModelConfig(name=str(tmp_path), dtype=dtype, quantization="4bit", bnb_4bit_double_quant=True)
    model, _ = load_base_model(mc, torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    return attach_adapters(model, PeftConfig(method=method, r=8, alpha=16), mc, seed=0)


def real_states(dtype: str, method: str, optimizer: str, quant: str = "none", tmp_path=None) -> dict:
    """Build preset:tiny as the trainer does, take one AdamW step, and measure the real tensors."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from trainfit.models.presets import preset_config

    torch.manual_seed(0)
    if quant == "4bit":
        model = _quantized_tiny(tmp_path, dtype, method)
    else:
        model = AutoModelForCausalLM.from_config(preset_config("preset:tiny"), dtype=DT[dtype])
    if method != "none" and quant == "none":
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                                 use_dora=method == "dora", task_type="CAUSAL_LM"))
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer == "adamw":
        opt = torch.optim.AdamW(params, lr=1e-3)
    else:
        import bitsandbytes as bnb

        opt = (bnb.optim.AdamW8bit if optimizer == "adamw_8bit" else bnb.optim.PagedAdamW8bit)(params, lr=1e-3)
    device = next(model.parameters()).device
    ids = torch.randint(3, 500, (2, 16), device=device)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    weights = sum(nbytes(p) for p in model.parameters()) + sum(nbytes(b) for b in model.buffers())
    if quant == "4bit":  # a 4-bit weight's absmax, offset and codes live in its quant_state
        weights += sum(quant_state_bytes(p.quant_state) for p in model.parameters() if hasattr(p, "quant_state"))
    # torch AdamW's `step` counters live on the CPU, not with the states: not counted on either side.
    state = unique_bytes(v for s in opt.state.values() for k, v in s.items()
                         if torch.is_tensor(v) and k != "step" and v.dim() > 0)
    return {"weights": weights, "trainable": sum(p.numel() for p in params),
            "grads": sum(nbytes(p.grad) for p in params), "optimizer": state}


def quant_state_bytes(qs) -> int:
    """absmax (uint8 with double quantization), the NF4 code, and the nested state's fp32 absmax and
    offset. The nested state's 256-entry code is bitsandbytes' shared dynamic map (one per process)."""
    n = nbytes(qs.absmax) + nbytes(qs.code)
    if qs.nested:
        n += nbytes(qs.state2.absmax) + nbytes(qs.offset.reshape(-1))
    return n


CASES = [(d, m, "adamw") for d in ("fp32", "bf16") for m in ("none", "lora", "dora")]
# bitsandbytes 0.50 runs its 8-bit optimizers on CPU (paged ones fall back to plain buffers there).
CASES += [pytest.param("bf16", m, o, marks=pytest.mark.skipif(not HAS_BNB, reason="bitsandbytes not installed"))
          for m in ("none", "lora") for o in ("adamw_8bit", "paged_adamw_8bit")]


@pytest.mark.parametrize("dtype,method,optimizer", CASES)
def test_state_bytes_match_real_tensors_after_one_step(dtype, method, optimizer):
    real = real_states(dtype, method, optimizer)
    st = model_states(arch_facts("preset:tiny"), dtype=dtype, trainable="full" if method == "none" else "adapters",
                      peft=method, r=8, optimizer=optimizer)
    pred = {"weights": st.weights, "trainable": st.trainable_params, "grads": st.grads, "optimizer": st.optimizer}
    for k in real:
        assert abs(pred[k] - real[k]) <= 0.01 * real[k], (k, pred[k], real[k])


@pytest.mark.skipif(not HAS_BNB, reason="QLoRA needs bitsandbytes (4-bit runs on CPU from 0.49)")
def test_qlora_state_bytes_match_real_tensors(tmp_path):
    # Loaded through trainfit.models as the trainer loads it: 4-bit linears, everything else fp32.
    real = real_states("bf16", "lora", "adamw", quant="4bit", tmp_path=tmp_path)
    st = model_states(arch_facts("preset:tiny"), dtype="bf16", trainable="adapters", peft="lora", r=8,
                      quantization="4bit", double_quant=True)
    pred = {"weights": st.weights, "trainable": st.trainable_params, "grads": st.grads, "optimizer": st.optimizer}
    for k in real:
        assert abs(pred[k] - real[k]) <= 0.01 * real[k], (k, pred[k], real[k])


def test_nf4_arithmetic_by_hand():
    n = 4096 * 4096
    # 0.5 byte a weight + one fp32 absmax per 64 weights + the 16-value fp32 code
    assert nf4_bytes(n, double_quant=False) == n // 2 + 4 * (n // 64) + 64
    # double quant: uint8 absmax, fp32 absmax per 256 of them, one fp32 offset
    blocks = n // 64
    assert nf4_bytes(n, double_quant=True) == n // 2 + blocks + 4 * (blocks // 256) + 4 + 64
    # about 4.127 bits a weight with double quantization, 4.5 without
    assert 8 * nf4_bytes(n, True) / n == pytest.approx(4.127, abs=0.01)
    assert 8 * nf4_bytes(n, False) / n == pytest.approx(4.5, abs=0.01)


def test_4bit_base_of_llama_8b():
    f = arch_facts("meta-llama/Llama-3.1-8B")
    q = base_weight_bytes(f, "bf16", "4bit", double_quant=True)
    lin = sum(g.numel for g in f.linears)  # every nn.Linear but lm_head is quantized
    assert lin == f.n_params - f.n_embed - f.n_lm_head - (2 * f.n_layers + 1) * f.hidden
    # the rest (embeddings, norms, untied LM head) in fp32 after the k-bit upcast
    assert q == pytest.approx((f.n_params - lin) * 4 + lin * 4.127 / 8 + 4 * f.n_buffer_elems, rel=0.002)


def test_adam8bit_bytes():
    assert adam8bit_bytes(1000) == 8000                    # small tensors keep fp32 state
    assert adam8bit_bytes(4096 * 2) == 2 * 8192 + 2 * 4 * 32  # two uint8 moments + fp32 absmax per 256
    assert adam8bit_bytes(4097) == 2 * 4097 + 2 * 4 * 17   # a partial last block has its absmax too
    # The signed and unsigned 256-entry fp32 maps, shared by all 8-bit tensors: 2 KiB once.
    assert BNB_QMAPS == 2048
    assert adam8bit_total([8192, 8192, 100]) == 2 * (2 * 8192 + 2 * 4 * 32) + 800 + 2048
    assert adam8bit_total([100, 4095]) == 8 * (100 + 4095)  # nothing 8-bit: no maps


def test_adam8bit_of_preset_tiny_by_hand():
    # preset:tiny (hidden 64, intermediate 256, 2 layers, 4 heads x 16, 2 kv heads, vocab 512, tied)
    # fully trained: embed [512, 64] = 32768 and per layer q/o [64, 64] = 4096 (x2), k/v [32, 64] = 2048
    # (x2), gate/up/down 16384 (x3), two norms [64] and q/k norms [16] (x2).
    # 8-bit (>= 4096): embed, q, o, gate, up, down -> 2 n + 8 ceil(n / 256) bytes each;
    # fp32 (< 4096): k, v, norms -> 8 n.
    f = arch_facts("preset:tiny")
    eight = [32768] + 2 * [4096, 4096, 16384, 16384, 16384]
    small = 2 * [2048, 2048, 64, 64, 16, 16] + [64]
    hand = sum(2 * n + 8 * (-(-n // 256)) for n in eight) + 8 * sum(small) + 2048
    st = model_states(f, dtype="bf16", trainable="full", optimizer="adamw_8bit")
    assert st.optimizer == hand


def test_zero_partitioning_by_hand():
    f = arch_facts("Qwen/Qwen2.5-7B")
    psi = f.n_params
    one = model_states(f, dtype="bf16", trainable="full", par=Parallel("single"))
    assert (one.grads, one.optimizer, one.master) == (2 * psi, 4 * psi, 0)  # bf16 pure: states in bf16
    z1 = model_states(f, dtype="bf16", trainable="full", par=Parallel("deepspeed", 1, 8))
    assert z1.master == 4 * psi // 8 and z1.optimizer == 8 * psi // 8 and z1.grads == 2 * psi
    z2 = model_states(f, dtype="bf16", trainable="full", par=Parallel("deepspeed", 2, 8))
    assert z2.grads == 2 * psi // 8 and z2.weights == one.weights
    z3 = model_states(f, dtype="bf16", trainable="full", par=Parallel("deepspeed", 3, 8))
    assert z3.weights == one.weights // 8 and z3.gathered > 0
    off = model_states(f, dtype="bf16", trainable="full", par=Parallel("deepspeed", 2, 1, offload_optimizer=True))
    assert off.optimizer == 0 and off.master == 0 and off.cpu == 12 * psi + 4 * psi  # + fp32 grad partition
    lora = model_states(f, dtype="bf16", trainable="adapters", peft="lora", r=16, par=Parallel("single"))
    # adapters for q,k,v,o,gate,up,down of 28 layers: r x (in + out) each, fp32
    per_layer = sum(16 * (i + o) for i, o in [(3584, 3584), (3584, 512), (3584, 512), (3584, 3584),
                                              (3584, 18944), (3584, 18944), (18944, 3584)])
    assert lora.trainable_params == 28 * per_layer
    assert lora.adapters == 4 * lora.trainable_params and lora.optimizer == 8 * lora.trainable_params
