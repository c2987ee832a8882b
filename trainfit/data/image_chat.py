"""Chat rows and captions with images: encoding with image tokens and loss masks, and batching.

Two conventions name a row's images (both common in the wild):
  parts        {"messages": [{"role": "user", "content": [{"type": "image", "image": "img/a.png"},
                                                         {"type": "text", "text": "What colour?"}]},
                             {"role": "assistant", "content": "red"}]}
  placeholders {"images": ["img/a.png"], "messages": [{"role": "user", "content": "<image>What colour?"},
                                                     {"role": "assistant", "content": "red"}]}
Continued pretraining on image-caption pairs: {"image": "img/a.png", "text": "a red square"} (or
`images` + `<image>` in `text`): loss on the caption, the image first.
Relative image paths are read relative to the JSONL file's folder (data.load_records marks it).

An image becomes processor.placeholder (`<|vision_start|><|image_pad|><|vision_end|>`) in the rendered
chat, and after tokenizing its single pad token is repeated to the image's token count (images.py),
so the chat template and the assistant-token mask are the text model's. Image tokens never carry
loss. A row longer than data.max_seq_length is cut only after its last image (as text rows are cut);
a row whose images do not fit is a ConfigError naming the row and the fixes, never a cut image.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from trainfit.config.stages import stage_spec
from trainfit.config import ConfigError
from trainfit.data.text import IGNORE, SUFFIXES, _read_file, collate, encode_messages
from trainfit.models.images import VisionProcessor, image_size, load_image

if TYPE_CHECKING:  # only annotations: the planner reads image rows without torch
    import torch

PLACEHOLDER = "<image>"
BASE_KEY = "_base_dir"   # set by the loader: the folder relative image paths are read from


def has_images(record: dict) -> bool:
    """Whether a record carries images in either convention (or is an image-caption pair)."""
    if record.get("images") or record.get("image"):
        return True
    for m in record.get("messages") or []:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(_is_image_part(p) for p in content):
            return True
    return False


def _is_image_part(part) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image", "image_url")


def _part_path(part: dict):
    v = part.get("image") or part.get("path") or part.get("image_url")
    return v.get("url") if isinstance(v, dict) else v


def _resolve(path, record: dict, where: str) -> Path:
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{where}: an image entry is {path!r}; give a file path (relative to the JSONL).")
    p = Path(path)
    return p if p.is_absolute() else Path(record.get(BASE_KEY, ".")) / p


def flatten_messages(record: dict, proc: VisionProcessor, where: str) -> tuple[list[dict], list[Path]]:
    """Messages with string content (images as proc.placeholder) and the image paths in order."""
    listed = record.get("images") or []
    if isinstance(listed, str):
        listed = [listed]
    n_placeholders = sum(m["content"].count(PLACEHOLDER) for m in record["messages"]
                         if isinstance(m, dict) and isinstance(m.get("content"), str))
    if (listed or n_placeholders) and n_placeholders != len(listed):
        raise ConfigError(f"{where}: the row lists {len(listed)} images but its messages hold {n_placeholders} "
                          f"{PLACEHOLDER} placeholders; put one {PLACEHOLDER} where each image goes.")
    images: list[Path] = []
    out = []
    for i, m in enumerate(record["messages"]):
        if not isinstance(m, dict) or "role" not in m:
            raise ConfigError(f"{where}: messages[{i}] must be an object with `role` and `content`, got {m!r}.")
        content = m.get("content")
        if isinstance(content, list):
            text = []
            for part in content:
                if _is_image_part(part):
                    images.append(_resolve(_part_path(part), record, where))
                    text.append(proc.placeholder)
                elif isinstance(part, dict) and part.get("type") == "text":
                    text.append(str(part.get("text", "")))
                else:
                    raise ConfigError(f"{where}: messages[{i}] has a content part {part!r}; parts are "
                                      '{"type": "text", "text": ...} or {"type": "image", "image": "path.png"}.')
            content = "".join(text)
        elif isinstance(content, str) and PLACEHOLDER in content:
            for _ in range(content.count(PLACEHOLDER)):
                images.append(_resolve(listed[len(images)] if len(images) < len(listed) else None, record, where))
            content = content.replace(PLACEHOLDER, proc.placeholder)
        out.append({**m, "content": content})
    return out, images


def expand_images(ids: list[int], labels: list[int], counts: list[int], image_id: int, where: str
                  ) -> tuple[list[int], list[int]]:
    """Each image's single pad token repeated to its token count; image tokens get no loss."""
    found = sum(1 for t in ids if t == image_id)
    if found != len(counts):
        raise ConfigError(f"{where}: {len(counts)} images but {found} image tokens after tokenizing; the "
                          "text itself must not contain the image pad token.")
    out_ids, out_labels, k = [], [], 0
    for t, y in zip(ids, labels):
        if t == image_id:
            out_ids.extend([t] * counts[k])
            out_labels.extend([IGNORE] * counts[k])
            k += 1
        else:
            out_ids.append(t)
            out_labels.append(y)
    return out_ids, out_labels


