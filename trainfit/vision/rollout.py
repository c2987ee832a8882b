"""RL with images: prompts whose examples carry images (tasks/shapes.py's ImageExample), generation
with the image inputs through transformers' `generate`, and the image inputs of the trainer's
log-prob forwards.

A sample (models/logprobs.py) whose prompt holds images has `images`: the RGB PIL images in the order
their image tokens appear in `input_ids` (each as `<|vision_start|>` + n x `<|image_pad|>` +
`<|vision_end|>`, n from the image size). Image tokens sit in the prompt (loss_mask 0), so only the
policy's text tokens carry loss.

Why `generate` and not trainfit's decoding loop (rollout/decode.py): the loop runs the decoder on
token ids alone; a VLM's prefill needs pixel_values / image_grid_thw and Qwen3-VL's 3-D rotary
positions (M-RoPE, from mm_token_type_ids), which transformers' generate computes and carries into
the decode steps (rope_deltas).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional, Sequence

import torch

from trainfit.data import IGNORE, encode_prompt
from trainfit.vision.data import expand_images
from trainfit.models.images import VisionProcessor

PLACEHOLDER = "<image>"


def example_images(ex) -> list:
    """The images an example's prompt carries ([] for text examples)."""
    return list(getattr(ex, "images", None) or [])


def policy_processor(cfg, model, tokenizer, task=None) -> Optional[VisionProcessor]:
    """The VisionProcessor of a vision-language policy, else None (SFT and GRPO stages).

    A task whose prompts carry images given to a text model is a ConfigError: the images would be
    dropped and their `<image>` placeholders read as text, training on something else than asked."""
    from trainfit.config import ConfigError
    from trainfit.models.policy import unwrap
    from trainfit.models.images import is_vlm_config
    from trainfit.models.images import load_processor

    if is_vlm_config(unwrap(model, peft=True).config):
        return load_processor(cfg.model, tokenizer)
    if task is not None and example_images(task.train_example(0)):
        raise ConfigError(
            f"task.name={cfg.task.name!r}: its prompts carry images, but model.name={cfg.model.name!r} is a text "
            "model (its config has no vision_config); use a vision-language model (e.g. a Qwen2.5-VL / Qwen3-VL "
            "checkpoint, or preset:vlm-tiny to try it) or a task without images.")
    return None


def encode_image_prompt(tokenizer, proc: VisionProcessor, ex, chat: bool) -> list[int]:
    """Prompt ids of an example with images: each `<image>` placeholder in its prompt text becomes
    the image's vision tokens (pad repeated to the image's token count). Text examples go through
    data.encode_prompt unchanged."""
    images = example_images(ex)
    if not images:
        return encode_prompt(tokenizer, ex, chat)
    def swap(text: str) -> str:
        return text.replace(PLACEHOLDER, proc.placeholder)

    if ex.messages is not None:
        msgs = [{**m, "content": swap(m["content"])} if isinstance(m.get("content"), str) else m for m in ex.messages]
        rendered = SimpleNamespace(messages=msgs, prompt=None)
    else:
        rendered = SimpleNamespace(messages=None, prompt=swap(ex.prompt))
    ids = encode_prompt(tokenizer, rendered, chat)
    counts = [proc.tokens_for(im.height, im.width) for im in images]
    out, _ = expand_images(ids, [IGNORE] * len(ids), counts, proc.image_token_id, "an image prompt")
    return out


def encode_image_example(tokenizer, proc: VisionProcessor, ex, max_len: int, chat: bool) -> dict:
    """An SFT item of an example with images: data.encode_example's input_ids / labels (loss on the
    target) with the images' tokens expanded (no loss), and `images` (the PIL images, in order)."""
    from trainfit.data import encode_example
    from trainfit.vision.data import fit_length

    images = example_images(ex)
    swap = lambda text: text.replace(PLACEHOLDER, proc.placeholder)  # noqa: E731
    msgs = None if ex.messages is None else [
        {**m, "content": swap(m["content"])} if isinstance(m.get("content"), str) else m for m in ex.messages]
    rendered = SimpleNamespace(messages=msgs, prompt=None if ex.prompt is None else swap(ex.prompt),
                               target=ex.target, answer=ex.answer)
    enc = encode_example(tokenizer, rendered, 10 ** 9, chat)
    counts = [proc.tokens_for(im.height, im.width) for im in images]
    ids, labels = expand_images(enc["input_ids"], enc["labels"], counts, proc.image_token_id, "a task example")
    item = fit_length(ids, labels, proc.image_token_id, max_len, "a task example", len(images), sum(counts))
    item["images"] = images
    return item


