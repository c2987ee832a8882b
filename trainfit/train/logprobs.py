"""Log-probs of sampled tokens under a model, for samples in the one format GRPO trains on.

A sample is a dict with `input_ids` (the whole token sequence: prompt, then for multi-turn episodes
the policy's turns interleaved with environment / user tokens) and `loss_mask` (one 0/1 per token,
1 = a token the policy sampled). A single-turn sample is prompt (0s) + completion (1s).
"""

from __future__ import annotations

import torch

from trainfit.algos import shifted_logprobs


def single_turn_sample(prompt_ids: list[int], completion_ids: list[int], **extra) -> dict:
    return {"input_ids": prompt_ids + completion_ids,
            "loss_mask": [0] * len(prompt_ids) + [1] * len(completion_ids), **extra}


def policy_token_count(sample: dict) -> int:
    return sum(sample["loss_mask"])


def batch_tensors(samples: list[dict], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (ids [b, T], attention [b, T], mask [b, T-1]) with mask in the shifted frame:
    mask[i, t] is True when token t+1 of sample i is a policy token (its log-prob sits at t)."""
    width = max(len(s["input_ids"]) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)              # [b, T]
    attn = torch.zeros_like(ids)                                                     # [b, T]
    mask = torch.zeros((len(samples), width), dtype=torch.bool)                      # [b, T]
    for i, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[i, :n] = torch.tensor(s["input_ids"])
        attn[i, :n] = 1
        mask[i, :n] = torch.tensor(s["loss_mask"], dtype=torch.bool)
    return ids.to(device), attn.to(device), mask[:, 1:].to(device)


def sequence_logprobs(model, samples: list[dict], pad_id: int, device, temperature: float = 1.0,
                      chunk_size: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probs of each sample's tokens under `model` at the sampling temperature.

    Returns (logp [b, T-1], mask [b, T-1], logits [b, T-1, V]) in the frame where position t holds the
    log-prob of input token t+1; `mask` marks the policy's tokens. Logits are divided by the rollout
    temperature so the trained policy is the one that sampled.
    """
    ids, attn, mask = batch_tensors(samples, pad_id, device)
    logits = model(input_ids=ids, attention_mask=attn).logits                         # [b, T, V]
    logp = shifted_logprobs(logits, ids, temperature, chunk_size)                     # [b, T-1]
    return logp, mask, logits[:, :-1]
