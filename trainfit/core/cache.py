"""On-disk cache of the planner: architecture facts and activation traces, as small JSON files.

Location: `$TRAINFIT_CACHE` when set, else `~/.cache/trainfit`. Entries are keyed by a hash of
everything that changes their content (the architecture's config, trace options, CACHE_VERSION), so
a stale entry is never read; deleting the folder is always safe.

Reading a warm entry imports neither torch nor transformers, so a repeated plan costs about a second
of CPU on a 2-core machine, mostly Python, the config schema and the hub lookup (bench/cli_latency.py;
tests/test_cli_imports.py checks that nothing heavy is imported).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Optional

# Bump when the meaning of a cached figure changes (new trace quantities, different fit, traced code
# such as trainfit.algos changed).
CACHE_VERSION = 6


def cache_dir(kind: str) -> Path:
    root = os.environ.get("TRAINFIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "trainfit")
    return Path(root) / kind


def stable_hash(obj: Any) -> str:
    """sha1 of a JSON rendering with sorted keys (dict order and whitespace do not matter)."""
    text = json.dumps(obj, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha1(f"{CACHE_VERSION}:{text}".encode()).hexdigest()[:20]


@functools.lru_cache(maxsize=None)
def package_version(name: str) -> str:
    """The installed version of `name` (for keys of entries a package builds), read from its metadata
    without importing it; "" when it is not installed."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return ""


def read(kind: str, key: str) -> Optional[dict]:
    path = cache_dir(kind) / f"{key}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write(kind: str, key: str, value: dict) -> None:
    """Atomic write (temp file + rename) so concurrent plans never read half a file."""
    folder = cache_dir(kind)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(value, f)
        os.replace(tmp, folder / f"{key}.json")
    except OSError:
        pass  # a read-only home is not an error: the plan is just not cached
