"""Where a model named in a config is: a preset, a local path, a .gguf file, a hub id in the local
Hugging Face cache, or a hub id the hub has; else one error naming every place looked at.

    found = resolve_model("Qwen/Qwen3-0.6B")          # Found(kind="cache", where=<snapshot dir>)
    resolve_model("nobody/nothing-1b")                 # ConfigError: the path tried, the cache dir, the hub

The hub is asked at most once per repo and process, with one request and a short timeout (no
retries), and only when the cache lacks the repo and neither HF_HUB_OFFLINE nor TRAINFIT_OFFLINE is
set: without a network the answer comes in well under a second (a failed name lookup), where
transformers' loaders retry each file for about a minute. Once it cannot be reached it is not asked
again in the process (the other models go on from the catalog and the cache), and the command says so
once (core/progress.notice). `go_offline()` then makes the loaders read the cache without trying the
network at all.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from trainfit.config import ConfigError
from trainfit.core import progress
from trainfit.models.catalog import catalog_lookup

HUB_TIMEOUT_S = 5.0  # one metadata request; HF_HUB_ETAG_TIMEOUT overrides it
_unreachable = ""    # why, once the hub could not be reached: it is not asked again in this process


@dataclass(frozen=True)
class Found:
    kind: str    # preset | local | gguf | cache | hub | catalog
    where: str   # the file or directory, the cache snapshot, or the hub id
    note: str = ""


def offline() -> bool:
    """Hub lookups are off: HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE (as huggingface_hub reads them) or
    TRAINFIT_OFFLINE."""
    from huggingface_hub import constants

    env = (os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or "").upper()
    return bool(constants.HF_HUB_OFFLINE or env in ("1", "ON", "YES", "TRUE") or os.environ.get("TRAINFIT_OFFLINE"))


def cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def go_offline() -> None:
    """Make huggingface_hub (and transformers through it) read only the local cache from now on, in this
    process and in the ranks it launches: for when the hub cannot be reached, so that loading a cached
    model does not retry every file over the network first."""
    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True


def in_cache(repo: str, revision: Optional[str] = None, filename: str = "config.json") -> Optional[str]:
    """The cached file's path when `filename` of `repo` at `revision` is in the local cache, else None."""
    from huggingface_hub import try_to_load_from_cache

    try:
        hit = try_to_load_from_cache(repo, filename, revision=revision)
    except ValueError:  # not a valid repo id
        return None
    return hit if isinstance(hit, str) else None