def image_inputs(samples: list[dict], proc: Optional[VisionProcessor], device, width: Optional[int] = None,
                 left: bool = False) -> dict:
    """Forward arguments for the images of a batch of samples (rows in order, each row's images in
    order): pixel_values [patches, C x temporal x patch^2], image_grid_thw [images, 3] and
    mm_token_type_ids [B, width] (1 at image tokens, padded like the ids: right, or left for
    generation). {} when no sample has images."""
    images = [im for s in samples for im in s.get("images") or []]
    if proc is None or not images:
        return {}
    width = width or max(len(s["input_ids"]) for s in samples)
    rows = []
    for s in samples:
        flags = [int(t == proc.image_token_id) for t in s["input_ids"]]
        pad = [0] * (width - len(flags))
        rows.append(pad + flags if left else flags + pad)
    out = proc.pixels(images)
    out["mm_token_type_ids"] = torch.tensor(rows, dtype=torch.long)                   # [B, width]
    return {k: v.to(device) for k, v in out.items()}


def vision_token_ids(proc: Optional[VisionProcessor]) -> list[int]:
    """The vision special tokens no policy may sample (an image pad, vision start / end, a video pad):
    a sampled one would be read as an image by the next forward, whose image-token count would then
    not match its images. [] without a processor (a text policy)."""
    if proc is None:
        return []
    tok = proc.tokenizer
    return sorted({tok.convert_tokens_to_ids(t) for t in (proc.image_token, proc.start_token, proc.end_token,
                                                          "<|video_pad|>")} - {None, tok.unk_token_id})


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
    from transformers import LogitsProcessorList

    from trainfit.rollout.decode import left_padded
    from trainfit.rollout.hf import LogprobRecorder, SeededGumbel

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


def image_task_accuracy(engine, tokenizer, proc: VisionProcessor, task, chat: bool, batch_size: int = 64,
                        rewards=None) -> dict[str, float]:
    """train/evaluate.task_accuracy for a task whose prompts carry images: greedy, held-out examples,
    judged by the task's own `is_correct` (and scored by the run's rewards when given)."""
    examples = task.eval_examples()
    if not examples:
        return {}
    prompts = [encode_image_prompt(tokenizer, proc, ex, chat) for ex in examples]
    outs = engine.generate(prompts, greedy=True, batch_size=batch_size, images=[example_images(ex) for ex in examples])
    texts = [o.text for o in outs]
    correct = [task.is_correct(t, ex) for t, ex in zip(texts, examples)]
    out = {"accuracy": sum(correct) / len(correct),
           "eval_completion_len": sum(len(o.token_ids) for o in outs) / len(outs)}
    if rewards is not None and len(rewards[0]):
        from trainfit.tasks import score

        reward_prompts = [ex.prompt if ex.prompt is not None else ex.messages for ex in examples]
        total, per_fn = score(rewards[0], rewards[1], reward_prompts, texts, examples)
        out["eval_reward"] = total.mean().item()
        out.update({f"eval_reward/{name}": r.mean().item() for name, r in per_fn.items()})
    return out


def buffer_images(buffer, to_tensors: bool):
    """A rollout buffer (StepBatch) with its samples' images as uint8 tensors [H, W, 3] (to_tensors:
    what a weights-only checkpoint can hold) or back to RGB PIL images; a copy where anything changes,
    so the live buffer keeps its images."""
    import dataclasses

    if buffer is None or not any(s.get("images") for s in buffer.samples):
        return buffer

    def conv(im):
        if to_tensors:
            import numpy as np

            return torch.from_numpy(np.asarray(im.convert("RGB"), dtype=np.uint8).copy())
        from PIL import Image

        return Image.fromarray(im.numpy())

    samples = [dict(s, images=[conv(im) for im in s["images"]]) if s.get("images") else s for s in buffer.samples]
    return dataclasses.replace(buffer, samples=samples)
