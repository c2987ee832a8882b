"""Activation memory of the model body by tracing the real architecture under FakeTensorMode.

One forward + backward of the decoder (transformers' own modules, the attention implementation the
trainer uses, adapters applied as peft applies them) runs under
`torch._subclasses.fake_tensor.FakeTensorMode` on CPU: every tensor has a shape, a dtype and a
storage size but no memory. `tracker.LiveTracker` records what autograd saves for backward
(deduplicated by storage, parameters excluded) and every storage's birth and death, so the peak of
live bytes (saved tensors plus the transients of a layer's backward, or of the recompute under
gradient checkpointing) is known, with parameter gradients taken out (states.py counts those).

The body ends at the final norm's output [B, T, hidden]; the LM head and the loss are traced
separately at their exact size (head.py), because their memory depends on the loss code, the
vocabulary and the chunking, not on the layers.

Fake CPU tensors take SDPA's fused (flash) CPU kernel, which, like the CUDA kernels, keeps the
log-sum-exp and not the attention matrix; on the plain meta device SDPA would fall back to the math
path and store the [T, T] matrix. Batches are traced padded (an explicit mask, as the trainer's
padded SFT/GRPO batches make) except for pretraining, which packs sequences (no mask).

The traced model has TRACE_LAYERS (3) decoder layers at batch 1 and three sequence lengths
TRACE_TOKENS. Each figure is fitted exactly by a quadratic in T (the quadratic part is the [T, T]
mask, or eager attention's probabilities) and scaled linearly in batch and in layers. The middle
layer is the representative one: the first also builds what all layers share (the mask in the
dtype SDPA wants), and the last one's output only feeds the final norm.
MoE experts are traced with balanced routing (each expert gets tokens x top_k / experts tokens),
since real routing is data-dependent. Results are cached on disk (cache.py).
"""

from __future__ import annotations

import copy
import functools
import gc
import time
import types
from dataclasses import dataclass, field

from trainfit.core import cache
from trainfit.models.lora_rules import lora_in_model_dtype
from trainfit.models.shapes import ModelSource, hf_config, instantiate
from trainfit.plan.tracker import LiveTracker, fake_copy, patch_moe

TRACE_TOKENS = (64, 128, 256)
# Mamba's sequential scan costs a few traced ops per token and per layer, and its memory is linear
# in T (no [T, T] term), so three shorter sequences fit it as exactly and trace four times faster.
SSM_TRACE_TOKENS = (16, 32, 64)
SSM_TYPES = ("mamba", "falcon_mamba")
TRACE_LAYERS = 3
REPRESENTATIVE = "layer1"  # a middle layer: the first one also builds what all layers share (mask)
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
MODES = ("train", "ckpt", "nograd")
# Fitted quantities, bytes per sequence of T tokens (batch 1):
#   <mode>_layer      live at the end of forward, created inside one decoder layer
#   <mode>_other      live at the end of forward, created outside the layers (embeddings, mask, rotary,
#                     final norm), and the last layer's difference from the first
#   <mode>_transient  peak during backward above the end-of-forward state (a layer's backward; the
#                     recompute of a layer under checkpointing); parameter gradients excluded
#   <mode>_saved, <mode>_saved_layer   saved-for-backward bytes (all, one layer), for the CPU tests
#   nograd_peak       peak live bytes of a no-grad forward of the body (prefill, reference forward)


