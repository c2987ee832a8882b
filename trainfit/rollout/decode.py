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

Rows are sampled with per-row seeds (counter-based Gumbel noise, see sampling.py), so which rows share
a batch, and when the batch shrinks, does not change any row's sample.

With a static cache (StaticDecoder in static_step.py; rollout.hf_cache) one decode step is one function:
the forward on the static cache, device-side seeded sampling, the sampled token's log-prob and the
finished-row bookkeeping, all written in place into preallocated buffers (StepBuffers). Nothing in it
reads back to the host, so on CUDA it is captured whole as one graph and replayed; the loop checks
whether every row has finished once every SYNC_EVERY steps and reads the outputs once at the end.
On CPU the same function runs eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from trainfit.models.policy import unwrap
from trainfit.rollout.sampling import SeededPick, seeded_pick
from trainfit.rollout.static_step import (STATIC_LENGTH_STEP, SYNC_EVERY, StaticDecoder, batch_bucket, decode_static,
                                          supports_static_cache)

# Re-exported: the engine and the tests reach the static path through this module.
__all__ = ["STATIC_LENGTH_STEP", "SYNC_EVERY", "Decoded", "SeededPick", "StaticDecoder", "batch_bucket", "decode",
           "left_padded", "seeded_pick", "supports_decode_loop", "supports_static_cache"]


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
           static: Optional[StaticDecoder] = None, stop_window: Optional[int] = None) -> Decoded:
    """Complete every prompt (token ids, any lengths) by up to `max_new` tokens.

    `pick(rows, seq, scores, step) -> tokens [b]` chooses each live row's next token from its
    float32 scores [b, V] (`rows` [b]: the rows' indices into `prompts`; `seq` [b, P + step]: their
    ids so far); `stopping(seq) -> bool [b]` ends rows on stop strings; a row also ends at `eos_id`.
    With `synced` (FSDP: every forward is a collective) no row leaves the batch and decoding goes on
    until every rank is done. With `static` the decode steps write into a static cache
    (StaticDecoder): finished rows stay in the batch, fed padding, so every step has one shape; `pick`
    must then be `seeded_pick`'s, and `stopping` sees each row's last `stop_window` ids (default:
    all of them; ids before the sequence's start read NO_TOKEN).
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
    inv = torch.tensor(inverse, device=device)
    if static is not None and not synced:
        if not isinstance(pick, SeededPick):
            raise TypeError("decode(static=...) samples on the device: pass pick=seeded_pick(...)")
        R = static.rows_for(B)
        index = torch.cat([inv, inv.new_zeros(R - B)])           # [R]: spare rows (bucketed) copy row 0
        cache = static.cache(cache, index, ids.shape[1] + max_new)  # the prefill's DynamicCache goes here
        return Decoded(*decode_static(
            static, cache, index, logits, ids, mask, pos, B, pad_id=pad_id, eos_id=eos_id, max_new=max_new, pick=pick,
            stopping=stopping, logprob_temperature=logprob_temperature,
            stop_window=(stop_window or ids.shape[1] + max_new) if stopping is not None else 1))
    live = torch.ones(B, dtype=torch.bool, device=device)        # [b] rows still generating
    tokens = torch.full((B, max_new), pad_id, dtype=torch.long)  # [B, max_new] on CPU
    logps = torch.zeros(B, max_new) if logprob_temperature is not None else None
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
