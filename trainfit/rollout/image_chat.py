"""Images over OpenAI-compatible chat: what the `openai` engine sends for a prompt with images, and what
`trainfit serve` makes of image content parts.

The engine holds token ids (the trainer's exact prompt, images as `<|vision_start|>` + pads +
`<|vision_end|>`), but OpenAI servers take images only in /v1/chat/completions content parts. So a
prompt with images is sent as ONE user message whose parts are the prompt's text between the images
(decoded with its special tokens) and `{"type": "image_url", "image_url": {"url": "data:image/png;
base64,..."}}` for each image, with the request's `chat_template` = VERBATIM_TEMPLATE and
`add_generation_prompt: false` (vLLM's chat extras, honoured by `trainfit serve` too): the server
renders the text as given and an image as its one-pad placeholder, which its processor expands to the
image's tokens, so it sees the trainer's prompt (up to the tokenizer's decode/encode round trip).
"""

from __future__ import annotations

import base64
import io

from trainfit.core.errors import EnvError
from trainfit.data.image_parts import IMAGES_KEY, decode_observation, parts_problem

# Text parts verbatim, each image as the Qwen-VL placeholder; string contents verbatim too.
VERBATIM_TEMPLATE = (
    "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'text' %}{{ p['text'] }}"
    "{% else %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}{% endfor %}{% endif %}{% endfor %}")


def png_data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_prompt_parts(tokenizer, ids: list[int], images: list, start: str = "<|vision_start|>",
                       end: str = "<|vision_end|>") -> list[dict]:
    """OpenAI content parts of a token prompt with images: text between the image blocks (each block
    = start marker .. end marker) and one image_url part per image, in order."""
    s_id, e_id = tokenizer.convert_tokens_to_ids(start), tokenizer.convert_tokens_to_ids(end)
    parts, text, k, i = [], [], 0, 0
    while i < len(ids):
        if ids[i] == s_id and k < len(images):
            j = ids.index(e_id, i)                      # the block's end marker
            if text:
                parts.append({"type": "text", "text": tokenizer.decode(text, skip_special_tokens=False)})
                text = []
            parts.append({"type": "image_url", "image_url": {"url": png_data_url(images[k])}})
            k, i = k + 1, j + 1
            continue
        text.append(ids[i])
        i += 1
    if text:
        parts.append({"type": "text", "text": tokenizer.decode(text, skip_special_tokens=False)})
    if k != len(images):
        raise ValueError(f"{len(images)} images for a prompt with {k} image blocks")
    return parts


def has_image_parts(messages: list[dict]) -> bool:
    return any(isinstance(m.get("content"), list) and any(isinstance(p, dict) and p.get("type") in ("image", "image_url")
                                                          for p in m["content"]) for m in messages)


def chat_images(messages: list[dict], proc) -> tuple[list[dict], list]:
    """Request messages with image parts -> (messages with string content, each image as the
    processor's one-pad placeholder; the decoded RGB images in order). Raises ValueError naming a bad
    part."""
    for i, m in enumerate(messages):
        if isinstance(m.get("content"), list):
            bad = parts_problem(m["content"])
            if bad:
                raise ValueError(f"messages[{i}]: {bad}")
    try:
        decoded = decode_observation(messages, "the request")
    except EnvError as e:
        raise ValueError(str(e)) from None
    images = [im for m in decoded for im in m.get(IMAGES_KEY) or []]
    out = [{"role": m["role"], "content": m["content"].replace("<image>", proc.placeholder)
            if m.get(IMAGES_KEY) else m["content"]} for m in decoded]
    return out, images
