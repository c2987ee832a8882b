"""Generation for prompts with images through transformers' `generate` (HFEngine's image path).

Why `generate` and not trainfit's decoding loop (rollout/decode.py): the loop runs the decoder on
token ids alone; a VLM's prefill needs pixel_values / image_grid_thw and Qwen3-VL's 3-D rotary
positions (M-RoPE, from mm_token_type_ids), which transformers' generate computes and carries into
the decode steps (rope_deltas).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from transformers import LogitsProcessorList

from trainfit.data.image_examples import image_inputs, vision_token_ids
from trainfit.rollout.decode import left_padded
from trainfit.rollout.sampling import LogprobRecorder, SeededGumbel


class BanTokens:
    """A LogitsProcessor setting the given token ids' scores to -inf [B, V]."""

    def __init__(self, ids: list[int]):
        self.ids = ids

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.ids:
            scores[:, self.ids] = float("-inf")
        return scores


@torch.no_grad()
def vlm_generate(engine, prompts: list[list[int]], images: Sequence[list], *, greedy: bool,
                 seeds: Optional[Sequence[int]], max_new: int, batch_size: int, logprobs: bool,
                 temperature: float) -> list:
    """HFEngine.generate for prompts with images: `model.generate` with the image inputs, the same
    seeded sampling (SeededGumbel: a row's sample depends only on its seed) and log-prob recording."""
    model, proc = engine.model, engine.processor
    device = next(model.parameters()).device
    banned = vision_token_ids(proc)
    if not greedy and seeds is None:
        seeds = torch.randint(0, 2**62, (len(prompts),)).tolist()
    lp_temp = (1.0 if greedy else temperature) if logprobs else None
    out = []
    for i in range(0, len(prompts), batch_size):
        chunk, ims = prompts[i:i + batch_size], images[i:i + batch_size]
        ids, mask = left_padded(chunk, engine.pad_id, device)                            # [B, P] each
        extra = image_inputs([{"input_ids": p, "images": m} for p, m in zip(chunk, ims)], proc, device,
                             width=ids.shape[1], left=True)
        recorder = LogprobRecorder(lp_temp) if lp_temp is not None else None
        # The vision tokens are banned after the recorder: it keeps the model's own log-probs (what
        # the trainer computes), while a sampled image pad would break the next forward (its
        # image-token count would not match the images).
        procs: list = [recorder] if recorder else []
        procs.append(BanTokens(banned))
        if not greedy:
            procs += [*engine._warpers(temperature), SeededGumbel(seeds[i:i + batch_size])]
        stop = dict(stop_strings=engine.stop, tokenizer=engine.tokenizer) if engine.stop else {}
        seqs = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, eos_token_id=engine.eos_id,
                              pad_token_id=engine.pad_id, use_cache=True, do_sample=False,
                              logits_processor=LogitsProcessorList(procs), **extra, **stop)
        new_t = seqs[:, ids.shape[1]:].cpu()                                              # [B, <=max_new]
        lp = recorder.finish(new_t).tolist() if recorder and new_t.shape[1] else None
        for r, row in enumerate(new_t.tolist()):
            c = engine._finish(row)
            if logprobs:
                c.logprobs = lp[r][: len(c.token_ids)] if lp is not None else []
            out.append(c)
    return out