@functools.lru_cache(maxsize=None)
def ask_hub(repo: str, revision: Optional[str] = None) -> tuple[Optional[bool], str]:
    """(True, "") when the hub has `repo` (gated ones included), (False, why) when it says it has not,
    (None, why) when it cannot be reached. One request, no retries."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    global _unreachable
    if _unreachable:  # asked once: the other models go on from the catalog and the cache at once
        return None, _unreachable
    timeout = float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or HUB_TIMEOUT_S)
    try:
        HfApi().model_info(repo, revision=revision, timeout=timeout)
        return True, ""
    except GatedRepoError:
        return True, "gated: accept its licence on the hub and log in (`hf auth login`)"
    except RevisionNotFoundError:
        return False, f"the hub has {repo} but no revision {revision!r}"
    except RepositoryNotFoundError:
        return False, f"the hub has no model {repo} (or it is private and no token with access is set)"
    except Exception as e:  # network errors of any client (httpx, requests), timeouts
        _unreachable = f"the hub could not be reached ({type(e).__name__}: {str(e)[:120]})"
        progress.notice(f"{_unreachable}; going on from trainfit's catalog and the local Hugging Face cache "
                        "without asking it again (HF_HUB_OFFLINE=1 skips asking).")
        return None, _unreachable


def _is_repo_id(name: str) -> bool:
    if name.startswith((".", "/", "~")):  # a path: said without importing huggingface_hub (~0.5 s on 2 busy cores)
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def resolve_model(name: str, *, key: str = "model.name", revision: Optional[str] = None,
                  gguf_file: Optional[str] = None, catalog_ok: bool = False) -> Found:
    """Where `name` is, or ConfigError naming the key, the path tried, the cache dir and the hub's
    answer. `catalog_ok`: a hub id found nowhere but known to the planner's catalog is accepted (the
    planner plans its architecture; its weights would still have to be downloaded to train)."""
    if name.startswith("preset:"):
        return Found("preset", name)
    path = Path(os.path.expanduser(name))
    if name.endswith(".gguf"):
        if path.is_file():
            return Found("gguf", str(path))
        raise ConfigError(f"{key}={name!r}: GGUF file not found (looked for {path.resolve()}); give the path to an "
                          "existing .gguf file.")
    if path.is_dir():
        return _local_dir(name, path, key, gguf_file, catalog_ok)
    if path.exists():
        raise ConfigError(f"{key}={name!r} is a file, not a model directory; point it at a directory saved with "
                          "save_pretrained, a .gguf file, or a hub id.")
    looked = f"no such local path ({path.resolve()})"
    if not _is_repo_id(name):
        raise ConfigError(f"{key}={name!r} was not found: {looked}, and it is not a hub id (organisation/name). "
                          "Give an existing model directory, a .gguf file, a hub id such as Qwen/Qwen3-0.6B, or "
                          "preset:tiny.")
    filename = gguf_file or "config.json"
    hit = in_cache(name, revision, filename)
    if hit:
        return Found("cache", str(Path(hit).parent))
    where = f"{looked}, not in the Hugging Face cache ({cache_dir()}, {filename} of {name}"
    where += f" at revision {revision})" if revision else ")"
    if offline():
        answer, why = None, "hub lookups are off (HF_HUB_OFFLINE or TRAINFIT_OFFLINE is set)"
    else:
        answer, why = ask_hub(name, revision)
        if answer:
            return Found("hub", name, why)
    if catalog_ok:
        if catalog_lookup(name):
            return Found("catalog", name, f"{key}={name!r}: its weights are not on this machine ({where}; {why}); "
                                          "the plan uses the architecture from trainfit's catalog, and `trainfit "
                                          "train` needs the weights (the hub, or a local copy).")
    fix = ("Check the name on huggingface.co" if answer is False else
           f"Download it where the hub is reachable (`hf download {name}`) and bring that cache here (or point "
           "HF_HUB_CACHE at it)")
    raise ConfigError(f"{key}={name!r} was not found: {where}, and {why}. {fix}, or use a local model directory, "
                      "a .gguf file, or preset:tiny.")


def _local_dir(name: str, path: Path, key: str, gguf_file: Optional[str], catalog_ok: bool) -> Found:
    if gguf_file:
        if (path / gguf_file).is_file():
            return Found("gguf", str(path / gguf_file))
        raise ConfigError(f"model.gguf_file={gguf_file!r} is not in {key}={name!r} ({path.resolve()}); name a .gguf "
                          "file that is there.")
    if (path / "config.json").is_file():
        return Found("local", str(path))
    adapter = path / "adapter_config.json"
    if adapter.is_file():  # a PEFT adapter dir: its base must be loadable too
        base = json.loads(adapter.read_text()).get("base_model_name_or_path")
        if not base:
            raise ConfigError(f"{key}={name!r} is an adapter directory whose adapter_config.json names no "
                              "base_model_name_or_path; set it to the base model's directory or hub id.")
        found = resolve_model(base, key=f"the base model of {key}={name!r} (adapter_config.json)",
                              catalog_ok=catalog_ok)
        return Found("local", str(path), found.note)
    raise ConfigError(f"{key}={name!r} is a directory without config.json ({path.resolve()}); point it at a model "
                      "directory saved with save_pretrained (or a PEFT adapter directory), or use a hub id such as "
                      "Qwen/Qwen3-0.6B.")
