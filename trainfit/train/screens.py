"""The screenshots of the episodes a step keeps (logging.save_transcripts), written beside their
transcripts so the episode replay (train/replay.py) can show them.

A transcript records each image by the sha256 of its bytes (`image_hashes`), never the bytes, and an
episode holds only the screenshots still in its context (rollout.max_images_per_episode drops the
oldest). So the environments of the kept episodes are wrapped while the step's episodes run: every
screenshot they show is held by its hash, and after the step the ones the kept transcripts name are
written to `<stage_dir>/screens/<sha256[:32]>.png`. A screenshot larger than MAX_SIDE is kept scaled
down (the replay draws clicks in the policy's pixel coordinates from the size in a `.json` beside it),
which bounds what a step holds in memory and on disk.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from trainfit.data.image_parts import IMAGES_KEY
from trainfit.envs.base import StepResult
from trainfit.train.replay import SCREENS, screen_file

__all__ = ["SCREENS", "ScreenKeeper"]   # SCREENS: where save() writes and the replay reads

MAX_SIDE = 1280


class ScreenKeeper:
    """Wraps an environment factory; the environments reset with one of `examples` (by identity: pass
    objects no other episode resets with) keep their screenshots."""

    def __init__(self, make_env: Callable[[], Any], examples: Sequence[Any]):
        self._make = make_env
        self._wanted = {id(e) for e in examples}
        self._lock = threading.Lock()   # environments reset and step in a thread pool
        self.images: dict[str, tuple[Any, tuple[int, int]]] = {}   # sha256 -> (image, size the policy saw)

    def make_env(self) -> "_Keeping":
        return _Keeping(self._make(), self)

    def wants(self, example: Any) -> bool:
        return id(example) in self._wanted

    def take(self, messages: Iterable[dict]) -> None:
        for m in messages or []:
            for sha, im in zip(m.get("image_hashes") or [], m.get(IMAGES_KEY) or []):
                if sha in self.images:
                    continue
                size = im.size
                if max(size) > MAX_SIDE:
                    im = im.copy()
                    im.thumbnail((MAX_SIDE, MAX_SIDE))
                with self._lock:
                    self.images[sha] = (im, size)

    def save(self, records: Iterable[dict], folder: Path) -> int:
        """Write the screenshots `records` (transcript lines) name; returns how many files were written."""
        written = 0
        for rec in records:
            for m in rec.get("messages", []):
                for sha in m.get("image_hashes") or []:
                    path = screen_file(folder, sha)
                    if sha not in self.images or path.exists():
                        continue
                    im, size = self.images[sha]
                    folder.mkdir(parents=True, exist_ok=True)
                    im.save(path, format="PNG")
                    if im.size != size:
                        path.with_suffix(".json").write_text(json.dumps({"size": list(size)}))
                    written += 1
        return written


class _Keeping:
    """An environment that passes everything through and shows its screenshots to the keeper."""

    def __init__(self, env: Any, keeper: ScreenKeeper):
        self._env, self._keeper, self._keep = env, keeper, False

    def reset(self, example):
        messages = self._env.reset(example)
        self._keep = self._keeper.wants(example)
        if self._keep and isinstance(messages, list):
            self._keeper.take(messages)
        return messages

    def step(self, action):
        res = self._env.step(action)
        if self._keep and isinstance(res, StepResult) and isinstance(res.observation, list):
            self._keeper.take(res.observation)
        return res

    def __getattr__(self, name: str):   # tools, close, finish...: the environment's own
        return getattr(self._env, name)
