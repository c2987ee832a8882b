"""trainfit's own KV-cached decoding loop for standard decoder-only transformers models.

`HFEngine` uses it instead of `model.generate` where it applies (`supports_decode_loop`). It computes
what `generate` computes with the same logits processors (tested token for token), and does less per
call and per step:
- one prefill per distinct prompt: GRPO's G completions of a prompt share its KV rows, copied G
  times after the prefill instead of computed G times;
- finished rows leave the batch (the cache is compacted once the live rows fall under 3/4 of it,
  so the copies cost at most a few cache sizes over the whole call);
- the sampled token's log-prob is read off the step's logits directly, and no generation-config
  set-up, validation or stopping-criteria machinery runs per call.
It applies no processor from the model's `generation_config` (repetition penalty and the like): the
engine samples from exactly the policy distribution the trainer scores, as TRL's vLLM path does.

Rows are sampled with per-row seeds (counter-based Gumbel noise, see hf.py), so which rows share a
batch, and when the batch shrinks, does not change any row's sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from trainfit.models.policy import unwrap
from trainfit.rollout.sampling import _M64, _splitmix64, gumbel_noise, row_step_keys

# A warper maps (input_ids [b, T], scores [b, V]) to warped scores [b, V] (transformers' LogitsProcessor).
Warper = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def supports_decode_loop(model) -> bool:
    """Whether `model` (a transformers causal LM, possibly under PEFT) decodes correctly with a plain
    DynamicCache and the generic input preparation: models that override `prepare_inputs_for_generation`
    (Mamba, Phi-3's long-rope switch, multimodal ones) or need their own cache keep `generate`."""
    from transformers.generation.utils import GenerationMixin


    base = unwrap(model, peft=True)
    cls = type(base)
    return (isinstance(base, GenerationMixin)
            and not getattr(base.config, "is_encoder_decoder", False)
            and getattr(cls, "prepare_inputs_for_generation", None) is GenerationMixin.prepare_inputs_for_generation
            and cls._supports_default_dynamic_cache()
            and bool(getattr(base, "_supports_logits_to_keep", lambda: False)()))


def left_padded(prompts: Sequence[Sequence[int]], pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, P], attention mask [B, P]) with the prompts left-padded to the longest: every prompt's
    last token sits in the last column, so the new tokens of all rows align."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + list(p) for p in prompts], dtype=torch.long, device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long, device=device)
    return ids, mask


@dataclass
class Decoded:
    tokens: torch.Tensor                 # [B, n] new tokens (pad after a row finished), on CPU
    logprobs: Optional[torch.Tensor]     # [B, n] log softmax(raw logits / T) of each token, or None


