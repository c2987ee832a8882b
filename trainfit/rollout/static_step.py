"""The static-cache decode step: one function from the previous tokens to the next ones, on
preallocated buffers, with nothing read back to the host (rollout/decode.py's `decode` with `static`).

One step (`decode_step`) = the forward of each row's last token on a static KV cache + device-side
seeded sampling (per-row Gumbel noise keyed by (seed, step) on the device) + the sampled token's
log-prob + the finished-row bookkeeping (eos, stop strings), all written in place into StepBuffers.
On CUDA StaticDecoder compiles it whole (torch.compile mode="reduce-overhead"): one CUDA graph,
captured once per kept cache and replayed every token. On CPU the same function runs eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from trainfit.models.policy import unwrap
from trainfit.rollout.buckets import STATIC_LENGTH_STEP, batch_bucket
from trainfit.rollout.sampling import SeededPick, gumbel_from_keys, mixed_seeds, row_keys, vocab_hash

# The static loop reads "has every row finished?" back to the host once every this many steps: the
# only device-to-host sync inside it (up to SYNC_EVERY - 1 steps may run after the last row ended).
SYNC_EVERY = 8
# The id `stopping` reads before a sequence's start (static path): past every vocabulary, so
# StopStringCriteria maps it to its no-match entry, as if the ids were shorter.
NO_TOKEN = torch.iinfo(torch.int64).max


@dataclass
class StepBuffers:
    """Everything a static decode step reads and writes, preallocated once for R rows and a cache of
    L tokens (kept with the cache between calls when bucketed: one captured graph serves them all).
    Step t writes column t of `tokens` / `logps`; `t` and `n` live on the device, so the step is the
    same graph every time."""
    feed: torch.Tensor      # [R, 1] long: each row's last token (padding once finished)
    pos: torch.Tensor       # [R, 1] long: its position
    mask: torch.Tensor      # [R, L] long: the fixed attention mask (zeros on the left padding)
    live: torch.Tensor      # [R] bool: rows still generating (spare rows: never)
    tokens: torch.Tensor    # [R, L] long: new tokens, column t = step t
    logps: torch.Tensor     # [R, L] float32: their log-probs (0 where a row had finished)
    window: torch.Tensor    # [R, W] long: each row's last W ids, what `stopping` sees (W = 1 without)
    mixed: torch.Tensor     # [R] int64: per-row seed constants (mixed_seeds)
    hv: torch.Tensor        # [V] int64: the vocabulary's hash (vocab_hash)
    t: torch.Tensor         # 0-d long: the step being sampled
    n: torch.Tensor         # 0-d long: steps at whose start some row was live (the output's width)
    noise_scale: torch.Tensor   # 0-d float32: 1 sampling, 0 greedy (argmax of the scores + 0 * noise)
    lp_temp: torch.Tensor       # 0-d float32: the log-probs' temperature

    @classmethod
    def allocate(cls, rows: int, length: int, window: int, vocab: int, device) -> "StepBuffers":
        z = dict(dtype=torch.long, device=device)
        return cls(feed=torch.zeros(rows, 1, **z), pos=torch.zeros(rows, 1, **z), mask=torch.ones(rows, length, **z),
                   live=torch.zeros(rows, dtype=torch.bool, device=device), tokens=torch.zeros(rows, length, **z),
                   logps=torch.zeros(rows, length, device=device), window=torch.zeros(rows, window, **z),
                   mixed=torch.zeros(rows, **z), hv=vocab_hash(vocab, device), t=torch.zeros((), **z),
                   n=torch.zeros((), **z), noise_scale=torch.ones((), device=device),
                   lp_temp=torch.ones((), device=device))

    def tensors(self) -> list:
        return [self.feed, self.pos, self.mask, self.live, self.tokens, self.logps, self.window, self.mixed,
                self.t, self.n, self.hv, self.noise_scale, self.lp_temp]


def decode_static(static: "StaticDecoder", cache, index, logits, ids, mask, pos, B: int, *, pad_id, eos_id,
                  max_new, pick: SeededPick, stopping, logprob_temperature, stop_window: int):
    """rollout/decode.py `decode`'s steps on the static cache `cache` of R = len(index) >= B rows, prefilled with the
    distinct prompts `index` (R - B spare rows when bucketed: copies of row 0, never live, never read).

    Step 0 samples from the prefill's logits; each later step is `decode_step` (the forward of the
    previous tokens on the static cache, then `sample_step`), on preallocated buffers, with no
    host sync: the host only checks every SYNC_EVERY steps whether any row is still live, and reads
    the tokens and log-probs once at the end: (tokens [B, n], log-probs [B, n] or None) on CPU.
    """
    P, R = ids.shape[1], len(index)
    b = static.buffers(cache, R, stop_window, logits.shape[-1])
    b.mask[:, :P].copy_(mask[index])
    b.mask[:, P:].fill_(1)                # columns a step has not reached are hidden by causality
    b.pos.copy_(pos[index, -1:])
    b.live.fill_(True)
    b.live[B:] = False
    b.mixed.zero_()
    if not pick.greedy:
        b.mixed[:B].copy_(mixed_seeds(pick.seeds[:B], b.mixed.device))
    w = min(stop_window, P)
    b.window.fill_(NO_TOKEN)
    b.window[:, -w:].copy_(ids[index, P - w:])
    b.t.zero_()
    b.n.zero_()
    b.noise_scale.fill_(0.0 if pick.greedy else 1.0)
    b.lp_temp.fill_(1.0 if logprob_temperature is None else logprob_temperature)
    spec = StepSpec(pick.warpers, pad_id, eos_id, stopping)
    sample_step(b, logits[index], spec)                                                   # step 0
    for t in range(1, max_new):
        if t % SYNC_EVERY == 0 and not bool(b.live.any()):                               # the one sync
            break
        static.step(b, cache, spec)
    n = int(b.n)
    # Copies even on CPU (where .cpu() would return views of the buffers the next call overwrites).
    return (b.tokens[:B, :n].to("cpu", copy=True),
            None if logprob_temperature is None else b.logps[:B, :n].to("cpu", copy=True))


@dataclass(frozen=True)
class StepSpec:
    """The constants of a static decode step (what a captured graph is specialised on). Greedy or
    sampled and the log-probs' temperature are buffers instead, so evaluation's greedy calls replay
    the training rollouts' graph (at temperature 1, where sampling has no warper)."""
    warpers: tuple
    pad_id: int
    eos_id: Optional[int]
    stopping: Optional[Callable[[torch.Tensor], torch.Tensor]]


