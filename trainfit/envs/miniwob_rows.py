"""Expert trajectories on MiniWoB++ as SFT rows: the chat a correct agent has with the service.

    rows = expert_rows(service, "click-button", seeds=range(64), image_dir=out / "images")
    trainfit env expert miniwob --tasks click-button,enter-text --seeds 0-63 --out data/cua_sft

Each row is one successful episode in data/image_chat.py's `parts` convention: the service's opening user
message (instructions, utterance, screenshot), then the expert's actions as assistant turns, each followed
by the screenshot it produced; screenshots are PNG files named by their sha256, under `image_dir`, with
paths relative to the JSONL's folder. The episode is played through the service's own logic (the same
parsing, browser and reward a policy gets), and only episodes MiniWoB rewarded 1 become rows.
Training seeds only (split "train"); evaluation seeds are never written.
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Iterable, Optional


def _save(part: dict, image_dir: Path, rel_to: Path) -> dict:
    raw = base64.b64decode(part["image"])
    path = image_dir / f"{hashlib.sha256(raw).hexdigest()[:32]}.png"
    if not path.exists():
        path.write_bytes(raw)
    return {"type": "image", "image": str(path.relative_to(rel_to))}


def _stored(messages: list[dict], image_dir: Path, rel_to: Path) -> list[dict]:
    out = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = [_save(p, image_dir, rel_to) if p.get("type") == "image" else p for p in content]
        out.append({"role": m["role"], "content": content})
    return out


def expert_episode(service, task: str, seed: int, image_dir: Path, rel_to: Path,
                   max_steps: int = 8) -> Optional[dict]:
    """One expert episode as a row, or None when the task has no expert or the episode was not a success."""
    opened = service.reset({"miniwob_task": task, "seed": seed, "split": "train"})
    eid = opened["episode_id"]
    messages = _stored(opened["observation"], image_dir, rel_to)
    reward, ok = 0.0, False
    try:
        for step in range(1, max_steps + 1):
            action = service.expert({"episode_id": eid})["action"]
            if action is None:
                return None
            code, reply = service.step({"episode_id": eid, "step": step, "action": action})
            if code != 200:
                return None
            messages.append({"role": "assistant", "content": action})
            reward += reply["reward"]
            if reply["done"]:
                ok = reply["info"].get("success", False)
                break
            messages.extend(_stored(reply["observation"], image_dir, rel_to))
    finally:
        service.close({"episode_id": eid})
    if not ok:
        return None
    return {"messages": messages, "miniwob_task": task, "seed": seed, "reward": reward}


def write_expert_rows(service, tasks: Iterable[str], seeds: Iterable[int], out: Path) -> tuple[Path, int, int]:
    """rows.jsonl and images/ under `out`: (the JSONL, rows written, episodes tried)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "images").mkdir(exist_ok=True)
    path, written, tried = out / "rows.jsonl", 0, 0
    tmp = path.with_suffix(".jsonl.tmp")
    with tmp.open("w") as f:
        for task in tasks:
            for seed in seeds:
                tried += 1
                row = expert_episode(service, task, seed, out / "images", out)
                if row is not None:
                    f.write(json.dumps(row) + "\n")
                    written += 1
    tmp.replace(path)   # a finished file or none: never a half-written dataset
    return path, written, tried


def parse_seeds(text: str) -> list[int]:
    """"0-63" or "1,5,9" or "0-9,20" -> seeds (ValueError with the expected form)."""
    seeds: list[int] = []
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"--seeds {text!r}: write ranges and numbers, e.g. 0-63 or 0-9,20")
        seeds.extend(range(int(lo), int(hi) + 1) if sep else [int(lo)])
    return seeds
