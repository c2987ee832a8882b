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

# A warper maps (input_ids [b, T], scores [b, V]) to warped scores [b, V] (transformers' LogitsProcessor).
Warper = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def supports_decode_loop(model) -> bool:
    """Whether `model` (a transformers causal LM, possibly under PEFT) decodes correctly with a plain
    DynamicCache and the generic input preparation: models that override `prepare_inputs_for_generation`
    (Mamba, Phi-3's long-rope switch, multimodal ones) or need their own cache keep `generate`."""
    from transformers.generation.utils import GenerationMixin

    from trainfit.models import unwrap

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
           logprob_temperature: Optional[float] = None, synced: bool = False) -> Decoded:
    """Complete every prompt (token ids, any lengths) by up to `max_new` tokens.

    `pick(rows, seq, scores, step) -> tokens [b]` chooses each live row's next token from its
    float32 scores [b, V] (`rows` [b]: the rows' indices into `prompts`; `seq` [b, P + step]: their
    ids so far); `stopping(seq) -> bool [b]` ends rows on stop strings; a row also ends at `eos_id`.
    With `synced` (FSDP: every forward is a collective) no row leaves the batch and decoding goes on
    until every rank is done.
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
    rows = torch.arange(B, device=device)                        # batch row -> index into prompts
    if len(first) < B:
        inv = torch.tensor(inverse, device=device)
        cache.batch_select_indices(inv)
        logits, ids, mask, pos = logits[inv], ids[inv], mask[inv], pos[inv]
    seq = ids                                                    # [b, P + t]: prompt + new tokens
    last_pos = pos[:, -1]                                        # [b]
    live = torch.ones(B, dtype=torch.bool, device=device)        # [b] rows still generating
    tokens = torch.full((B, max_new), pad_id, dtype=torch.long)  # [B, max_new] on CPU
    logps = torch.zeros(B, max_new) if logprob_temperature is not None else None
    steps = 0
    for t in range(max_new):
        scores = logits.float()                                                           # [b, V]
        if logps is not None:
            lsm = torch.log_softmax(scores / logprob_temperature, dim=-1)                 # [b, V]
        nxt = pick(rows, seq, scores, t)                                                  # [b]
        nxt = torch.where(live, nxt, torch.full_like(nxt, pad_id))
        written = rows[live].cpu()
        tokens[written, t] = nxt[live].cpu()
        if logps is not None:
            logps[written, t] = lsm.gather(1, nxt[:, None]).squeeze(1)[live].cpu()
        steps = t + 1
        seq = torch.cat([seq, nxt[:, None]], dim=1)
        ended = nxt == eos_id if eos_id is not None else torch.zeros_like(live)
        if stopping is not None:
            ended |= stopping(seq)
        live &= ~ended
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
    own seeded Gumbel noise (exact sampling from the warped distribution; see hf.SeededGumbel)."""
    from trainfit.rollout.hf import _M64, _splitmix64, gumbel_noise, row_step_keys

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
