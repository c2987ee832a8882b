"""Activation bytes: the FakeTensorMode tracer against a real CPU forward of the same model.

The real run counts what autograd saves for backward (storages deduplicated, parameters excluded)
with the same hook the tracer uses; the tracer's figure comes from 2-layer traces at 64/128/256
tokens and batch 1, scaled to the real run's layers, batch and length. Target: within 5%.
"""

import os
import tempfile

os.environ.setdefault("TRAINFIT_CACHE", tempfile.mkdtemp(prefix="trainfit-plan-test-"))

import pytest
import torch

from trainfit import algos
from trainfit.plan.head import HeadSpec, head_memory
from trainfit.models.shapes import arch_facts, locate
from trainfit.plan.trace import TRACE_LAYERS, TraceSpec, trace, trace_config
from trainfit.plan.tracker import LiveTracker

from head_helpers import real_grpo_head_peak

DT = {"fp32": torch.float32, "bf16": torch.bfloat16}


def real_saved(preset: str, spec: TraceSpec, batch: int, tokens: int, ckpt: bool) -> tuple[int, int]:
    """(saved-for-backward bytes, peak live bytes above the end of forward) of a real CPU step:
    the model's forward on a padded batch, then the SFT loss from trainfit.algos, then backward."""
    from transformers import AutoModelForCausalLM

    from trainfit.models.presets import preset_config

    torch.manual_seed(0)
    cfg = preset_config(preset)
    model = AutoModelForCausalLM.from_config(cfg, dtype=DT[spec.dtype], attn_implementation=spec.attn)
    model.train()
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if spec.peft != "none":
        from peft import LoraConfig, get_peft_model

        if ckpt:
            model.enable_input_require_grads()
        model = get_peft_model(model, LoraConfig(r=spec.r, lora_alpha=spec.alpha, target_modules="all-linear",
                                                 use_dora=spec.peft == "dora", task_type="CAUSAL_LM"))
        if spec.lora_in_model_dtype():  # what the trainer does (models.attach_adapters)
            from trainfit.models.lora_compute import lora_compute_in_input_dtype

            lora_compute_in_input_dtype(model)
    ids = torch.randint(3, cfg.vocab_size, (batch, tokens))
    mask = torch.ones(batch, tokens, dtype=torch.long)
    mask[0, :5] = 0  # a padded row: the trainer's batches are padded, so the mask is materialized
    params = {id(p.untyped_storage()) for p in model.parameters()} | {id(b.untyped_storage()) for b in model.buffers()}
    tracker = LiveTracker(params)
    import gc

    gc.disable()
    try:
        with tracker.mode, torch.autograd.graph.saved_tensors_hooks(tracker.pack, lambda t: t):
            logits = model(input_ids=ids, attention_mask=mask).logits
            loss, _ = algos.sft_loss(logits, ids.masked_fill(mask == 0, -100))
            del logits
            tracker.mark("forward")
            loss.backward()
    finally:
        gc.enable()
    grads = {tracker.serial_of(p.grad) for p in model.parameters() if p.grad is not None}
    end = sum(tracker.live_at(tracker.marks["forward"], skip=grads).values())
    return tracker.saved_bytes(), tracker.peak(skip=grads) - end


def predicted_saved(preset: str, spec: TraceSpec, batch: int, tokens: int, ckpt: bool) -> int:
    src = locate(preset)
    facts = arch_facts(src)
    mode = "ckpt" if ckpt else "train"
    tr = trace(src, spec, modes=(mode,))
    body = tr.at(f"{mode}_saved", tokens, batch) + (facts.n_layers - TRACE_LAYERS) * tr.at(f"{mode}_saved_layer", tokens, batch)
    head = head_memory(HeadSpec("sft", facts.vocab, facts.hidden, spec.dtype, batch, tokens,
                                head_trainable=spec.peft == "none"))
    return int(body + head["saved"])


@pytest.mark.parametrize("preset,dtype,peft,ckpt,compute", [
    ("preset:tiny", "bf16", "lora", False, "model"),
    ("preset:tiny", "bf16", "lora", False, "fp32"),   # peft's fp32 input copies (peft.adapter_compute=fp32)
    ("preset:small", "bf16", "none", False, "model"),
    ("preset:small", "bf16", "lora", True, "model"),
    ("preset:tiny", "fp32", "dora", False, "model"),
])
def test_traced_saved_bytes_match_a_real_cpu_forward(preset, dtype, peft, ckpt, compute):
    spec = TraceSpec(dtype=dtype, peft=peft, r=8, alpha=16, device="cpu",  # compared with a CPU forward
                     adapter_compute=compute)
    batch, tokens = 2, 192  # neither is a traced point: batch and length scaling are checked too
    real, _ = real_saved(preset, spec, batch, tokens, ckpt)
    pred = predicted_saved(preset, spec, batch, tokens, ckpt)
    assert abs(pred - real) <= 0.05 * real, (pred, real)