@torch.no_grad()
def decode(model, prompts: Sequence[Sequence[int]], *, pad_id: int, eos_id: Optional[int], max_new: int,
           pick: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor],
           stopping: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
           logprob_temperature: Optional[float] = None, synced: bool = False,
           static: Optional["StaticDecoder"] = None) -> Decoded:
    """Complete every prompt (token ids, any lengths) by up to `max_new` tokens.

    `pick(rows, seq, scores, step) -> tokens [b]` chooses each live row's next token from its
    float32 scores [b, V] (`rows` [b]: the rows' indices into `prompts`; `seq` [b, P + step]: their
    ids so far); `stopping(seq) -> bool [b]` ends rows on stop strings; a row also ends at `eos_id`.
    With `synced` (FSDP: every forward is a collective) no row leaves the batch and decoding goes on
    until every rank is done. With `static` the decode steps write into a static cache
    (StaticDecoder): finished rows stay in the batch, fed padding, so every step has one shape.
    """
    device = next(model.parameters()).device
    B = len(prompts)
    # Distinct prompts, in first-seen order; inverse[i] = the distinct prompt row i completes.
    first: dict = {}
    inverse = [first.setdefault(tuple(p), len(first)) for p in prompts]
    ids, mask = left_padded(list(first), pad_id, device)                                 # [U, P] each
    pos = (mask.cumsum(-1) - 1).clamp_(min=0)                                             # [U, P]
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                   use_cache=True, logits_to_keep=1).logits[:, -1]                        # [U, V]
    live = torch.ones(B, dtype=torch.bool, device=device)        # [b] rows still generating
    tokens = torch.full((B, max_new), pad_id, dtype=torch.long)  # [B, max_new] on CPU
    logps = torch.zeros(B, max_new) if logprob_temperature is not None else None
    inv = torch.tensor(inverse, device=device)
    if static is not None and not synced:
        R = static.rows_for(B)
        index = torch.cat([inv, inv.new_zeros(R - B)])           # [R]: spare rows (bucketed) copy row 0
        cache = static.cache(cache, index, ids.shape[1] + max_new)  # the prefill's DynamicCache goes here
        return _decode_static(static, cache, index, logits, ids, mask, pos, inv, live, tokens, logps,
                              pad_id=pad_id, eos_id=eos_id, max_new=max_new, pick=pick, stopping=stopping,
                              logprob_temperature=logprob_temperature)
    rows = torch.arange(B, device=device)                        # batch row -> index into prompts
    if len(first) < B:
        cache.batch_select_indices(inv)
        logits, ids, mask, pos = logits[inv], ids[inv], mask[inv], pos[inv]
    seq = ids                                                    # [b, P + t]: prompt + new tokens
    last_pos = pos[:, -1]                                        # [b]
    steps = 0
    for t in range(max_new):
        nxt = _pick_and_record(logits, rows, seq, live, t, tokens, logps, pick, pad_id, logprob_temperature)
        steps = t + 1
        seq = torch.cat([seq, nxt[:, None]], dim=1)
        live &= ~_ended(nxt, seq, eos_id, stopping)
        if not _any_live(live, synced) or t + 1 == max_new:
            break
        if not synced and int(live.sum()) < 0.75 * len(rows):
            keep = live.nonzero().squeeze(1)                     # drop finished rows from the batch
            cache.batch_select_indices(keep)
            rows, seq, mask, last_pos, nxt, live = rows[keep], seq[keep], mask[keep], last_pos[keep], nxt[keep], live[keep]
        mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)                      # [b, P + t + 1]
        last_pos = last_pos + 1
        logits = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=last_pos[:, None],
                       past_key_values=cache, use_cache=True).logits[:, -1]               # [b, V]
    return Decoded(tokens[:, :steps], None if logps is None else logps[:, :steps])


def _decode_static(static: "StaticDecoder", cache, index, logits, ids, mask, pos, inv, live, tokens, logps, *,
                   pad_id, eos_id, max_new, pick, stopping, logprob_temperature) -> Decoded:
    """`decode`'s steps on the static cache `cache` of R = len(index) >= B rows, prefilled with the
    distinct prompts `index` (R - B spare rows when bucketed: copies of row 0 fed padding, never
    read). The rows never change, so `pick` sees the same rows each step."""
    B, P, R = len(inv), ids.shape[1], len(index)
    L = cache.layers[0].max_cache_len
    # Fixed mask [R, L]: zeros on the left padding, ones from the first prompt token on (the
    # columns a step has not reached yet are hidden by causality: key column <= query position).
    full_mask = torch.ones(R, L, dtype=mask.dtype, device=mask.device)
    full_mask[:, :P] = mask[index]
    logits, seq = logits[inv], ids[inv]                                                   # [B, V], [B, P]
    step_pos = pos[index, -1:].clone()                                                    # [R, 1]
    feed = torch.full((R, 1), pad_id, dtype=torch.long, device=ids.device)                # [R, 1]
    rows = torch.arange(B, device=ids.device)
    steps = 0
    for t in range(max_new):
        nxt = _pick_and_record(logits, rows, seq, live, t, tokens, logps, pick, pad_id, logprob_temperature)
        steps = t + 1
        seq = torch.cat([seq, nxt[:, None]], dim=1)
        live &= ~_ended(nxt, seq, eos_id, stopping)
        if not bool(live.any()) or t + 1 == max_new:
            break
        feed[:B, 0] = nxt
        step_pos += 1
        logits = static.step(feed, full_mask, step_pos, cache)[:B]                         # [B, V]
    return Decoded(tokens[:, :steps], None if logps is None else logps[:, :steps])


def _pick_and_record(logits, rows, seq, live, t, tokens, logps, pick, pad_id, logprob_temperature) -> torch.Tensor:
    """Step t's tokens [b] (padding for finished rows), written with their log-probs into the
    CPU outputs `tokens` / `logps` [B, max_new] at the live rows."""
    scores = logits.float()                                                               # [b, V]
    if logps is not None:
        lsm = torch.log_softmax(scores / logprob_temperature, dim=-1)                     # [b, V]
    nxt = pick(rows, seq, scores, t)                                                      # [b]
    nxt = torch.where(live, nxt, torch.full_like(nxt, pad_id))
    written = rows[live].cpu()
    tokens[written, t] = nxt[live].cpu()
    if logps is not None:
        logps[written, t] = lsm.gather(1, nxt[:, None]).squeeze(1)[live].cpu()
    return nxt


