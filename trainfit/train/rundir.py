"""Guarding a run dir before training: a finished or checkpointed run is never retrained over silently.

`trainfit train` into a run dir that already holds a finished run (summary.json, or a stage's DONE
marker) or checkpoints of an unfinished one would discard them. Without `--resume` or `--overwrite`
it stops with the three choices; `--overwrite` removes what would mix the old run into the new one
(markers, summary, checkpoints, TensorBoard events, sample logs) and nothing else.

Layout (trainfit/train/run.py): one stage trains in <run_dir>; a pipeline in <run_dir>/<i>-<stage>/.
Both are looked at, so the check holds whatever the config's stage list is now.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from trainfit.config import Config, ConfigError

SUMMARY = "summary.json"
DONE = "DONE"  # the stage marker of trainfit/train/run.py
LATEST = "checkpoints/latest"  # trainfit/train/checkpoint.py: names the newest complete checkpoint
# What a previous run leaves that a new one would not replace (metrics.jsonl is rewritten from step 0).
STAGE_DIR = re.compile(r"\d+-(pretrain|sft|grpo|ppo)")
STALE_RUN_FILES = (SUMMARY, "metrics.png", "warnings.log")
STALE_STAGE_FILES = (DONE, "checkpoints", "tensorboard", "completions.jsonl", "transcripts.jsonl")


def stage_dirs(run_dir: Path) -> list[Path]:
    """The run dir and its pipeline stage dirs (`0-sft`, `1-grpo`, ...) that exist."""
    subs = sorted(p for p in run_dir.iterdir() if p.is_dir() and STAGE_DIR.fullmatch(p.name))
    return [run_dir, *subs]


def previous_run(run_dir: Path) -> tuple[bool, list[Path]]:
    """(finished, checkpoint roots): whether a run finished here, and where checkpoints are kept."""
    if not run_dir.is_dir():
        return False, []
    dirs = stage_dirs(run_dir)
    finished = (run_dir / SUMMARY).exists() or any((d / DONE).exists() for d in dirs)
    ckpts = [d / "checkpoints" for d in dirs if (d / LATEST).exists()]
    return finished, ckpts


def check_run_dir(cfg: Config, *, resume: bool, overwrite: bool) -> None:
    """Raise ConfigError when training would silently discard a previous run in cfg.run_dir."""
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite contradict each other: --resume continues the run in "
                          f"{cfg.run_dir}, --overwrite starts it again from scratch; pass one of them.")
    if resume or overwrite:
        return
    run_dir = Path(cfg.run_dir)
    finished, ckpts = previous_run(run_dir)
    if not finished and not ckpts:
        return
    what = ("holds a finished run (summary.json or a stage's DONE marker)" if finished else
            f"holds checkpoints of an unfinished run ({', '.join(str(c) for c in ckpts)})")
    raise ConfigError(
        f"run_dir={cfg.run_dir} {what}; training again from scratch would overwrite it. Choose one: "
        "`--resume` to continue it (finished stages are kept and skipped, an unfinished one continues from its "
        "latest checkpoint); "
        "another run dir, e.g. `run_dir=runs/new` on the command line; or `--overwrite` to discard it "
        "and train from scratch.")


def clear_previous_run(cfg: Config) -> list[Path]:
    """For --overwrite: remove what a previous run left that the new one would mix with. Returns it."""
    run_dir = Path(cfg.run_dir)
    if not run_dir.is_dir():
        return []
    removed = [run_dir / n for n in STALE_RUN_FILES if (run_dir / n).exists()]
    for d in stage_dirs(run_dir):
        removed += [d / n for n in STALE_STAGE_FILES if (d / n).exists()]
    for p in removed:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    return removed
