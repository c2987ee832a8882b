"""In-process generation from the trainer's module: batched, left-padded, KV-cached (rollout/decode.py's
loop, or Hugging Face `generate` for models it does not cover).

The engine returns token ids (what the trainer scores), text (what rewards read) and, when asked, its
log-probs. A completion ends at the first eos (kept, so the model learns to stop) or when a stop string
appears. It samples from the module the trainer updates, so `sync` has nothing to do.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Optional, Sequence

import torch
from transformers import (LogitsProcessorList, StopStringCriteria, TemperatureLogitsWarper,
                          TopKLogitsWarper, TopPLogitsWarper)

from trainfit.config import RolloutConfig
from trainfit.rollout.base import Completion
from trainfit.rollout.images import vlm_generate
from trainfit.rollout.sampling import LogprobRecorder, SeededGumbel
from trainfit.rollout.decode import (StaticDecoder, decode, left_padded, seeded_pick, supports_decode_loop,
                                     supports_static_cache)

__all__ = ["Completion", "HFEngine", "SeededGumbel"]


def _mergeable_lora_layers(model) -> list:
    """The model's LoRA layers when every one of them can be merged exactly as below, else [].

    Plain peft `lora.Linear` over an `nn.Linear` only (no DoRA or other variant, no LoRA bias, no
    quantized, sharded (FSDP DTensor / ZeRO-3) or disabled layer); one layer that is not leaves
    the whole model unmerged, since a partly merged model is not the one being trained.
    """
    lora = sys.modules.get("peft.tuners.lora.layer")  # a LoRA model has imported it; don't import peft
    if lora is None:
        return []
    LoraLinear, LoraLayer = lora.Linear, lora.LoraLayer
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    for m in layers:
        if type(m) is not LoraLinear or m.merged or m.disable_adapters:
            return []
        active = [a for a in m.active_adapters if a in m.lora_A]
        if any(a in getattr(m, "lora_variant", {}) or getattr(m, "use_dora", {}).get(a)
               or getattr(m, "lora_bias", {}).get(a) for a in active):
            return []
        base = m.get_base_layer()
        w = getattr(base, "weight", None)
        if type(base) is not torch.nn.Linear or type(w) is not torch.nn.Parameter or hasattr(w, "ds_id"):
            return []
    return layers


def _add_delta(w: torch.Tensor, m, adapter: str) -> torch.Tensor:
    """A new tensor W + scaling * B @ A (transposed for fan_in_fan_out layers): one fused addmm in
    the promoted dtype (peft's `get_delta_weight` math without its temporaries)."""
    a, b = m.lora_A[adapter].weight, m.lora_B[adapter].weight           # [r, in], [out, r]
    dt = torch.promote_types(w.dtype, a.dtype)
    if dt != torch.float32 and dt != torch.float64:  # bf16 / fp16 (slow on CPU): accumulate in fp32
        dt = torch.float32
    lhs, rhs = (a.T, b.T) if m.fan_in_fan_out else (b, a)
    return torch.addmm(w.to(dt), lhs.to(dt), rhs.to(dt), alpha=m.scaling[adapter])


@contextlib.contextmanager
def merged_lora(model):
    """Decode with LoRA merged into temporary weights; the base weights come back bit for bit.

    For each LoRA linear, W + scaling * B @ A (summed over the active adapters, computed in fp32 or
    fp64 and rounded once to W's dtype) goes into a NEW tensor that stands in for W while the layer's
    forward is the plain linear; on exit the original W (the same Parameter object, never written to)
    is put back and the LoRA forward restored. Nothing is merged or unmerged in place, so the base
    weights do not drift through rounding. The merged forward equals the unmerged one up to float
    rounding (W x + s B A x vs (W + s B A) x). Costs one extra copy of the adapted weights for the
    duration. Yields whether it merged (False: nothing to merge, or a layer that cannot be merged
    this way; the model is then used as it is).
    """
    layers = _mergeable_lora_layers(model)
    saved: list = []
    try:
        with torch.no_grad():
            for m in layers:
                base = m.get_base_layer()
                w = base.weight
                merged = w
                for a in m.active_adapters:
                    if a in m.lora_A:
                        merged = _add_delta(merged, m, a)
                saved.append((m, base, w))
                base.weight = torch.nn.Parameter(merged.to(w.dtype), requires_grad=False)
                m.forward = base.forward                 # instance attribute: shadows the LoRA forward
        yield bool(layers)
    finally:
        for m, base, w in reversed(saved):
            base.weight = w
            m.__dict__.pop("forward", None)


class HFEngine:
    """Generation from the policy module the trainer holds (no second copy of the weights)."""

    name = "hf"
    shares_weights = True

    def __init__(self, model, tokenizer, cfg: RolloutConfig, stop: Sequence[str] = ()):
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        self.stop = list(dict.fromkeys([*cfg.stop, *stop]))  # config stops first, task stops after
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id
        self.synced = False  # FSDP: keep decoding until every rank is done (forwards are collectives)
        self.use_decode_loop: Optional[bool] = None   # decided on first use from rollout.decoder
        self._stopper = None
        self._static: Optional[StaticDecoder] = None  # rollout.hf_cache=static: the cache (kept when compiled)
        self._merged_now = False
        self.processor = None   # a vision.images.VisionProcessor for a VLM's image prompts (set by the stage)

    # The trainer's module is the engine's: nothing to push, nothing to free between phases.
    def sync(self, model) -> None:
        pass

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass

    def close(self) -> None:
        self._static = None

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], *, greedy: bool = False, seeds: Optional[Sequence[int]] = None,
                 max_new_tokens: Optional[int] = None, batch_size: Optional[int] = None,
                 logprobs: bool = False, temperature: Optional[float] = None,
                 images: Optional[Sequence[list]] = None) -> list[Completion]:
        """Complete each prompt (token ids) once.

        With `seeds` (one per prompt) sampling is per-row seeded (see SeededGumbel); without, it
        follows the global torch RNG as transformers does. `temperature` overrides the config's.
        `images`: per prompt, the PIL images its image tokens stand for (vision-language models;
        with `self.processor` set, generation goes through trainfit/rollout/images.py).
        """
        if images is not None and any(images) and self.processor is None:
            raise ValueError("HFEngine.generate was given images but has no processor (set engine.processor).")
        bs = batch_size or self.cfg.batch_size or len(prompts)
        temp = self.cfg.temperature if temperature is None else temperature
        if self.processor is not None:  # a vision-language policy: images or not (rollout/images.py)

            return vlm_generate(self, prompts, images or [[] for _ in prompts], greedy=greedy or temp == 0, seeds=seeds,
                                max_new=max_new_tokens or self.cfg.max_new_tokens, batch_size=bs,
                                logprobs=logprobs, temperature=temp)
        was_training = self.model.training
        self.model.eval()
        try:
            out: list[Completion] = []
            max_new = max_new_tokens or self.cfg.max_new_tokens
            with self._merged(decode_steps=-(-len(prompts) // bs) * max_new) as merged:
                self._merged_now = bool(merged)
                for i in range(0, len(prompts), bs):
                    out.extend(self._generate_batch(prompts[i:i + bs], greedy or temp == 0,
                                                    max_new,
                                                    None if seeds is None else seeds[i:i + bs], logprobs, temp))
            return out
        finally:
            self.model.train(was_training)

    # Merging costs about as much as 10-20 unmerged decoding steps (SmolLM2-135M, LoRA on every
    # linear, CPU: ~0.2 s against ~1.5 s saved over 64 steps of 16 rows): not worth it for short calls.
    MERGE_MIN_DECODE_STEPS = 32

    def _merged(self, decode_steps: int = MERGE_MIN_DECODE_STEPS):
        """`merged_lora` for a generate call of `decode_steps` decoding steps, when allowed:
        `rollout.merge_lora` "always"; or "auto" with the weights in CPU memory and a call long
        enough to repay the merge. On CPU the extra copy of the adapted weights is small next to the
        training step's peak, and decoding is bound by the per-layer work that merging removes. Never
        for sharded (FSDP) decoding."""
        mode = self.cfg.merge_lora
        if self.synced or mode == "never":
            return contextlib.nullcontext(False)
        if mode == "auto":
            p = next(self.model.parameters(), None)
            if p is None or p.device.type != "cpu" or decode_steps < self.MERGE_MIN_DECODE_STEPS:
                return contextlib.nullcontext(False)
        return merged_lora(self.model)

    def _warpers(self, temperature: float) -> list:
        """Temperature / top-k / top-p, as transformers' LogitsProcessors (they keep its exact math)."""
        c = self.cfg
        procs: list = [TemperatureLogitsWarper(temperature)] if temperature != 1.0 else []
        if c.top_k:
            procs.append(TopKLogitsWarper(c.top_k))
        if c.top_p < 1.0:
            procs.append(TopPLogitsWarper(c.top_p))
        return procs

    def _use_decode_loop(self) -> bool:
        """trainfit's decoding loop (rollout/decode.py) or `generate`, as `rollout.decoder` says."""
        if self.use_decode_loop is None:
            mode = self.cfg.decoder
            self.use_decode_loop = supports_decode_loop(self.model) if mode == "auto" else mode == "trainfit"
        return self.use_decode_loop

    def _static_decoder(self) -> Optional[StaticDecoder]:
        """The static-cache decoder when `rollout.hf_cache` asks for it and the model allows it
        (full attention, sdpa / eager; never for FSDP's synced decoding), else None (DynamicCache).
        Compiled (CUDA graphs) on CUDA with `rollout.hf_cuda_graphs`, unless LoRA is merged into
        temporary weights for this call (new weight tensors would re-capture the graph)."""
        mode, dev = self.cfg.hf_cache, next(self.model.parameters()).device
        if self.synced or mode == "dynamic" or (mode == "auto" and dev.type != "cuda"):
            return None
        if not supports_static_cache(self.model):
            return None
        compiled = bool(self.cfg.hf_cuda_graphs) and dev.type == "cuda" and not self._merged_now
        if self._static is None or self._static.compiled != compiled:
            self._static = StaticDecoder(self.model, compiled=compiled)
        return self._static

    def _generate_batch(self, prompts: list[list[int]], greedy: bool, max_new: int,
                        seeds: Optional[Sequence[int]], want_logprobs: bool, temperature: float) -> list[Completion]:
        if not greedy and seeds is None:  # unseeded: per-row seeds drawn from the global torch RNG
            seeds = torch.randint(0, 2**62, (len(prompts),)).tolist()
        lp_temp = (1.0 if greedy else temperature) if want_logprobs else None
        if self._use_decode_loop():
            if self.stop and self._stopper is None:  # built once: it preprocesses the whole vocabulary
                self._stopper = StopStringCriteria(self.tokenizer, self.stop)
            d = decode(self.model, prompts, pad_id=self.pad_id, eos_id=self.eos_id, max_new=max_new,
                       pick=seeded_pick([] if greedy else self._warpers(temperature), seeds or [], greedy),
                       stopping=self._stop_check if self.stop else None,
                       stop_window=self._stopper.maximum_token_len if self.stop else None,
                       logprob_temperature=lp_temp, synced=self.synced, static=self._static_decoder())
            new_t, lp = d.tokens, d.logprobs
        else:
            new_t, lp = self._hf_generate(prompts, greedy, max_new, seeds, lp_temp, temperature)
        lp_rows = lp.tolist() if lp is not None and new_t.shape[1] else None
        out = []
        for r, row in enumerate(new_t.tolist()):
            c = self._finish(row)
            if lp_rows is not None:
                c.logprobs = lp_rows[r][: len(c.token_ids)]
            elif want_logprobs:
                c.logprobs = []
            out.append(c)
        return out

    def _stop_check(self, seq: torch.Tensor) -> torch.Tensor:
        """bool [b]: rows whose ids `seq` end on a stop string (StopStringCriteria reads the last
        `maximum_token_len` ids only, the window the static decode step keeps)."""
        return self._stopper(seq, None)

    def _hf_generate(self, prompts: list[list[int]], greedy: bool, max_new: int, seeds: Optional[Sequence[int]],
                     lp_temp: Optional[float], temperature: float) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """`model.generate` with the same sampling (models the decoding loop does not cover):
        new tokens [B, n] and their log-probs [B, n] (or None)."""
        ids, mask = left_padded(prompts, self.pad_id, next(self.model.parameters()).device)  # [B, P] each
        recorder = LogprobRecorder(lp_temp) if lp_temp is not None else None
        procs: list = [recorder] if recorder else []
        if not greedy:
            # Sampling = argmax over warped logits + per-row Gumbel noise (exact; see SeededGumbel).
            procs += [*self._warpers(temperature), SeededGumbel(seeds)]
        stop = dict(stop_strings=self.stop, tokenizer=self.tokenizer) if self.stop else {}
        seqs = self.model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
            eos_token_id=self.eos_id, pad_token_id=self.pad_id, use_cache=True, synced_gpus=self.synced,
            do_sample=False, logits_processor=LogitsProcessorList(procs), **stop,
        )
        new_t = seqs[:, ids.shape[1]:].cpu()                                                # [B, <=max_new]
        return new_t, recorder.finish(new_t) if recorder and new_t.shape[1] else None

    def _finish(self, row: list[int]) -> Completion:
        if self.eos_id in row:
            ids = row[: row.index(self.eos_id) + 1]
            return Completion(ids, self.tokenizer.decode(ids, skip_special_tokens=True), True)
        # No eos: generation stopped on a stop string (rest is padding) or at the length limit.
        ids = list(row)
        while ids and ids[-1] == self.pad_id and self.pad_id != self.eos_id:
            ids.pop()
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        stopped = any(s in text for s in self.stop)
        if stopped:
            ids, text = self._cut_at_stop(ids, text)
        return Completion(ids, text, stopped)

    def _cut_at_stop(self, ids: list[int], text: str) -> tuple[list[int], str]:
        """Keep tokens through the one that completes the first stop string."""
        for n in range(1, len(ids) + 1):
            t = self.tokenizer.decode(ids[:n], skip_special_tokens=True)
            if any(s in t for s in self.stop):
                return ids[:n], t
        return ids, text