def sample_step(b: StepBuffers, logits: torch.Tensor, spec: StepSpec) -> None:
    """Sample step b.t's token of every row from `logits` [R, V], record it and its log-prob in
    column b.t, and end rows at eos or a stop string: all in place in `b`, nothing read back."""
    scores = logits.float()                                                               # [R, V]
    warped = scores
    for w in spec.warpers:
        warped = w(b.window, warped)
    # Greedy (noise_scale 0) adds exact zeros, so argmax is that of the scores (no warper then).
    noise = gumbel_from_keys(row_keys(b.mixed, b.t), b.hv).mul_(b.noise_scale)            # [R, V]
    nxt = noise.add_(warped).argmax(-1)                                                   # [R]
    live = b.live
    nxt = torch.where(live, nxt, spec.pad_id)
    col = b.t.view(1)
    b.tokens.index_copy_(1, col, nxt[:, None])
    # Always computed (one log-softmax a step), so calls with and without log-probs share a graph.
    lp = torch.log_softmax(scores / b.lp_temp, dim=-1).gather(1, nxt[:, None])            # [R, 1]
    b.logps.index_copy_(1, col, torch.where(live[:, None], lp, 0.0))
    ended = nxt == spec.eos_id if spec.eos_id is not None else torch.zeros_like(live)
    if spec.stopping is not None:   # (the warpers, temperature / top-k / top-p, do not read the ids)
        b.window.copy_(torch.cat([b.window[:, 1:], nxt[:, None]], dim=1))                # fixed shape
        ended = ended | spec.stopping(b.window)
    b.n.add_(live.any().long())
    live.logical_and_(~ended)
    b.feed.copy_(nxt[:, None])
    b.t.add_(1)


def decode_step(model, cache, b: StepBuffers, spec: StepSpec) -> None:
    """One static decode step: the forward of each row's last token on the static cache, then
    `sample_step` on its logits. On CUDA this whole function is captured as one graph."""
    b.pos.add_(1)
    logits = model(input_ids=b.feed, attention_mask=b.mask, position_ids=b.pos, past_key_values=cache,
                   use_cache=True).logits[:, -1]                                          # [R, V]
    sample_step(b, logits, spec)


def supports_static_cache(model) -> bool:
    """Whether `decode`'s static-cache path applies: full-attention layers only (a sliding-window
    layer of transformers' StaticCache keeps a rolling window the prefill copy below does not fill)."""
    text = unwrap(model, peft=True).config.get_text_config(decoder=True)
    # flash-attention reads the padding mask as the keys' extent: the cache's unwritten columns would count.
    if getattr(text, "_attn_implementation", None) not in ("sdpa", "eager"):
        return False
    types = getattr(text, "layer_types", None)
    if types is not None:
        return all(t == "full_attention" for t in types)
    return not getattr(text, "sliding_window", None) or not getattr(text, "use_sliding_window", True)


