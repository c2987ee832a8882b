"""Log-probs of sampled (GRPO) or labelled (SFT) tokens under a model, with the LM head at those positions only.

A sample is a dict with `input_ids` (the whole token sequence: prompt, then for multi-turn episodes
the policy's turns interleaved with environment / user tokens) and `loss_mask` (one 0/1 per token,
1 = a token the policy sampled). A single-turn sample is prompt (0s) + completion (1s).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Optional

import torch
import transformers.modeling_utils

from trainfit.algos import IGNORE_INDEX, linear_token_logprobs, token_logprobs_rows
from trainfit.models.fused_head import identity_head, liger_logprobs
from trainfit.models.policy import unwrap


def single_turn_sample(prompt_ids: list[int], completion_ids: list[int], **extra) -> dict:
    return {"input_ids": prompt_ids + completion_ids,
            "loss_mask": [0] * len(prompt_ids) + [1] * len(completion_ids), **extra}


def policy_token_count(sample: dict) -> int:
    return sum(sample["loss_mask"])


def to_frame(rows: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Values at the `mask` positions `[n]` (row-major) -> the `[b, T-1]` frame of `mask`, zeros
    elsewhere; differentiable in `rows`."""
    return torch.zeros(mask.shape, dtype=rows.dtype, device=rows.device).masked_scatter(mask, rows)


