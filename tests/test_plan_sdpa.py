"""The planner traces the SDPA kernel CUDA picks: the math kernel (full [T, T] scores) for fp32
attention with grouped KV heads, the fused kernel (a log-sum-exp per row) otherwise."""

import json

import pytest

from trainfit.models.shapes import locate
from trainfit.plan.trace import TraceSpec, math_sdpa, trace
from trainfit.models.presets import preset_config


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    d = tmp_path_factory.mktemp("small")
    (d / "config.json").write_text(json.dumps(preset_config("preset:small").to_dict()))  # 8 heads, 4 KV heads
    return locate(str(d))


def test_kernel_choice_rules(small):
    cfg = small.config
    assert math_sdpa(cfg, TraceSpec(dtype="fp32", padded=False))                 # fp32 + GQA on CUDA
    assert math_sdpa(cfg, TraceSpec(dtype="bf16", quantization="4bit"))           # k-bit base: fp32 stream
    assert not math_sdpa(cfg, TraceSpec(dtype="bf16"))                           # flash takes bf16
    assert not math_sdpa(cfg, TraceSpec(dtype="fp32", device="cpu"))             # CPU's fused kernel
    assert not math_sdpa(cfg, TraceSpec(dtype="fp32", attn="eager"))             # not SDPA at all
    mha = dict(cfg, num_key_value_heads=cfg["num_attention_heads"])
    assert not math_sdpa(mha, TraceSpec(dtype="fp32"))                           # no grouped KV heads


def test_math_kernel_saves_the_attention_scores(small):
    # Per sequence of T tokens, one layer's saved tensors grow by the softmax probabilities
    # [heads, T, T] in fp32: 8 heads x 4 bytes = 32 bytes x T^2 more than the fused kernel keeps.
    cuda = trace(small, TraceSpec(dtype="fp32", padded=False), modes=("train",))
    cpu = trace(small, TraceSpec(dtype="fp32", padded=False, device="cpu"), modes=("train",))
    extra_t2 = cuda.coef["train_saved_layer"][2] - cpu.coef["train_saved_layer"][2]
    assert extra_t2 == pytest.approx(8 * 4, rel=1e-6)
    assert any("math kernel" in n for n in cuda.notes) and not any("math kernel" in n for n in cpu.notes)