class StaticDecoder:
    """A static KV cache and the one-token decode step that writes into it.

    transformers' StaticCache preallocates keys and values [rows, kv_heads, length, head_dim] per
    layer and writes each step's token in place at one shared position (rows are left-padded, so
    every row's t-th new token sits at column P + t). The attention mask [rows, length] is fixed for
    the whole call (zeros on the left padding, ones elsewhere; columns past the current step are
    hidden by causality), so every decode step has the same shapes and tensor addresses.

    With `compiled` (CUDA only) the whole step (`decode_step`: forward, sampling, log-prob,
    bookkeeping) is `torch.compile(mode="reduce-overhead")` (or, `backend="cudagraphs"`, captured
    without code generation): one CUDA graph per batch bucket
    (batch_bucket), replayed each token. The caches and their step buffers are then kept between
    calls (one per bucket, sized STATIC_LENGTH_STEP tokens at a time, grown when a longer call comes;
    a smaller batch runs in a larger kept bucket): a new address would make the graph re-record, so
    a run captures once per bucket and length it reaches. Without it each call allocates its cache at
    exactly its rows x (prompt + new tokens).
    """

    def __init__(self, model, compiled: bool = False, bucketed: Optional[bool] = None, backend: str = "inductor"):
        self.model, self.compiled, self.backend = model, compiled, backend
        self.bucketed = compiled if bucketed is None else bucketed   # rows in buckets, caches kept
        self.pool: dict = {}      # bucketed: batch bucket -> StaticCache kept between calls
        self.kept: dict = {}      # bucketed: batch bucket -> (its cache, StepBuffers) kept with it
        self._step = None

    def rows_for(self, b: int) -> int:
        """Cache rows for a batch of `b`: b, or bucketed the smallest kept cache that holds it (a
        smaller last chunk of a rollout reuses the first chunk's cache and graph), else its bucket."""
        if not self.bucketed:
            return b
        want = batch_bucket(b)
        return min((r for r in self.pool if r >= want), default=want)

    def cache(self, prefilled, index: torch.Tensor, length: int):
        """A StaticCache of len(index) rows and >= `length` tokens holding rows `index` of the
        prefilled DynamicCache `prefilled` (P tokens each) in its first P columns; position P next."""
        from transformers import StaticCache

        src = prefilled.layers
        k0 = src[0].keys                                                  # [U, kv_heads, P, head_dim]
        rows, P = len(index), k0.shape[2]
        cache = self.pool.get(rows) if self.bucketed else None
        if cache is None or cache.layers[0].max_cache_len < length:
            if self.bucketed:
                length = -(-length // STATIC_LENGTH_STEP) * STATIC_LENGTH_STEP
            cache = StaticCache(config=self.model.config.get_text_config(decoder=True), max_cache_len=length)
            cache.early_initialization(rows, [layer.keys.shape[1] for layer in src],
                                       [layer.keys.shape[-1] for layer in src], k0.dtype, k0.device)
            if self.bucketed:
                self.pool[rows] = cache
        for s, d in zip(src, cache.layers):
            d.keys[:, :, :P].copy_(s.keys.index_select(0, index))
            d.values[:, :, :P].copy_(s.values.index_select(0, index))
            d.cumulative_length.fill_(P)
        return cache

    def buffers(self, cache, rows: int, window: int, vocab: int) -> StepBuffers:
        """The step buffers for `cache` (the same tensors for every call on a kept cache, so a captured
        graph replays on them); allocated anew with a new cache, window width or vocabulary."""
        L, device = cache.layers[0].max_cache_len, cache.layers[0].keys.device
        kept = self.kept.get(rows) if self.bucketed else None
        if kept is not None and kept[0] is cache and kept[1].window.shape[1] == window and len(kept[1].hv) == vocab:
            return kept[1]
        b = StepBuffers.allocate(rows, L, window, vocab, device)
        if self.compiled:   # fixed addresses: the graph writes them in place instead of copying them in
            for x in b.tensors():
                torch._dynamo.mark_static_address(x)
        if self.bucketed:
            self.kept[rows] = (cache, b)
        return b

    def step(self, b: StepBuffers, cache, spec: StepSpec) -> None:
        """One decode step (decode_step) on `b` and `cache`: eager, or compiled (CUDA) into one graph
        captured on the first call for this cache and replayed after."""
        if not self.compiled:
            return decode_step(self.model, cache, b, spec)
        if self._step is None:
            # "inductor": generated kernels, then CUDA graphs; "cudagraphs": the eager kernels captured
            # as they are (no code generation: a much shorter first call, kernels unfused).
            self._step = (torch.compile(decode_step, mode="reduce-overhead", dynamic=False) if self.backend == "inductor"
                          else torch.compile(decode_step, backend=self.backend, dynamic=False))
        torch.compiler.cudagraph_mark_step_begin()
        self._step(self.model, cache, b, spec)

    def release(self) -> None:
        """Free the kept caches (the next call allocates and re-captures)."""
        self.pool.clear()
        self.kept.clear()
