"""What `--resume` may change: the config a run continues with against the one it started with.

A resumed run must be the run it continues: the checkpoint's weights, optimizer moments, schedule and
data position belong to the config saved in <run_dir>/config.yaml when the run started. A key that
changes how a step is computed (batch sizes, learning rate, model, data, algorithm) would silently
make the resumed steps those of another run, so `--resume` refuses it and names every changed key with
both values. The keys in `MAY_CHANGE` change only what is written, when, where, or how fast: they are
taken, printed, and recorded in <run_dir>/resumed.jsonl; config.yaml keeps the values the run started
with.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any, Optional

from trainfit.config import Config, ConfigError, expand_stages, load_config

SAVED = "config.yaml"        # written by train/run.py when the run starts
NOTE = "resumed.jsonl"       # one line per resume that changed keys of MAY_CHANGE

# Keys (or whole sections, ending in ".") a resume may change, with why the run's math stays the same.
MAY_CHANGE: dict[str, str] = {
    "logging.": "what is logged and where",
    "train.log_every": "logging cadence",
    "train.eval_every": "evaluation cadence, as evaluating trains nothing",
    "train.save_every": "checkpoint cadence",
    "train.keep_checkpoints": "checkpoints kept",
    "train.stop_at_accuracy": "an early stop",
    "train.max_bad_steps": "when non-finite steps, which change nothing, stop the run",
    "train.max_steps": "the stage's length, under train.schedule=constant only",
    "train.cpu_threads": "CPU threads",
    "distributed.num_gpus": "ranks, at the same global batch",
    "distributed.num_nodes": "nodes, at the same global batch",
    "distributed.node_rank": "rendezvous",
    "distributed.master_addr": "rendezvous",
    "distributed.master_port": "rendezvous",
    "distributed.timeout_s": "rendezvous",
    "hardware.": "the card planned for",
    "run_dir": "a moved run dir",
}
_STAGE_PREFIX = re.compile(r"stages\.\d+\.")


def may_change(key: str) -> bool:
    """Whether `key` (dotted; a pipeline stage's `stages.N.` prefix ignored) is in MAY_CHANGE."""
    bare = _STAGE_PREFIX.sub("", key, count=1)
    return any(bare == k or (k.endswith(".") and bare.startswith(k)) for k in MAY_CHANGE)


def changed_keys(old: Any, new: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) of every leaf that differs between two config dumps. Lists of
    mappings of one length (a pipeline's `stages:`) are walked by index, as overrides name them
    (`stages.1.train.max_steps`); a key missing on one side reads as None."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in [*old, *(k for k in new if k not in old)]:
            out += changed_keys(old.get(k), new.get(k), f"{prefix}{k}.")
        return out
    if (isinstance(old, list) and isinstance(new, list) and len(old) == len(new)
            and all(isinstance(x, dict) for x in [*old, *new])):
        return [c for i, (a, b) in enumerate(zip(old, new)) for c in changed_keys(a, b, f"{prefix}{i}.")]
    return [] if old == new else [(prefix.rstrip("."), old, new)]


def saved_config(run_dir: Path) -> Optional[Config]:
    """The config the run in `run_dir` started with, or None when it saved none."""
    path = run_dir / SAVED
    if not path.is_file():
        return None
    try:
        return load_config(path)
    except ConfigError as e:
        raise ConfigError(f"--resume: {path}, the config the run started with, no longer loads ({e}); the run cannot "
                          "be checked against it. Resume with the trainfit version that wrote it, or start a new "
                          "run in another run dir, e.g. run_dir=runs/new.") from None


def resume_changes(cfg: Config) -> list[tuple[str, Any, Any]]:
    """The changes `--resume` takes (keys of MAY_CHANGE) against <run_dir>/config.yaml. Raises ConfigError
    naming every other changed key with both values, and a train.max_steps change under a cosine schedule."""
    old = saved_config(Path(cfg.run_dir))
    if old is None:
        return []
    changes = changed_keys(old.model_dump(mode="json"), cfg.model_dump(mode="json"))
    refused = [c for c in changes if not may_change(c[0])]
    cosine = [c for c in changes if _STAGE_PREFIX.sub("", c[0], count=1) == "train.max_steps"
              and _cosine(old, c[0])]
    if not refused and not cosine:
        return changes
    shown = "; ".join(f"{k}: {_show(a)} -> {_show(b)}" for k, a, b in [*refused, *cosine])
    why = (" (under train.schedule=cosine, max_steps is the schedule's length: a new one changes the learning rate "
           "of every step still to run; a run started with train.schedule=constant may change it)" if cosine else "")
    raise ConfigError(
        f"--resume: the config differs from {Path(cfg.run_dir) / SAVED}, the one the run started with, in keys that "
        f"change how a step is computed: {shown}{why}. The checkpoint belongs to the saved values; resume with them "
        f"(drop these overrides, or pass e.g. `{_override(*[*refused, *cosine][0][:2])}`), or start a new run with the "
        "new values in another run dir (run_dir=runs/new) or with --overwrite. A resume may change only "
        f"{_allowed()}.")


def record(run_dir: Path, changes: list[tuple[str, Any, Any]]) -> Optional[str]:
    """Append a resume's taken changes to <run_dir>/resumed.jsonl; the line to print, or None when none."""
    if not changes:
        return None
    with open(run_dir / NOTE, "a") as f:
        f.write(json.dumps({"time": time.time(), "changed": {k: [a, b] for k, a, b in changes}}) + "\n")
    return ("resumed with " + ", ".join(f"{k} {_show(a)} -> {_show(b)}" for k, a, b in changes)
            + f" ({SAVED} keeps the values the run started with; {NOTE} lists each resume's changes)")


def _cosine(old: Config, key: str) -> bool:
    """Whether the stage(s) `key` (train.max_steps, or stages.N.train.max_steps) belongs to ran a cosine schedule."""
    stages = expand_stages(old)
    m = _STAGE_PREFIX.match(key)
    which = [stages[int(m.group(0).split(".")[1])]] if m and old.stages else stages
    return any(s.train.schedule == "cosine" for s in which)


def _show(v: Any) -> str:
    return "(unset)" if v is None else json.dumps(v) if isinstance(v, (dict, list)) else str(v)


def _override(key: str, old: Any) -> str:
    return f"{key}={_show(old)}"


def _allowed() -> str:
    return "; ".join(f"{k.rstrip('.') + ('.*' if k.endswith('.') else '')} ({why})" for k, why in MAY_CHANGE.items())
