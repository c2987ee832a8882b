"""Images: reading them with Pillow, counting their tokens, and the processor that turns them into
pixel patches.

Token count of one image (Qwen-VL family): the processor resizes the image to h' x w', multiples of
factor = patch x merge, with h' x w' inside [min_pixels, max_pixels] and the aspect ratio kept as
closely as possible (transformers' `smart_resize`); the vision tower cuts it into (h'/patch) x
(w'/patch) patches of patch x patch pixels (x temporal_patch_size frames, a still image repeated),
and the merger joins merge x merge neighbours into one token: (h' x w') / factor^2 tokens.
`image_tokens` is that arithmetic without transformers, so the planner can count from the settings.
"""

from __future__ import annotations

import contextlib

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from trainfit.config import ConfigError
from trainfit.models.presets import parse_preset
from trainfit.models.vlm_preset import is_vlm_preset, vlm_image_processor


@dataclass(frozen=True)
class ImageSettings:
    """What fixes an image's token count: the processor's patch numbers and pixel limits."""

    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


def resized(height: int, width: int, s: ImageSettings) -> tuple[int, int]:
    """(h', w') the processor resizes an image to (Qwen-VL's smart_resize, same rounding)."""
    if min(height, width) < 1 or max(height, width) / min(height, width) > 200:
        raise ConfigError(f"an image of {width} x {height} pixels cannot be processed: Qwen-VL processors "
                          "need both sides >= 1 and an aspect ratio below 200; crop or pad the image.")
    f = s.factor
    h, w = round(height / f) * f, round(width / f) * f
    if h * w > s.max_pixels:
        beta = math.sqrt(height * width / s.max_pixels)
        h, w = max(f, math.floor(height / beta / f) * f), max(f, math.floor(width / beta / f) * f)
    elif h * w < s.min_pixels:
        beta = math.sqrt(s.min_pixels / (height * width))
        h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
    return h, w


