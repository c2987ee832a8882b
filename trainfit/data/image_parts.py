"""Environment observations with images (screenshots): decoding the HTTP protocol's image parts, their
tokens in an episode, and the per-episode image budget.

On the wire (envs/http.py) a message's `content` is a string or a list of parts:
    {"type": "text", "text": "..."}
    {"type": "image", "image": "<base64 PNG>"}             (JPEG, or a data: URL, are read as well)
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}   (OpenAI's form)
Decoded, a message has string `content` with one `<image>` per image where it stood, `image_hashes`
(sha256 of the decoded bytes: what transcripts record, never the bytes) and `IMAGES_KEY` holding the
RGB PIL images (stripped before a message is stored in a transcript).

Budget (`rollout.max_images_per_episode`, 0 = no limit): when an observation brings the episode past
it, the oldest images' tokens (`<|vision_start|>`, pads, `<|vision_end|>`) are removed from the
episode's sequence, oldest first, and `info.images_dropped` counts them. The policy turns that saw a
dropped image are first sealed with the context they were sampled in, so the trainer never scores a
turn under a context it did not see (envs/episodes.py: an episode then trains as several rows).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from typing import Optional

from trainfit.core.errors import EnvError

IMAGES_KEY = "_images"
PLACEHOLDER = "<image>"
# Limits on one image from an environment (a broken or hostile service must not exhaust the trainer's
# memory): 32 MiB of base64, and 8K UHD (7680 x 4320) pixels; the processor resizes to model.max_pixels.
MAX_IMAGE_B64_CHARS = 32 << 20
MAX_IMAGE_PIXELS = 7680 * 4320


def _env_error(msg: str) -> EnvError:
    return EnvError(msg)


def _decode(data: str, where: str):
    from PIL import Image, UnidentifiedImageError

    if data.startswith("data:"):
        data = data.split(",", 1)[-1]
    if len(data) > MAX_IMAGE_B64_CHARS:
        raise _env_error(f"{where}: an image part is {len(data)} base64 characters, over the limit of "
                         f"{MAX_IMAGE_B64_CHARS} (MAX_IMAGE_B64_CHARS in trainfit/data/image_parts.py); send "
                         "smaller screenshots (PNG of the screen, or JPEG).")
    try:
        raw = base64.b64decode(data, validate=True)
        with Image.open(io.BytesIO(raw)) as im:
            w, h = im.size
            if w * h > MAX_IMAGE_PIXELS:
                raise _env_error(f"{where}: an image of {w}x{h} pixels is over the limit of {MAX_IMAGE_PIXELS} "
                                 "pixels (7680x4320, MAX_IMAGE_PIXELS in trainfit/data/image_parts.py); send "
                                 "screenshots at most that large (the model sees them resized to model.max_pixels).")
            return im.convert("RGB"), hashlib.sha256(raw).hexdigest()
    except (binascii.Error, ValueError, UnidentifiedImageError, OSError, Image.DecompressionBombError) as e:
        raise _env_error(f"{where}: an image part is not base64 PNG/JPEG ({type(e).__name__}: {str(e)[:80]}); "
                       'send {"type": "image", "image": "<base64 PNG>"}.') from None


def parts_problem(content) -> Optional[str]:
    """Why a list `content` is not text / image parts, or None."""
    for j, p in enumerate(content):
        if not isinstance(p, dict):
            return f"content part {j} must be an object, got {p!r:.60}"
        t = p.get("type")
        if t == "text" and isinstance(p.get("text"), str):
            continue
        if t == "image" and isinstance(p.get("image"), str):
            continue
        if t == "image_url" and isinstance(p.get("image_url"), dict) and isinstance(p["image_url"].get("url"), str):
            continue
        return f'content part {j} must be {{"type": "text", "text": ...}} or {{"type": "image", "image": "<base64>"}}'
    return None


def decode_observation(messages: list[dict], where: str) -> list[dict]:
    """Messages whose content may be a list of parts -> string content with `<image>` placeholders,
    `image_hashes` and the decoded images under IMAGES_KEY. String-content messages pass through."""
    out = []
    for i, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            out.append(m)
            continue
        text, images, hashes = [], [], []
        for p in content:
            if p.get("type") == "text":
                text.append(p["text"])
                continue
            data = p["image"] if p.get("type") == "image" else p["image_url"]["url"]
            im, h = _decode(data, f"{where} message {i}")
            images.append(im)
            hashes.append(h)
            text.append(PLACEHOLDER)
        out.append({**m, "content": "".join(text), "image_hashes": hashes, IMAGES_KEY: images})
    return out


def message_images(messages: list[dict]) -> list:
    return [im for m in messages for im in m.get(IMAGES_KEY) or []]


def public(m: dict) -> dict:
    """A message as a transcript stores it (hashes, no image bytes)."""
    return {k: v for k, v in m.items() if k != IMAGES_KEY}


def with_vision_tokens(messages: list[dict], proc) -> list[dict]:
    """Messages for the chat template: each `<image>` as the processor's one-pad placeholder."""
    return [dict(m, content=m["content"].replace(PLACEHOLDER, proc.placeholder)) if m.get(IMAGES_KEY) else m
            for m in messages]


def expand(ids: list[int], images: list, proc) -> list[int]:
    """Each image's single pad token repeated to its token count (images in order)."""
    if not images:
        return ids
    out, k = [], 0
    for t in ids:
        if t == proc.image_token_id and k < len(images):
            out.extend([t] * proc.tokens_for(images[k].height, images[k].width))
            k += 1
        else:
            out.append(t)
    if k != len(images):
        raise _env_error(f"{len(images)} images in an observation but {k} image tokens after the chat template.")
    return out


def oldest_image_span(ids: list[int], proc) -> Optional[tuple[int, int]]:
    """[start, end) of the first image's tokens (start, pads, end markers) in `ids`, or None."""
    pad = proc.image_token_id
    try:
        first = ids.index(pad)
    except ValueError:
        return None
    last = first
    while last + 1 < len(ids) and ids[last + 1] == pad:
        last += 1
    start_id = proc.tokenizer.convert_tokens_to_ids(proc.start_token)
    end_id = proc.tokenizer.convert_tokens_to_ids(proc.end_token)
    lo = first - 1 if first > 0 and ids[first - 1] == start_id else first
    hi = last + 2 if last + 1 < len(ids) and ids[last + 1] == end_id else last + 1
    return lo, hi
