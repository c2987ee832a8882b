"""Examples whose prompts carry images (tasks/shapes.py's ImageExample) encoded for the policy, and the
image inputs of the trainer's log-prob forwards.

A sample (models/logprobs.py) whose prompt holds images has `images`: the RGB PIL images in the order
their image tokens appear in `input_ids` (each as `<|vision_start|>` + n x `<|image_pad|>` +
`<|vision_end|>`, n from the image size). Image tokens sit in the prompt (loss_mask 0), so only the
policy's text tokens carry loss.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

from trainfit.config import ConfigError
from trainfit.data.image_chat import expand_images, fit_length
from trainfit.data.text import IGNORE, encode_example, encode_prompt
from trainfit.models.images import VisionProcessor, is_vlm_config, load_processor

PLACEHOLDER = "<image>"


def example_images(ex) -> list:
    """The images an example's prompt carries ([] for text examples)."""
    return list(getattr(ex, "images", None) or [])


def policy_processor(cfg, model, tokenizer, task=None) -> Optional[VisionProcessor]:
    """The VisionProcessor of a vision-language policy, else None (SFT and GRPO stages).

    A task whose prompts carry images given to a text model is a ConfigError: the images would be
    dropped and their `<image>` placeholders read as text, training on something else than asked."""
    from trainfit.models.policy import unwrap  # transformers: the planner reads examples without it

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
    import torch

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
            import torch

            return torch.from_numpy(np.asarray(im.convert("RGB"), dtype=np.uint8).copy())
        from PIL import Image

        return Image.fromarray(im.numpy())

    samples = [dict(s, images=[conv(im) for im in s["images"]]) if s.get("images") else s for s in buffer.samples]
    return dataclasses.replace(buffer, samples=samples)