def test_trace_is_deterministic_and_cached(tmp_path, monkeypatch):
    import trainfit.plan.trace as T

    src = locate("preset:tiny")
    spec = TraceSpec(dtype="bf16")
    first = trace(src, spec)
    T._MEMO.clear()
    again = trace(src, spec)  # from the disk cache, not traced again
    assert again.coef == first.coef and set(first.coef) >= {"train_layer", "ckpt_layer", "nograd_peak"}
    assert again.at("train_layer", 300, 2) > again.at("train_layer", 300, 1) > 0


def test_checkpointing_keeps_only_layer_inputs():
    src = locate("preset:small")
    tr = trace(src, TraceSpec(dtype="bf16"), modes=("train", "ckpt"))
    hidden = arch_facts(src).hidden
    # Under checkpointing a layer keeps its input hidden state [T, d] in bf16 and nothing else.
    assert tr.at("ckpt_layer", 512) == pytest.approx(512 * hidden * 2, rel=0.01)
    assert tr.at("train_layer", 512) > 5 * tr.at("ckpt_layer", 512)


def test_sdpa_trace_has_no_attention_matrix():
    # Fake CPU tensors take the fused SDPA kernel: per layer, the only [T, T] term is the padding mask
    # converted for the kernel (2 bytes per entry, shared by the heads), while eager attention keeps the
    # probabilities of every head.
    src = locate("preset:tiny")
    heads = arch_facts(src).heads
    sdpa = trace(src, TraceSpec(dtype="bf16", attn="sdpa"), modes=("train",))
    eager = trace(src, TraceSpec(dtype="bf16", attn="eager"), modes=("train",))
    assert sdpa.coef["train_layer"][2] <= 4
    assert eager.coef["train_layer"][2] >= 2 * heads
    packed = trace(src, TraceSpec(dtype="bf16", attn="sdpa", padded=False), modes=("train",))
    assert packed.coef["train_layer"][2] < 1e-6  # no mask at all: linear in T
    assert trace_config  # the layer-count helper is part of the module's API


def test_grpo_head_plan_matches_the_real_policy_rows_head():
    """trainfit's GRPO head (LM head at the policy positions only, row log-probs with entropy, the
    loss, backward): the planner's fake-tensor figure against the same step on real tensors, where
    the rows are picked with the boolean mask as transformers' `logits_to_keep` does."""
    b, t, new, d, v = 3, 400, 40, 32, 4000
    spec = HeadSpec("grpo", v, d, "fp32", b, t, new_tokens=new, chunk_rows=32, policy_rows=True)
    planned = head_memory(spec)
    real_peak = real_grpo_head_peak(b, t, new, d, v, 32, fused=False)
    full_logits = b * t * v * 4
    assert planned["peak"] == pytest.approx(real_peak, rel=0.1)
    assert planned["peak"] < full_logits  # no [b, T, V] logits anywhere


@pytest.mark.parametrize("dtype,chunk", [("fp32", 0), ("fp32", 128), ("bf16", 0), ("bf16", 128)])
def test_sft_head_plan_bounds_the_labelled_rows_head(dtype, chunk):
    """trainfit's SFT runs the head at the labelled positions only (`label_logprobs`); the planner
    plans full [b, T, V] logits. With every position labelled (the worst case, pretraining) the real
    rows step must stay within the plan, and a half-masked batch well under it."""
    b, t, d, v = 2, 300, 64, 5000
    planned = head_memory(HeadSpec("sft", v, d, dtype, b, t, chunk_rows=chunk))["peak"]

    def real_peak(labelled_from: int) -> int:
        hidden = torch.randn(b, t, d, dtype=DT[dtype], requires_grad=True)
        weight = torch.nn.Parameter(torch.randn(v, d, dtype=DT[dtype]) * 0.02, requires_grad=False)
        labels = torch.randint(0, v, (b, t))
        labels[:, :labelled_from] = -100
        tracker = LiveTracker({id(hidden.untyped_storage()), id(weight.untyped_storage())})
        import gc

        gc.disable()
        try:
            with tracker.mode, torch.autograd.graph.saved_tensors_hooks(tracker.pack, lambda x: x):
                shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)
                keep = shifted != -100
                rows = torch.nn.functional.linear(hidden[keep], weight)              # [n, V]
                logp = algos.token_logprobs_rows(rows, shifted[keep], 1.0, chunk)[0]
                del rows
                loss = algos.nll_mean(logp.sum(), logp.numel())
                tracker.mark("forward")
                loss.backward()
        finally:
            gc.enable()
        return tracker.peak()

    assert real_peak(0) <= planned * 1.01
    assert real_peak(t // 2) < 0.7 * planned
