"""Padding-free packed SFT (data.packing): a micro-batch's sequences back to back in one row.

`pack` concatenates the micro-batch's items into one row of N = sum of their lengths tokens, with
`position_ids` restarting at 0 at each sequence and no attention mask, and each sequence's first
label set to -100 (its last token must not learn to predict the next sequence's first; unpacked, a
row's first label is never scored either). transformers then reads the boundaries from the position
restarts, as its DataCollatorWithFlattening expects: flash-attention 2/3 run their varlen kernels
(cu_seqlens from the restarts, no mask), sdpa / eager / flex attention get a block-diagonal causal
mask (masking_utils.find_packed_sequence_indices). Every sequence attends to itself only, at its own
positions, so the labelled tokens' log-probs, the loss and its gradients are those of the padded
batch, with no compute or activation memory spent on padding.
"""

from __future__ import annotations

import torch

from trainfit.algos import IGNORE_INDEX, nll_mean
from trainfit.models.logprobs import label_logprobs


def pack(items: list[dict]) -> dict[str, torch.Tensor]:
    """One row of the items' sequences: input_ids, position_ids, labels, each a LongTensor [1, N]."""
    ids: list[int] = []
    pos: list[int] = []
    labels: list[int] = []
    for it in items:
        seq = list(it["input_ids"])
        lab = list(it.get("labels", seq))
        ids += seq
        pos += range(len(seq))
        labels += [IGNORE_INDEX] + lab[1:]   # the boundary: nothing predicts a sequence's first token
    as_row = lambda x: torch.tensor([x], dtype=torch.long)  # noqa: E731
    return {"input_ids": as_row(ids), "position_ids": as_row(pos), "labels": as_row(labels)}


def packed_loss(model, micro: list[dict], totals: dict, device, chunk_rows: int = 0,
                head: str = "off") -> tuple[torch.Tensor, dict]:
    """LMStage.loss on the packed row of `micro`: the labelled tokens' summed NLL over the step's
    loss tokens (`totals["tokens"]`), as the padded path computes it."""
    b = {k: v.to(device) for k, v in pack(micro).items()}                           # [1, N] each
    # use_cache=False: transformers reads packed positions only when no cache is passed, and a model
    # with config.use_cache would otherwise make one for this forward.
    logp = label_logprobs(model, b["input_ids"], None, b["labels"], chunk_rows,
                          {"position_ids": b["position_ids"], "use_cache": False}, head)  # [n] labelled tokens
    return nll_mean(logp.sum(), totals["tokens"]), {"tokens": logp.numel(), "seq_tokens": b["input_ids"].shape[1]}