def fit_length(ids: list[int], labels: list[int], image_id: int, max_len: int, where: str, n_images: int,
               image_tokens: int) -> dict:
    """Cut to max_len after the last image token, or a ConfigError when an image would be cut."""
    if len(ids) <= max_len:
        return {"input_ids": ids, "labels": labels, "truncated": False}
    last = max((i for i, t in enumerate(ids) if t == image_id), default=-1)
    if last >= max_len - 1:  # the cut would fall inside (or right at the end of) an image
        raise ConfigError(
            f"{where} is {len(ids)} tokens ({image_tokens} of them for its {n_images} image(s)), over "
            f"data.max_seq_length={max_len}, and cutting it would cut an image; raise data.max_seq_length to at "
            f"least {len(ids)}, lower model.max_pixels (fewer tokens per image), or drop the row.")
    return {"input_ids": ids[:max_len], "labels": labels[:max_len], "truncated": True}


def encode_vlm_messages(record: dict, tokenizer, proc: VisionProcessor, max_len: int, where: str = "a row") -> dict:
    """input_ids / labels (loss on assistant text) / images (paths) of one chat row with images."""
    messages, images = flatten_messages(record, proc, where)
    counts = [proc.tokens_for(*image_size(p, where)) for p in images]
    enc = encode_messages(tokenizer, messages, max_len=10 ** 9)
    ids, labels = expand_images(enc["input_ids"], enc["labels"], counts, proc.image_token_id, where)
    item = fit_length(ids, labels, proc.image_token_id, max_len, where, len(images), sum(counts))
    item.update(images=[str(p) for p in images], image_tokens=sum(counts))
    return item


def encode_caption(record: dict, tokenizer, proc: VisionProcessor, max_len: int, text_field: str = "text",
                   where: str = "a row") -> dict:
    """An image-caption pair for continued pretraining: the images, then the caption and eos; loss on
    the caption and eos."""
    text = record.get(text_field)
    if not isinstance(text, str):
        raise ConfigError(f"{where} has keys {sorted(k for k in record if k != BASE_KEY)} but captions are read "
                          f"from {text_field!r}; set data.text_field to the key holding the caption.")
    listed = record.get("images") or ([record["image"]] if record.get("image") else [])
    listed = [listed] if isinstance(listed, str) else list(listed)
    if PLACEHOLDER not in text:  # the caption follows its image(s)
        text = PLACEHOLDER * len(listed) + text
    if text.count(PLACEHOLDER) != len(listed):
        raise ConfigError(f"{where}: {len(listed)} images but {text.count(PLACEHOLDER)} {PLACEHOLDER} placeholders "
                          "in the text; put one placeholder where each image goes, or none (images first).")
    images = [_resolve(p, record, where) for p in listed]
    counts = [proc.tokens_for(*image_size(p, where)) for p in images]
    ids = list(tokenizer(text.replace(PLACEHOLDER, proc.placeholder), add_special_tokens=True)["input_ids"])
    ids.append(tokenizer.eos_token_id)
    specials = {tokenizer.convert_tokens_to_ids(t) for t in (proc.start_token, proc.end_token)}
    labels = [IGNORE if t in specials or t == proc.image_token_id else t for t in ids]
    ids, labels = expand_images(ids, labels, counts, proc.image_token_id, where)
    item = fit_length(ids, labels, proc.image_token_id, max_len, where, len(images), sum(counts))
    item.update(images=[str(p) for p in images], image_tokens=sum(counts))
    return item


