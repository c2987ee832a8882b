"""Shared helpers of the vision-language tests (no tests here): a generated image dataset and configs
on preset:vlm-tiny."""

from __future__ import annotations

import json
import random
from pathlib import Path

COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220)}
SIZES = [(64, 64), (96, 64), (130, 90)]   # (width, height): 4, 6 and 12 image tokens on vlm-tiny


def write_dataset(folder: Path, n: int = 8, seed: int = 0, sizes=SIZES) -> Path:
    """`n` chat rows "What colour is the square?" -> colour, images under folder/img, alternating the
    two conventions (image parts; `images` + <image>). Returns the JSONL path."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    (folder / "img").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        colour = rng.choice(sorted(COLOURS))
        w, h = sizes[i % len(sizes)]
        im = Image.new("RGB", (w, h), (255, 255, 255))
        ImageDraw.Draw(im).rectangle([8, 8, w - 8, h - 8], fill=COLOURS[colour])
        im.save(folder / "img" / f"{i}.png")
        rows.append(row(f"img/{i}.png", "What colour is the square?", colour, parts=i % 2 == 0))
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def row(image: str, question: str, answer: str, parts: bool = True) -> dict:
    if parts:
        user = [{"type": "image", "image": image}, {"type": "text", "text": question}]
        return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]}
    return {"images": [image], "messages": [{"role": "user", "content": "<image>" + question},
                                            {"role": "assistant", "content": answer}]}


def vlm_config(tmp_path: Path, data: Path, **overrides):
    """A validated SFT Config on preset:vlm-tiny, CPU pinned; `overrides` are dotted keys."""
    from trainfit.config import load_config

    base = {"stage": "sft", "run_dir": str(tmp_path / "run"), "model": {"name": "preset:vlm-tiny"},
            "data": {"path": str(data), "max_seq_length": 96, "eval_fraction": 0.0},
            "train": {"global_batch_size": 4, "micro_batch_size": 2, "max_steps": 3, "lr": 1e-2, "device": "cpu"},
            "logging": {"tensorboard": False, "progress": False, "plot": False}}
    return load_config(None, [f"{k}={v}" for k, v in overrides.items()], base=base)