@dataclass(frozen=True)
class TraceSpec:
    dtype: str = "bf16"
    attn: str = "sdpa"
    peft: str = "none"
    r: int = 16
    alpha: float = 32.0
    targets: "str | tuple" = "all-linear"
    padded: bool = True
    quantization: str = "none"    # none | 4bit | 8bit (bitsandbytes base, see kbit_body)
    double_quant: bool = True
    device: str = "cuda"          # cuda | cpu: whose SDPA kernel choice to trace (see math_sdpa)
    adapter_compute: str = "model"  # peft.adapter_compute (lora_compute.lora_in_model_dtype: where it applies)

    def lora_in_model_dtype(self) -> bool:
        return lora_in_model_dtype(self.peft, self.adapter_compute, self.dtype, self.quantization)

    def key(self) -> dict:
        k = {"dtype": self.dtype, "attn": self.attn if self.attn in ("sdpa", "eager") else "sdpa",
             "peft": self.peft, "r": self.r if self.peft != "none" else 0,
             "targets": (list(self.targets) if not isinstance(self.targets, str) else self.targets)
             if self.peft != "none" else "", "padded": self.padded}
        if self.quantization != "none":  # absent otherwise, so unquantized cache entries keep their keys
            k["quant"] = [self.quantization, self.double_quant]
        if self.peft == "lora" and self.dtype == "bf16" and self.quantization == "none":
            k["lora_compute"] = "bf16" if self.lora_in_model_dtype() else "fp32"  # the layer inputs kept differ
        return k


def math_sdpa(config: dict, spec: TraceSpec) -> bool:
    """Whether SDPA runs its math kernel on the trained device, which keeps the [B, heads, T, T]
    scores (and their gradient) instead of a log-sum-exp per row.

    On CUDA, transformers calls SDPA with `enable_gqa=True` when a batch needs no mask (packed
    pretraining, or a micro-batch without padding: an all-ones mask is dropped for `is_causal`).
    Flash-attention takes only fp16/bf16, and the memory-efficient kernel takes no grouped KV heads,
    so attention in fp32 (an fp32 model, or a k-bit base whose non-quantized parameters are upcast
    to fp32, models.kbit.kbit_upcast, which makes the whole residual stream fp32) of a model with fewer
    KV heads than query heads runs the math kernel. Padded batches would take the memory-efficient
    kernel, but a micro-batch of equal-length rows has no padding, so the math kernel is planned
    (an upper bound). On CPU the fused kernel takes every dtype."""
    if spec.device == "cpu" or spec.attn != "sdpa":
        return False
    text = config.get("text_config") or config
    heads, kv = text.get("num_attention_heads"), text.get("num_key_value_heads")
    fp32 = spec.dtype == "fp32" or spec.quantization != "none"
    return bool(fp32 and heads and kv and kv < heads)


@dataclass
class Trace:
    """Fitted activation figures of one architecture and spec; `at(name, tokens)` is per sequence."""

    coef: dict[str, list[float]]
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def at(self, name: str, tokens: int, batch: int = 1) -> float:
        """Bytes for `batch` sequences of `tokens`: the constant term (weight-sized temporaries such as
        DoRA's B @ A) does not grow with the batch; the token terms do."""
        c0, c1, c2 = self.coef[name]
        return max(0.0, c0 + batch * (c1 * tokens + c2 * tokens * tokens))

    def per_token(self, name: str) -> float:
        return self.coef[name][1]

    def to_dict(self) -> dict:
        return {"coef": self.coef, "notes": self.notes, "seconds": self.seconds}


def fit_quadratic(xs, ys) -> list[float]:
    """Exact quadratic through three points (Lagrange form), as [c0, c1, c2]."""
    c = [0.0, 0.0, 0.0]
    for i, (xi, yi) in enumerate(zip(xs, ys)):
        xa, xb = [x for j, x in enumerate(xs) if j != i]
        d = (xi - xa) * (xi - xb)
        c[0] += yi * xa * xb / d
        c[1] -= yi * (xa + xb) / d
        c[2] += yi / d
    return c


def trace_config(hf_cfg, layers: int = TRACE_LAYERS):
    """A copy of the config with `layers` decoder layers (layer types and MoE placement kept)."""
    cfg = copy.deepcopy(hf_cfg)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    text.num_hidden_layers = layers
    # Mamba's layer_types is a read-only property derived from the layer count.
    if getattr(text, "layer_types", None) and not isinstance(getattr(type(text), "layer_types", None), property):
        types = list(text.layer_types)
        text.layer_types = [types[i % len(types)] for i in range(layers)]  # keeps e.g. Gemma-2's alternation
    if hasattr(text, "mlp_only_layers"):
        text.mlp_only_layers = [i for i in text.mlp_only_layers if i < layers]
    return cfg