def build_vlm_items(records: list[dict], tokenizer, proc: VisionProcessor, max_len: int, stage: str,
                    text_field: str = "text") -> tuple[list[dict], dict]:
    """Items of a dataset with images (SFT chat rows, or captions for stage pretrain), and counts."""
    items, stats = [], {"records": len(records), "items": 0, "truncated": 0, "images": 0, "image_tokens": 0,
                        "dropped_no_loss": 0}
    for i, r in enumerate(records):
        where = f"record {i}" + (f" of {r[BASE_KEY]}" if BASE_KEY in r else "")
        if isinstance(r.get("messages"), list):
            item = encode_vlm_messages(r, tokenizer, proc, max_len, where)
        elif stage_spec(stage).data == "text" or isinstance(r.get(text_field), str):
            item = encode_caption(r, tokenizer, proc, max_len, text_field, where)
        else:
            raise ConfigError(f"{where} has keys {sorted(k for k in r if k != BASE_KEY)}; rows with images are "
                              "chat rows (`messages`, with image parts or `images` + <image>) or image-caption pairs "
                              f"(`image` or `images`, and {text_field!r}).")
        if not any(t != IGNORE for t in item["labels"][1:]):
            stats["dropped_no_loss"] += 1
            continue
        stats["truncated"] += item["truncated"]
        stats["images"] += len(item["images"])
        stats["image_tokens"] += item["image_tokens"]
        items.append(item)
    stats["items"] = len(items)
    if not items:
        raise ConfigError(f"All {len(records)} records lost every loss token (no assistant text, or text cut by "
                          f"data.max_seq_length={max_len}); raise max_seq_length.")
    return items, stats


def collate_vlm(items: list[dict], pad_id: int, proc: VisionProcessor) -> dict[str, torch.Tensor]:
    """data.collate's input_ids / attention_mask / labels [B, T], plus for the micro-batch's images
    (rows in order, each row's images in order: the order the model fills image tokens in)
    pixel_values [patches, C x temporal x patch^2], image_grid_thw [images, 3] and
    mm_token_type_ids [B, T] (1 at image tokens; Qwen3-VL's M-RoPE needs it)."""
    batch = collate(items, pad_id)
    paths = [p for it in items for p in it.get("images", [])]   # file paths, or PIL images (task examples)
    if paths:
        batch.update(proc.pixels([load_image(Path(p)) if isinstance(p, (str, Path)) else p for p in paths]))
        batch["mm_token_type_ids"] = (batch["input_ids"] == proc.image_token_id).long()   # [B, T]
    return batch


def model_inputs(batch: dict) -> dict:
    """The image inputs of a collated batch, as keyword arguments of the model's forward."""
    return {k: batch[k] for k in ("pixel_values", "image_grid_thw", "mm_token_type_ids") if k in batch}


def mark_base_dirs(records: list[dict], path: str) -> list[dict]:
    """Records of `path` (a file, directory or glob) with BASE_KEY = the folder of the file each came
    from, re-read file by file, so relative image paths resolve next to their JSONL."""
    import glob as _glob


    p = Path(path)
    if any(c in path for c in "*?["):
        files = [Path(f) for f in sorted(_glob.glob(path, recursive=True)) if Path(f).is_file()]
    elif p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file())
    else:
        files = [p]
    files = [f for f in files if f.suffix.lower() in SUFFIXES and f.suffix.lower() != ".txt"]
    out = []
    for f in files:
        out.extend({**r, BASE_KEY: str(f.parent)} for r in _read_file(f, "data.path"))
    return out if len(out) == len(records) else records