def scatter_values(values: list[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """Per-sample 1-D values stored by `store_rows` -> the `[b, T-1]` frame of `mask` in fp32."""
    return to_frame(torch.cat([v.to(mask.device, torch.float32) for v in values]), mask)


def store_rows(chunk: list[dict], key: str, x: torch.Tensor, mask: torch.Tensor) -> None:
    """Keep each sample's values at its mask positions (`x`, `mask` `[b, T-1]`) as `sample[key]`, a
    1-D fp32 CPU tensor (what rollout buffers hold between the scoring and the training forwards)."""
    for s, row, m in zip(chunk, x, mask):
        s[key] = row[m].float().cpu()                                          # [c_i]


def batch_tensors(samples: list[dict], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (ids [b, T], attention [b, T], mask [b, T-1]) with mask in the shifted frame:
    mask[i, t] is True when token t+1 of sample i is a policy token (its log-prob sits at t)."""
    mask = shifted_mask(samples)                                                     # [b, T-1]
    width = mask.shape[1] + 1
    # Padded as Python lists and converted once (one tensor per field, not one per sample).
    ids = torch.tensor([list(s["input_ids"]) + [pad_id] * (width - len(s["input_ids"])) for s in samples],
                       dtype=torch.long)                                             # [b, T]
    attn = torch.tensor([[1] * len(s["input_ids"]) + [0] * (width - len(s["input_ids"])) for s in samples],
                        dtype=torch.long)                                            # [b, T]
    return ids.to(device), attn.to(device), mask.to(device)


def shifted_mask(samples: list[dict]) -> torch.Tensor:
    """The policy-token mask `[b, T-1]` (CPU, bool) of right-padded samples in the shifted frame."""
    for s in samples:
        if len(s["loss_mask"]) != len(s["input_ids"]):
            raise ValueError(f"a sample has {len(s['input_ids'])} input_ids and {len(s['loss_mask'])} loss_mask "
                             "entries; they must be one per token")
    width = max(len(s["input_ids"]) for s in samples)
    return torch.tensor([[bool(x) for x in s["loss_mask"][1:]] + [False] * (width - len(s["loss_mask"]))
                         for s in samples], dtype=torch.bool).reshape(len(samples), width - 1)


@dataclass
class ForwardBatch:
    """A micro-batch as its forward takes it, padded or packed, and the way back to the padded frame.

    Padded: `ids` `[b, T]` right-padded with `attn` `[b, T]`. Packed (train.padding_free): the samples
    back to back in one row `ids` `[1, N]` (N = their real tokens), `attn` None and `inputs` holding
    `position_ids` restarting at 0 per sample; transformers reads the sequence boundaries from the
    restarts (flash-attention's varlen kernels, or a block-diagonal causal mask with sdpa / eager,
    masking_utils.find_packed_sequence_indices), so each sample attends to itself only at its own
    positions and every kept row equals the padded forward's. `keep` `[rows, width]` marks the
    positions whose next token is a policy token; in both layouts the samples' positions come in
    sample order, so the kept rows (row-major) are the `mask` frame's positions in its row-major
    order, and `frame` puts them back into the `[b, T-1]` frame the algos math reads.
    """

    ids: torch.Tensor
    attn: Optional[torch.Tensor]
    keep: torch.Tensor
    mask: torch.Tensor
    inputs: dict

    @property
    def targets(self) -> torch.Tensor:
        """The policy tokens `[n]`, one per kept position (the token after it)."""
        return self.ids[:, 1:][self.keep[:, :-1]]

    def frame(self, rows: torch.Tensor) -> torch.Tensor:
        """Values `[n]` at the kept positions -> the `[b, T-1]` frame, zeros off the mask."""
        return to_frame(rows, self.mask)

    def per_position(self, x: torch.Tensor) -> torch.Tensor:
        """A per-position output `[rows, width]` (e.g. a critic's values) -> the `[b, T-1]` frame where t
        is read before token t+1: padded, the columns but the last; packed, the values at the mask's
        positions (zeros elsewhere, where nothing reads them)."""
        return x[:, :-1] if self.attn is not None else self.frame(x[self.keep])


def forward_batch(samples: list[dict], pad_id: int, device, packed: bool = False) -> ForwardBatch:
    """The micro-batch `samples` padded (`batch_tensors`) or packed into one row (see ForwardBatch)."""
    if not packed:
        ids, attn, mask = batch_tensors(samples, pad_id, device)
        return ForwardBatch(ids, attn, torch.nn.functional.pad(mask, (0, 1)), mask, {})
    mask = shifted_mask(samples)
    ids, pos, keep = [], [], []
    for s in samples:
        ids += list(s["input_ids"])
        pos += range(len(s["input_ids"]))
        keep += [bool(x) for x in s["loss_mask"][1:]] + [False]  # a sample's last token scores nothing
    row = lambda x, dt=torch.long: torch.tensor([x], dtype=dt, device=device)  # noqa: E731
    # use_cache=False: transformers reads packed positions only when no cache is passed, and a model
    # with config.use_cache would otherwise make one for this forward.
    return ForwardBatch(row(ids), None, row(keep, torch.bool), mask.to(device),
                        {"position_ids": row(pos), "use_cache": False})


def sequence_logprobs(model, samples: list[dict], pad_id: int, device, temperature: float = 1.0,
                      chunk_size: int = 0, entropy: bool = False, inputs: Optional[dict] = None,
                      head: str = "off", packed: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs of each sample's policy tokens under `model` at the sampling temperature.

    Returns (logp [b, T-1], mask [b, T-1], entropy [b, T-1] or None) in the frame where position t
    holds the log-prob of input token t+1; `mask` marks the policy's tokens and both other tensors
    are 0 elsewhere. Logits are divided by the rollout temperature so the trained policy is the one
    that sampled. With `entropy`, the third tensor is the (detached) entropy of softmax(logits) at
    each policy position, what GRPO logs.

    The LM head runs only at the positions whose next token is a policy token (not over the prompt,
    environment tokens or padding), and the log-softmax goes `chunk_size` rows at a time
    (`algos.token_logprobs_rows`): no `[b, T, V]` logits exist. The values equal those of the full
    logits (`algos.shifted_logprobs`) up to float rounding (tests/test_perf_equivalence.py).
    `inputs`: further forward arguments (the images of a vision-language batch, data/image_examples.py).
    `head`: the resolved train.fused_head (`off`, `chunked`, `liger`; see `head_logprobs`).
    `packed`: one padding-free row for the forward (train.padding_free, `ForwardBatch`); the same values.
    """
    fb = forward_batch(samples, pad_id, device, packed)
    logp_rows, ent_rows = head_logprobs(model, fb.ids, fb.attn, fb.keep, fb.targets, temperature, chunk_size, entropy,
                                        {**(inputs or {}), **fb.inputs}, head)   # [n] each (n = mask.sum())
    return fb.frame(logp_rows), fb.mask, (None if ent_rows is None else fb.frame(ent_rows))


def label_logprobs(model, ids: torch.Tensor, attn: torch.Tensor, labels: torch.Tensor, chunk_size: int = 0,
                   inputs: Optional[dict] = None, head: str = "off") -> torch.Tensor:
    """Log-probs `[n]` of the labelled tokens (SFT / pretraining): position t scores label t+1 where
    it is not -100, in row-major order. The LM head runs at those n positions only (`policy_logits`:
    no logits over prompts, masked turns or padding) and the log-softmax goes `chunk_size` rows at a
    time; `-sum / tokens` is `algos.sft_loss` over full logits (tests/test_perf_equivalence.py).
    `inputs`: further forward arguments (a vision-language batch's pixel_values, image_grid_thw...).
    `head`: the resolved train.fused_head (`head_logprobs`)."""
    shifted = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # [b, T]: the label t scores
    keep = shifted != IGNORE_INDEX                                                 # [b, T]
    return head_logprobs(model, ids, attn, keep, shifted[keep], 1.0, chunk_size, False, inputs, head)[0]   # [n]


def head_logprobs(model, ids: torch.Tensor, attn: torch.Tensor, keep: torch.Tensor, targets: torch.Tensor,
                  temperature: float, chunk_size: int, entropy: bool, inputs: Optional[dict], head: str = "off"
                  ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(log p(target) `[n]`, detached entropy `[n]` or None) at the positions `keep [b, T]` marks.

    `off`: the model's logits `[n, V]` (`policy_logits`), then `algos.token_logprobs_rows`.
    `chunked` / `liger` (models/fused_head.py): the same forward with the output embedding as the
    identity gives the hidden rows `[n, d]`, and the head runs fused with the log-probs: chunk by
    chunk in `algos.linear_token_logprobs`, or in Liger's kernel (whose entropy, when asked, comes
    from a no-grad chunked pass: one more head matmul). No `[n, V]` tensor outlives a chunk.
    """
    if head == "off":
        rows = policy_logits(model, ids, attn, keep, inputs)                       # [n, V]
        return token_logprobs_rows(rows, targets, temperature, chunk_size, entropy)

    with identity_head(model) as out_head:
        hidden = policy_logits(model, ids, attn, keep, inputs)                     # [n, d]
    weight, bias = out_head.weight, out_head.bias
    if head == "chunked":
        return linear_token_logprobs(hidden, weight, targets, temperature, chunk_size, entropy, bias)
    logp = liger_logprobs(hidden, weight, bias, targets, temperature) if targets.numel() else \
        linear_token_logprobs(hidden, weight, targets, temperature, chunk_size, False, bias)[0]
    if not entropy:
        return logp, None
    with torch.no_grad():
        ent = linear_token_logprobs(hidden.detach(), weight.detach(), targets, temperature, chunk_size, True,
                                    None if bias is None else bias.detach())[1]
    return logp, ent


# transformers >= 5 slices the hidden states by a boolean [b, T] `logits_to_keep` before the LM head
# (modeling_utils.slice_logits_to_keep); older versions take an int or 1-D positions only.
_BOOL_KEEP = hasattr(transformers.modeling_utils, "slice_logits_to_keep")
_KEEP_OK: dict[type, bool] = {}   # model class -> its forward honoured logits_to_keep as asked


def _takes_logits_to_keep(model) -> bool:
    base = unwrap(model, peft=True)
    ok = _KEEP_OK.get(type(base))
    if ok is None:
        try:
            ok = "logits_to_keep" in inspect.signature(base.forward).parameters
        except (TypeError, ValueError):
            ok = False
        _KEEP_OK[type(base)] = ok
    return ok


def policy_logits(model, ids: torch.Tensor, attn: torch.Tensor, keep: torch.Tensor,
                  inputs: Optional[dict] = None) -> torch.Tensor:
    """Logits `[n, V]` at the positions `keep [b, T]` marks (row-major order), from one forward that
    applies the LM head to those positions only where the model allows it.

    The model is called as itself (through any DDP / FSDP / DeepSpeed / PEFT wrapper, so their hooks
    and collectives run as usual) with `logits_to_keep`: the boolean mask on transformers >= 5, else
    the positions kept in any row. A model without `logits_to_keep`, or whose output does not have
    the asked shape, gets full logits and the rows are selected from them. `inputs` are passed on to
    the forward (images of a vision-language batch).
    """
    n = int(keep.sum())
    extra = inputs or {}
    base_type = type(unwrap(model, peft=True))
    if _takes_logits_to_keep(model):
        if _BOOL_KEEP:
            logits = model(input_ids=ids, attention_mask=attn, logits_to_keep=keep, **extra).logits
            if logits.dim() == 2 and logits.shape[0] == n:
                return logits                                                  # [n, V]
        else:
            cols = keep.any(0).nonzero().squeeze(1)                            # [k] positions
            if not cols.numel():                                               # no policy token at all
                return model(input_ids=ids, attention_mask=attn, **extra).logits[keep]
            logits = model(input_ids=ids, attention_mask=attn, logits_to_keep=cols, **extra).logits
            if logits.dim() == 3 and logits.shape[:2] == (keep.shape[0], cols.numel()):
                return logits[keep[:, cols]]                                   # [b, k, V] -> [n, V]
        _KEEP_OK[base_type] = False   # not honoured: full logits from now on for this model class
    return model(input_ids=ids, attention_mask=attn, **extra).logits[keep]     # [b, T, V] -> [n, V]