NF4_BLOCK = 64  # weights per absmax block of a 4-bit weight (states.NF4_BLOCK)


@functools.lru_cache(maxsize=None)
def _kbit_matmul():
    """bitsandbytes' matmul by a quantized frozen weight [out, in], as its training batches take it
    (bitsandbytes 0.50 `MatMul4Bit` with more than 1536 rows, where CUDA falls back to dequantize +
    F.linear): forward and backward each dequantize the weight to the compute dtype, next to the fp32
    absmax of its 64-weight blocks (with double quantization, the 8-bit absmax dequantized, then plus
    the offset: two fp32 buffers), and drop it after the matmul. Nothing of activation size is saved
    for backward (`ctx.tensors = (None, B)`). LLM.int8 (`MatMul8bitLt`) is traced the same way in
    fp16, and it also keeps its input for backward."""
    import torch

    def dequantized(weight, dtype, double_quant):
        blocks = -(-weight.numel() // NF4_BLOCK)
        absmax = [torch.empty(blocks, dtype=torch.float32)]
        if double_quant:
            absmax.append(absmax[0] + 0.0)
        return torch.empty(weight.shape, dtype=dtype), absmax     # [out, in], fp32 [blocks] (x2)

    class KbitMatmul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, double_quant, keep_input):
            ctx.weight, ctx.double_quant = weight, double_quant
            if keep_input:
                ctx.save_for_backward(x)
            w, absmax = dequantized(weight, x.dtype, double_quant)
            return torch.nn.functional.linear(x, w)

        @staticmethod
        def backward(ctx, grad):
            w, absmax = dequantized(ctx.weight, grad.dtype, ctx.double_quant)
            return torch.matmul(grad, w), None, None, None

    return KbitMatmul


def _kbit_forward(self, x):
    """Linear4bit / Linear8bitLt.forward: the input cast to the compute dtype, the output back to the
    input's dtype (fp32 after the upcast below), cloned when a peft LoRA layer wraps it."""
    y = _kbit_matmul().apply(x.to(self._kbit_dtype), self.weight, self._kbit_double_quant, self._kbit_keep_input)
    y = y.to(x.dtype)
    return y.clone() if self._kbit_clone else y


def kbit_body(model, spec: TraceSpec) -> list[str]:
    """Make the bf16 meta model compute as the trainer's bitsandbytes base does: every nn.Linear but
    the output head (what transformers' bnb quantizer converts, and what states.py counts as
    quantized) multiplies through `_kbit_forward`, and every other parameter is cast to fp32 by the
    trainer's own `trainfit.models.kbit.kbit_upcast` (the embedding output, hence the residual stream, the
    norms and the LM head are fp32). Returns the names cast to fp32."""
    import torch

    from trainfit.models.kbit import kbit_upcast  # torch: only when tracing (a cold cache)

    compute = torch.float16 if spec.quantization == "8bit" else getattr(
        torch, DTYPES[spec.dtype if spec.dtype != "fp32" else "bf16"])   # models._quantization_config
    out_emb = model.get_output_embeddings()
    quantized = set()
    for m in model.modules():
        if isinstance(m, torch.nn.Linear) and m is not out_emb:
            m._kbit_dtype, m._kbit_double_quant = compute, spec.quantization == "4bit" and spec.double_quant
            m._kbit_keep_input, m._kbit_clone = spec.quantization == "8bit", False
            m.forward = types.MethodType(_kbit_forward, m)
            quantized.add(id(m.weight))
    return kbit_upcast(model, quantized=lambda p: id(p) in quantized)


