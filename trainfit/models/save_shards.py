"""Weights written as transformers' `save_pretrained(max_shard_size=...)` writes them, from tensors that
arrive one at a time (a sharded model's final save gathers each tensor only when its file is written).

    weights = LazyWeights(shapes, fetch)      # names and sizes known up front, tensors on demand
    files = write_shards(out_dir, weights)    # model.safetensors, or model-0000i-of-0000N.safetensors
                                              # and model.safetensors.index.json

The files are planned before any tensor is read (greedy in the model's order, as huggingface_hub's
`split_torch_state_dict_into_shards`: a tensor that would push a shard past the bound starts the next one;
a tensor bigger than the bound is a shard of its own), so the writer holds one shard at most. Each file
is written under a temporary name, synced, then renamed: a failed write leaves no file that looks whole.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Optional

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

# transformers' index file and the size bound of its classic default ("5GB"): a shard is what the
# writer holds in RAM at once, so a bound well under a host's memory.
INDEX_NAME = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 10 ** 9


class LazyWeights:
    """A model's tensors by name, in its order, each produced by `fetch(name)` when read (for a sharded
    model: gathered from the ranks then). `shapes`: (name, element count, bytes per element) of every
    tensor, known without reading one. Counts what was read, so a caller can say (and a test check) what
    a save gathered."""

    def __init__(self, shapes: list[tuple[str, int, int]], fetch: Callable[[str], torch.Tensor]):
        self.shapes, self._fetch = shapes, fetch
        self._bytes = {n: numel * size for n, numel, size in shapes}
        self.read: list[str] = []

    @classmethod
    def of(cls, state: "dict[str, torch.Tensor] | LazyWeights") -> "LazyWeights":
        """`state` itself, or a dict of tensors in memory read through this interface."""
        if isinstance(state, LazyWeights):
            return state
        return cls([(k, v.numel(), v.element_size()) for k, v in state.items()], state.__getitem__)

    @property
    def sizes(self) -> list[tuple[str, int]]:
        return list(self._bytes.items())

    @property
    def numel(self) -> int:
        return sum(n for _, n, _ in self.shapes)

    def keys(self) -> list[str]:
        return list(self._bytes)

    def __contains__(self, name: str) -> bool:
        return name in self._bytes

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._bytes:
            raise KeyError(name)
        self.read.append(name)
        return self._fetch(name)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.keys():
            yield name, self[name]

    def subset(self, keep: Callable[[str], bool], rename: Callable[[str], str] = lambda n: n) -> "LazyWeights":
        """The tensors whose names `keep` accepts, under `rename`d names, read through this one (counted here)."""
        names = {rename(n): n for n in self._bytes if keep(n)}
        shapes = {n: (numel, size) for n, numel, size in self.shapes}
        return LazyWeights([(new, *shapes[old]) for new, old in names.items()], lambda n: self[names[n]])

    def read_bytes(self) -> int:
        return sum(self._bytes[n] for n in self.read)


def plan_shards(sizes: list[tuple[str, int]], max_bytes: int = MAX_SHARD_BYTES) -> list[list[str]]:
    """The tensor names of each file, in order."""
    shards: list[list[str]] = []
    used = 0
    for name, n in sizes:
        if not shards or (used + n > max_bytes and shards[-1]):
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += n
    return shards


def shard_file_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def write_shards(out_dir: Path, weights: LazyWeights, max_bytes: int = MAX_SHARD_BYTES) -> list[Path]:
    """Write `weights` into safetensors files of at most `max_bytes` each (one larger tensor aside), with
    transformers' index when there are several; returns the files written. Stale shards of an earlier save
    are removed, as save_pretrained does."""
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = plan_shards(weights.sizes, max_bytes)
    names = shard_file_names(len(plan))
    for old in out_dir.glob("model*.safetensors*"):
        if old.name not in names:
            old.unlink()
    written = []
    for file, shard in zip(names, plan):
        written.append(_write_file(out_dir / file, {n: weights[n] for n in shard}))
    if len(plan) > 1:
        index = {"metadata": {"total_parameters": weights.numel, "total_size": sum(n for _, n in weights.sizes)},
                 "weight_map": {n: file for file, shard in zip(names, plan) for n in shard}}
        written.append(_write_file(out_dir / INDEX_NAME, json.dumps(index, indent=2, sort_keys=True) + "\n"))
    return written


def _write_file(path: Path, content) -> Path:
    """A whole file or none: written as `<name>.tmp`, synced, renamed (I/O errors raised as OSError)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        if isinstance(content, str):
            tmp.write_text(content)
        else:
            save_safetensors(content, tmp, metadata={"format": "pt"})
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    return path


def save_safetensors(state: dict, path: Path, metadata: Optional[dict] = None) -> None:
    """safetensors' save_file; its I/O errors (a Rust error type, the errno in its text) raised as the OSError
    they are, so a full disk reads the same whichever library was writing."""
    try:
        save_file({k: v.contiguous() for k, v in state.items()}, str(path), metadata=metadata)
    except SafetensorError as e:
        m = re.search(r"I/O error: (.*) \(os error (\d+)\)", str(e))
        if m is None:
            raise
        raise OSError(int(m.group(2)), m.group(1), str(path)) from None
