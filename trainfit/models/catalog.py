"""The architecture catalog: config.json of well-known models (models/architectures/*.json), so a model can
be planned without its files, under any of its names."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Optional

CATALOG_DIR = Path(__file__).parent / "architectures"
# Name suffixes that never change the architecture (instruct/chat/base variants share a config).
_VARIANT_SUFFIXES = ("-instruct", "-chat", "-base", "-it")


@functools.lru_cache(maxsize=1)
def catalog_entries() -> dict[str, dict]:
    """Catalog file stem -> entry (names, published_params, source, note, config)."""
    out = {}
    for path in sorted(CATALOG_DIR.glob("*.json")):
        entry = json.loads(path.read_text())
        if "names" in entry:
            out[path.stem] = entry
    return out


def _norm(name: str) -> str:
    return name.strip().lower().rstrip("/")


@functools.lru_cache(maxsize=1)
def _catalog_index() -> dict[str, str]:
    # Every alias is reachable with or without its organisation prefix.
    index: dict[str, str] = {}
    for stem, entry in catalog_entries().items():
        index[stem] = stem
        for alias in entry["names"]:
            index[_norm(alias)] = stem
            index[_norm(alias).split("/")[-1]] = stem
    return index


def catalog_lookup(name: str) -> Optional[str]:
    """Catalog stem for a model name (`Qwen/Qwen3-8B`, `qwen3-8b`, `Qwen3-8B-Instruct`...), else None."""
    index = _catalog_index()
    key = _norm(name)
    for cand in (key, key.split("/")[-1]):
        if cand in index:
            return index[cand]
        for suffix in _VARIANT_SUFFIXES:
            if cand.endswith(suffix) and cand[: -len(suffix)] in index:
                return index[cand[: -len(suffix)]]
    return None


def catalog_names() -> list[str]:
    return [entry["names"][0] for entry in catalog_entries().values()]