def build_body(src: ModelSource, spec: TraceSpec, fake_mode, layers: int = TRACE_LAYERS):
    """(decoder, text config): the reduced model's body with adapters as the trainer attaches them,
    built on the meta device (peft can move adapters there), then made of fake CPU tensors."""
    import torch

    cfg = trace_config(hf_config(src), layers)
    dtype = getattr(torch, DTYPES[spec.dtype])
    with torch.device("meta"):
        # Attention-free models (Mamba) refuse every attention implementation but their default.
        attn = spec.key()["attn"] if hasattr(cfg.get_text_config(), "num_attention_heads") else None
        model = instantiate(cfg, dtype, attn_implementation=attn)
    model.train()
    if spec.quantization != "none":
        kbit_body(model, spec)
    if spec.peft != "none":
        from peft import LoraConfig, get_peft_model

        from trainfit.models.lora_compute import lora_compute_in_input_dtype
        from trainfit.models.policy import lora_targets

        targets = spec.targets if isinstance(spec.targets, str) else list(spec.targets)
        lcfg = LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=0.0, use_dora=spec.peft == "dora",
                          target_modules=lora_targets(model, targets), task_type="CAUSAL_LM")
        model = get_peft_model(model, lcfg).base_model.model  # layers patched in place
        if spec.lora_in_model_dtype():
            lora_compute_in_input_dtype(model)  # as models.attach_adapters does
        for m in model.modules():
            base = getattr(m, "base_layer", None)
            if getattr(base, "_kbit_dtype", None) is not None:
                base._kbit_clone = True  # peft's bnb LoRA layers clone the base output ("defensively")
    fake_copy([model], fake_mode)
    patch_moe(model)
    return model, cfg.get_text_config()


def enable_checkpointing(model) -> None:
    # As trainfit.models does: non-reentrant checkpointing of every decoder layer, inputs needing grad.
    fn = getattr(model, "activation_checkpointing_enable", None)
    if fn is not None:
        fn(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()


def run_body(model, text_cfg, tokens: int, mode: str, padded: bool, batch: int = 1, layers: int = TRACE_LAYERS,
             math: bool = False) -> dict:
    """One traced forward(+backward) of the body; figures in bytes. `math`: SDPA's math kernel (see
    `math_sdpa`), else the fused kernel fake CPU tensors take."""
    import contextlib

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from trainfit.models.modules import layer_list  # torch: only when tracing (a cold cache)

    params = list(model.parameters())
    for p in params:
        p.grad = None
    exclude = {id(p.untyped_storage()) for p in params} | {id(b.untyped_storage()) for b in model.buffers()}
    ids = torch.randint(0, text_cfg.vocab_size, (batch, tokens))
    mask = torch.ones(batch, tokens, dtype=torch.long) if padded else None
    tracker = LiveTracker(exclude)
    handles = []
    for i, layer in enumerate(layer_list(model, layers)):
        handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: setattr(tracker, "owner", f"layer{i}")))
        handles.append(layer.register_forward_hook(lambda m, a, o: setattr(tracker, "owner", "model")))
    body = model.base_model  # the decoder: embeddings, layers, final norm
    grad_ctx = torch.no_grad() if mode == "nograd" else contextlib.nullcontext()
    kernel = sdpa_kernel([SDPBackend.MATH]) if math else contextlib.nullcontext()
    # The cyclic collector would free some objects at arbitrary points and make figures vary from run
    # to run; paused, a storage dies exactly when its last reference goes, as CUDA memory is freed.
    gc.disable()
    try:
        with tracker.mode, grad_ctx, kernel, torch.autograd.graph.saved_tensors_hooks(tracker.pack, lambda t: t):
            hidden = body(input_ids=ids, attention_mask=mask).last_hidden_state       # [B, T, hidden]
            tracker.mark("forward")
            if mode != "nograd":
                tracker.owner = "backward"
                hidden.backward(torch.zeros_like(hidden))  # the LM head's gradient arrives here
    finally:
        gc.enable()
        for h in handles:
            h.remove()
    grads = {tracker.serial_of(p.grad) for p in params if p.grad is not None}
    end_fwd = tracker.live_at(tracker.marks["forward"], skip=grads)
    end = sum(end_fwd.values())
    layer = end_fwd.get(REPRESENTATIVE, 0)
    return {"layer": layer, "other": end - layers * layer, "end": end, "peak": tracker.peak(skip=grads),
            "saved": tracker.saved_bytes(),
            "saved_layer": tracker.saved_bytes(REPRESENTATIVE)}