def _ended(nxt: torch.Tensor, seq: torch.Tensor, eos_id: Optional[int], stopping) -> torch.Tensor:
    """bool [b]: rows whose token `nxt` is eos or whose ids `seq` now end on a stop string."""
    ended = nxt == eos_id if eos_id is not None else torch.zeros_like(nxt, dtype=torch.bool)
    if stopping is not None:
        ended |= stopping(seq)
    return ended


def _any_live(live: torch.Tensor, synced: bool) -> bool:
    """Whether any row here (or, synced, on any rank) is still generating."""
    flag = live.any()
    if synced and dist.is_available() and dist.is_initialized():
        f = flag.to(torch.int32).reshape(1)
        dist.all_reduce(f, op=dist.ReduceOp.MAX)
        return bool(f.item())
    return bool(flag)


def seeded_pick(warpers: Sequence[Warper], seeds: Sequence[int], greedy: bool):
    """`pick` for `decode`: argmax of the scores (greedy), or of the warped scores plus each row's
    own seeded Gumbel noise (exact sampling from the warped distribution; see sampling.SeededGumbel)."""
    mixed = [_splitmix64(int(s) & _M64) for s in seeds] if not greedy else []

    def pick(rows: torch.Tensor, seq: torch.Tensor, scores: torch.Tensor, step: int) -> torch.Tensor:
        if greedy:
            return scores.argmax(-1)
        for w in warpers:
            scores = w(seq, scores)
        r = rows.tolist()
        keys = row_step_keys([seeds[i] for i in r], step, [mixed[i] for i in r])
        return gumbel_noise(keys, scores.shape[-1], scores.device).add_(scores).argmax(-1)

    return pick


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


# Bucketed caches are sized in steps of this many tokens, so prompts of varying lengths rarely need a
# longer cache (each new length is another graph capture).
STATIC_LENGTH_STEP = 128


def batch_bucket(b: int) -> int:
    """Rows the compiled step runs with for a batch of `b`: the next power of two (8 at least), so a
    few captured graphs serve every batch size."""
    return max(8, 1 << (b - 1).bit_length())


class StaticDecoder:
    """A static KV cache and the one-token decode step that writes into it.

    transformers' StaticCache preallocates keys and values [rows, kv_heads, length, head_dim] per
    layer and writes each step's token in place at one shared position (rows are left-padded, so
    every row's t-th new token sits at column P + t). The attention mask [rows, length] is fixed for
    the whole call (zeros on the left padding, ones elsewhere; columns past the current step are
    hidden by causality), so every decode step has the same shapes and tensor addresses.

    With `compiled` (CUDA only) the step is `torch.compile(mode="reduce-overhead")`: one CUDA graph
    per batch bucket (batch_bucket), replayed each token. The caches are then kept between calls
    (one per bucket, sized STATIC_LENGTH_STEP tokens at a time, grown when a longer call comes): a
    new cache address would make the graph re-record. Without it each call allocates its cache at
    exactly its rows x (prompt + new tokens).
    """

    def __init__(self, model, compiled: bool = False, bucketed: Optional[bool] = None):
        self.model, self.compiled = model, compiled
        self.bucketed = compiled if bucketed is None else bucketed   # rows in buckets, caches kept
        self.pool: dict = {}      # bucketed: batch bucket -> StaticCache kept between calls
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

    def step(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache) -> torch.Tensor:
        """Logits [rows, V] of one new token per row (ids, pos [rows, 1]; mask [rows, length])."""
        if not self.compiled:
            return _step(self.model, ids, mask, pos, cache)
        if self._step is None:
            self._step = torch.compile(_step, mode="reduce-overhead", dynamic=False)
        torch.compiler.cudagraph_mark_step_begin()
        return self._step(self.model, ids, mask, pos, cache).clone()   # the graph's output buffer is reused

    def release(self) -> None:
        """Free the kept caches (the next call allocates and re-captures)."""
        self.pool.clear()


def _step(model, ids, mask, pos, cache) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                 use_cache=True).logits[:, -1]
