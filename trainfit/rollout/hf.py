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
from transformers import (LogitsProcessor, LogitsProcessorList, StopStringCriteria, TemperatureLogitsWarper,
                          TopKLogitsWarper, TopPLogitsWarper)

from trainfit.config import RolloutConfig
from trainfit.rollout.base import Completion
from trainfit.rollout.decode import (StaticDecoder, decode, left_padded, seeded_pick, supports_decode_loop,
                                     supports_static_cache)

__all__ = ["Completion", "HFEngine", "SeededGumbel"]


_M32, _M64 = 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF


def _splitmix64(z: int) -> int:
    """SplitMix64's output function on a Python int (64-bit): decorrelates nearby seeds and steps."""
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A bijective hash of 32-bit values held in int64 (xorshift-multiply; constants from Wellons'
    hash-prospector). Both multipliers are below 2^31 and x below 2^32, so no product overflows."""
    x = x ^ (x >> 15)
    x.mul_(0x2C1B3C6D).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 12)
    x.mul_(0x297A2D39).bitwise_and_(_M32)
    return x.bitwise_xor_(x >> 15)


def row_step_keys(seeds: Sequence[int], step: int, _mixed: Optional[Sequence[int]] = None) -> list[int]:
    """One 32-bit key per row for decoding step `step`: a function of (the row's seed, step) only.
    `_mixed` = [_splitmix64(seed)] precomputed (SeededGumbel keeps them for the whole generation)."""
    mixed = _mixed if _mixed is not None else [_splitmix64(int(s) & _M64) for s in seeds]
    return [_splitmix64((m + step) & _M64) & _M32 for m in mixed]


_VOCAB_HASH: dict = {}


def gumbel_noise(keys: Sequence[int], vocab: int, device) -> torch.Tensor:
    """Standard Gumbel noise `[B, vocab]` float32, entry (i, v) a hash of (keys[i], v): counter-based,
    so a row's noise does not depend on the other rows or on how many there are.

    u = (top 23 bits of hash32(hash32(v) xor key) + 0.5) / 2^23 lies in [2^-24, 1 - 2^-24] exactly
    (never 0 or 1), and -log(-log u) is Gumbel(0, 1) up to that resolution (its tails are cut at
    about -2.8 and 16.6, each with probability below 1e-7).
    """
    hv = _VOCAB_HASH.get((vocab, device))
    if hv is None:
        hv = _VOCAB_HASH.setdefault((vocab, device), _hash32(torch.arange(vocab, dtype=torch.int64, device=device)))
    k = torch.tensor(list(keys), dtype=torch.int64, device=device)[:, None]             # [B, 1]
    x = _hash32(hv ^ k)                                                                   # [B, V]
    u = (x >> 9).to(torch.float32).add_(0.5).mul_(2.0 ** -23)
    return u.log_().neg_().log_().neg_()


class SeededGumbel(LogitsProcessor):
    """Exact sampling as argmax(logits + Gumbel noise), the noise of row i drawn from its own seed.

    The noise of row i at decoding step t is `gumbel_noise(key(seed_i, t))`: each completion's sample
    depends only on its seed and its own logits, not on which other rows share the batch, so the same
    rollout comes out on 1 or N ranks and with any generation batch size. Applied after temperature /
    top-k / top-p, so argmax samples from exactly the warped distribution. One vectorised float32
    pass per step (no per-row generator, no float64).
    """

    def __init__(self, seeds: Sequence[int]):
        self.seeds = [int(s) for s in seeds]
        self.mixed = [_splitmix64(s & _M64) for s in self.seeds]
        self.step = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:  # [B, V]
        keys = row_step_keys(self.seeds, self.step, self.mixed)
        self.step += 1
        noise = gumbel_noise(keys, scores.shape[-1], scores.device)                       # [B, V]
        return noise.add_(scores.float())


class LogprobRecorder(LogitsProcessor):
    """Records log softmax(raw logits / T) of each sampled token, one decoding step late.

    Placed first, it sees the model's raw logits. The token chosen at step t is only known at step
    t+1 (last column of `input_ids`), so one step's [B, V] log-probs are kept until then and the last
    step is settled by `finish` from the returned sequences: O(B x V) memory, not O(B x steps x V).
    """

    def __init__(self, temperature: float):
        self.t = temperature if temperature > 0 else 1.0
        self.prev: Optional[torch.Tensor] = None     # [B, V] log-probs of the previous step
        self.steps: list[torch.Tensor] = []          # per step: [B] log-prob of the chosen token

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.prev is not None:
            self.steps.append(self.prev.gather(1, input_ids[:, -1:]).squeeze(1))
        self.prev = torch.log_softmax(scores.float() / self.t, dim=-1)
        return scores

    def finish(self, new_tokens: torch.Tensor) -> torch.Tensor:        # new_tokens [B, n] -> [B, n]
        if self.prev is not None and len(self.steps) < new_tokens.shape[1]:
            self.steps.append(self.prev.gather(1, new_tokens[:, len(self.steps):len(self.steps) + 1]).squeeze(1))
        self.prev = None
        return torch.stack(self.steps, dim=1).cpu()


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
        with `self.processor` set, generation goes through trainfit/vision/rollout.py).
        """
        if images is not None and any(images) and self.processor is None:
            raise ValueError("HFEngine.generate was given images but has no processor (set engine.processor).")
        bs = batch_size or self.cfg.batch_size or len(prompts)
        temp = self.cfg.temperature if temperature is None else temperature
        if self.processor is not None:  # a vision-language policy: images or not (vision/rollout.py)
            from trainfit.vision.rollout import vlm_generate

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
                       stopping=(lambda seq: self._stopper(seq, None)) if self.stop else None,
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