def trace_points(src: ModelSource, spec: TraceSpec, tokens=TRACE_TOKENS, modes=MODES) -> dict[str, list[dict]]:
    """Raw traced figures per mode and token count (one model build; checkpointing switched on last)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    model, text = build_body(src, spec, fake_mode)
    out: dict[str, list[dict]] = {}
    gc.collect()
    with fake_mode:
        for mode in sorted(modes, key=lambda m: m == "ckpt"):
            if mode == "ckpt":
                enable_checkpointing(model)
            out[mode] = [run_body(model, text, t, mode, spec.padded, math=math_sdpa(src.config, spec))
                         for t in tokens]
    return out


_MEMO: dict[str, dict] = {}


def _fit_mode(mode: str, rows: list[dict], tokens=TRACE_TOKENS) -> dict[str, list[float]]:
    if mode == "nograd":
        return {"nograd_peak": fit_quadratic(tokens, [r["peak"] for r in rows])}
    coef = {f"{mode}_{q}": fit_quadratic(tokens, [r[q] for r in rows])
            for q in ("layer", "other", "saved", "saved_layer")}
    coef[f"{mode}_transient"] = fit_quadratic(tokens, [r["peak"] - r["end"] for r in rows])
    return coef


def trace(src: ModelSource, spec: TraceSpec, modes=MODES) -> Trace:
    """Fitted body figures for an architecture and spec, for the given modes (train, ckpt, nograd):
    each from the in-process memo, the disk cache, or a fresh trace (about a second a mode)."""
    tokens = SSM_TRACE_TOKENS if src.config.get("model_type") in SSM_TYPES else TRACE_TOKENS
    base = {"arch": src.key(), "spec": spec.key(), "tokens": tokens, "layers": TRACE_LAYERS}
    math = math_sdpa(src.config, spec)
    if math:  # absent otherwise, so the cache entries of fused-kernel traces keep their keys
        base["sdpa"] = "math"
    keys = {m: cache.stable_hash({**base, "mode": m}) for m in modes}
    found: dict[str, dict] = {}
    for m, k in keys.items():
        entry = _MEMO.get(k) or cache.read("traces", k)
        if entry is not None:
            found[m] = _MEMO[k] = entry
    missing = [m for m in modes if m not in found]
    if missing:
        t0 = time.perf_counter()
        points = trace_points(src, spec, tokens=tokens, modes=missing)
        seconds = round((time.perf_counter() - t0) / len(missing), 3)
        for m in missing:
            found[m] = _MEMO[keys[m]] = {"coef": _fit_mode(m, points[m], tokens), "seconds": seconds}
            cache.write("traces", keys[m], found[m])
    coef = {k: v for m in modes for k, v in found[m]["coef"].items()}
    notes = []
    if math:
        notes.append("fp32 attention with grouped KV heads: on CUDA SDPA runs its math kernel for unpadded "
                     "batches, which keeps [batch, heads, T, T] fp32 scores (planned).")
    if spec.attn not in ("sdpa", "eager"):
        notes.append(f"{spec.attn} traced as SDPA's fused kernel (same saved tensors: q, k, v, out, log-sum-exp).")
    if src.config.get("model_type") in SSM_TYPES:
        notes.append("Mamba mixer traced on transformers' sequential path; the mamba-ssm CUDA kernel saves less.")
    if src.config.get("num_experts") or src.config.get("num_local_experts"):
        notes.append("MoE experts traced with balanced routing.")
    return Trace(coef, notes, sum(found[m].get("seconds", 0.0) for m in modes))