def image_tokens(height: int, width: int, s: ImageSettings) -> int:
    """Tokens one image of height x width pixels takes in the language model's sequence."""
    h, w = resized(height, width, s)
    return (h // s.factor) * (w // s.factor)


def image_patches(height: int, width: int, s: ImageSettings) -> int:
    """Patches the vision tower sees for one image (before merging): tokens x merge^2."""
    return image_tokens(height, width, s) * s.merge_size ** 2


@contextlib.contextmanager
def _opened(path: Path, key: str):
    """The image at `path` opened by Pillow; a missing or unreadable file is a ConfigError naming it."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            yield im
    except FileNotFoundError:
        raise ConfigError(f"{key}: image {str(path)!r} does not exist; image paths in the JSONL are read "
                          "relative to the JSONL file's folder (or give absolute paths).") from None
    except (UnidentifiedImageError, OSError) as e:
        raise ConfigError(f"{key}: image {str(path)!r} cannot be read by Pillow ({e}); convert it to PNG or "
                          "JPEG.") from None


def load_image(path: Path, key: str = "data.path"):
    """The image at `path` as an RGB PIL image (what the processors take)."""
    with _opened(path, key) as im:
        return im.convert("RGB")


def image_size(path: Path, key: str = "data.path") -> tuple[int, int]:
    """(height, width) from the image header only (no pixel decoding)."""
    with _opened(path, key) as im:
        w, h = im.size
    return h, w


@dataclass
class VisionProcessor:
    """An image processor paired with the tokenizer: what transformers' Qwen-VL processors do for
    images, kept here so it works without torchvision (their video processors need it)."""

    image_processor: Any
    tokenizer: Any
    image_token: str = "<|image_pad|>"
    start_token: str = "<|vision_start|>"
    end_token: str = "<|vision_end|>"
    fixed: Optional[ImageSettings] = None   # counting only (the planner): settings without a processor

    @property
    def image_token_id(self) -> int:
        return self.tokenizer.convert_tokens_to_ids(self.image_token)

    @property
    def placeholder(self) -> str:
        """The text one image stands as in a rendered chat, before its pad token is repeated."""
        return self.start_token + self.image_token + self.end_token

    def settings(self) -> ImageSettings:
        if self.fixed is not None:
            return self.fixed
        ip = self.image_processor
        size = dict(getattr(ip, "size", None) or {})
        lo = size.get("shortest_edge") or getattr(ip, "min_pixels", None)
        hi = size.get("longest_edge") or getattr(ip, "max_pixels", None)
        if lo is None or hi is None or not hasattr(ip, "merge_size"):
            raise ConfigError(f"the image processor {type(ip).__name__} has no Qwen-VL pixel limits "
                              "(size.shortest_edge / longest_edge, merge_size); trainfit counts image tokens "
                              "for the Qwen-VL family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL).")
        return ImageSettings(int(ip.patch_size), int(ip.merge_size), int(getattr(ip, "temporal_patch_size", 1)),
                             int(lo), int(hi))

    def tokens_for(self, height: int, width: int) -> int:
        return image_tokens(height, width, self.settings())

    def pixels(self, images: list) -> dict:
        """pixel_values [sum of patches, C x temporal x patch^2] and image_grid_thw [images, 3]."""
        out = self.image_processor(images=images, return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def apply_pixel_limits(image_processor, min_pixels: Optional[int], max_pixels: Optional[int]) -> None:
    """model.min_pixels / max_pixels into the processor's size (Qwen-VL: shortest_edge / longest_edge
    hold pixel counts, not edges)."""
    if min_pixels is None and max_pixels is None:
        return
    size = dict(getattr(image_processor, "size", None) or {})
    if min_pixels is not None:
        size["shortest_edge"] = int(min_pixels)
    if max_pixels is not None:
        size["longest_edge"] = int(max_pixels)
    image_processor.size = size
    for attr, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)):
        if v is not None and hasattr(image_processor, attr):
            setattr(image_processor, attr, int(v))


def load_processor(mc, tokenizer) -> VisionProcessor:
    """The VisionProcessor of model config `mc` with the trainer's `tokenizer`: the preset's own image
    processor, or the model's through `AutoProcessor` (its image processor), falling back to
    `AutoImageProcessor` where the full processor cannot be built (no torchvision); then
    model.min_pixels / max_pixels applied."""
    key = parse_preset(mc.name)
    if key and is_vlm_preset(key):
        ip = vlm_image_processor(key)
    else:
        ip = _auto_image_processor(mc)
    apply_pixel_limits(ip, mc.min_pixels, mc.max_pixels)
    return VisionProcessor(ip, tokenizer,
                           image_token=getattr(tokenizer, "image_token", None) or "<|image_pad|>",
                           start_token=getattr(tokenizer, "vision_start_token", None) or "<|vision_start|>",
                           end_token=getattr(tokenizer, "vision_end_token", None) or "<|vision_end|>")


def _auto_image_processor(mc):
    from transformers import AutoImageProcessor, AutoProcessor

    kw = dict(revision=mc.revision, trust_remote_code=mc.trust_remote_code)
    try:
        proc = AutoProcessor.from_pretrained(mc.name, **kw)
        ip = getattr(proc, "image_processor", None)
        if ip is not None:
            return ip
    except (ImportError, OSError, ValueError, TypeError, AttributeError):
        pass  # e.g. Qwen-VL processors' video half needs torchvision: the image half is all we use
    try:
        return AutoImageProcessor.from_pretrained(mc.name, **kw)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.name={mc.name!r} is a vision-language model but no image processor loads from "
                          f"it ({type(e).__name__}: {str(e)[:160]}); give a model directory with "
                          "preprocessor_config.json.") from None


def is_vlm_config(config) -> bool:
    """Whether a transformers config (object or dict) describes an image-text-to-text model."""
    if isinstance(config, dict):
        return isinstance(config.get("vision_config"), dict)
    return getattr(config, "vision_config", None) is not None
