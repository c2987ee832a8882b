"""Guarding a run dir before training: a finished or checkpointed run is never retrained over silently.

`trainfit train` into a run dir that already holds a finished run (summary.json, or a stage's DONE
marker) or checkpoints of an unfinished one would discard them. Without `--resume` or `--overwrite`
it stops with the three choices.

`--overwrite` discards the whole previous run before the first step: the run dir is renamed to a
sibling `<run_dir>.overwritten-<time>` (one rename: atomic, so `serve` and `--resume` see either the
old run whole or no run, never a mix of two) and that sibling is then deleted. A crash during the
delete leaves only the sibling, which the next `--overwrite` of the same run dir deletes. Deleting
right away, not when the new run ends, keeps the disk a big run needs free for the new checkpoints.
It refuses a run dir holding anything trainfit does not write there (a user's files are never
deleted by a flag), the filesystem root, the home directory, and the working directory or its parents.

A run dir that cannot be written (a read-only mount, no permission) is refused first, whatever the flags
(train/storage.py probes it with a real file).

`--resume` is refused where there is nothing to continue (no checkpoint, no finished stage), and where
the config changes a key the run's checkpoints depend on (train/resume.py).

Layout (trainfit/train/run.py): one stage trains in <run_dir>; a pipeline in <run_dir>/<i>-<stage>/.
Both are looked at, so the check holds whatever the config's stage list is now.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path
from typing import Optional

from trainfit.config import Config, ConfigError
from trainfit.train.resume import NOTE, resume_changes
from trainfit.train.storage import check_writable

SUMMARY = "summary.json"
DONE = "DONE"  # the stage marker of trainfit/train/run.py
LATEST = "checkpoints/latest"  # trainfit/train/checkpoint.py: names the newest complete checkpoint
STAGE_DIR = re.compile(r"\d+-(pretrain|sft|rm|dpo|grpo|ppo)")
# Everything a run writes into its run dir (run.py, loop.py, trackers.py, the rollout engines'
# default sync dir) and into each stage dir; a single-stage run writes both sets into the run dir.
RUN_ENTRIES = {"config.yaml", SUMMARY, "metrics.png", "warnings.log", "report.html", "replay.html", NOTE}
STAGE_ENTRIES = {DONE, "config.yaml", "metrics.jsonl", "metrics.jsonl.tmp", "checkpoints", "final", "base",
                 ".tmp-final", ".old-final", "tensorboard", "completions.jsonl", "transcripts.jsonl", "screens",
                 "trackers.json", "wandb", "rollout_sync"}
TRASH = ".overwritten-"  # <run_dir name>.overwritten-<YYYYmmdd-HHMMSS>-<pid>


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


def check_run_dir(run_dir: str, *, resume: bool, overwrite: bool, cfg: Optional[Config] = None) -> None:
    """Raise ConfigError when `run_dir` (the config's run_dir) cannot be written, when training would silently
    discard a previous run in it, when --overwrite would delete something that is not a trainfit run, or when --resume has
    nothing to continue or `cfg` changes what the run started with (train/resume.py)."""
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite contradict each other: --resume continues the run in "
                          f"{run_dir}, --overwrite starts it again from scratch; pass one of them.")
    # Before anything else about the run dir: a read-only or unwritable one fails every door below.
    check_writable(run_dir, [d / "checkpoints" for d in stage_dirs(Path(run_dir))] if Path(run_dir).is_dir() else [])
    if overwrite:
        check_discardable(Path(run_dir))
    if resume:
        check_resumable(run_dir, cfg)
    if resume or overwrite:
        return
    finished, ckpts = previous_run(Path(run_dir))
    if not finished and not ckpts:
        return
    what = ("holds a finished run (summary.json or a stage's DONE marker)" if finished else
            f"holds checkpoints of an unfinished run ({', '.join(str(c) for c in ckpts)})")
    raise ConfigError(
        f"run_dir={run_dir} {what}; training again from scratch would overwrite it. Choose one: "
        "`--resume` to continue it (finished stages are kept and skipped, an unfinished one continues from its "
        "latest checkpoint); "
        "another run dir, e.g. `run_dir=runs/new` on the command line; or `--overwrite` to discard it "
        "and train from scratch.")


def resumable(run_dir: str) -> bool:
    """Whether `run_dir` holds something --resume continues: a finished stage or a checkpoint."""
    finished, ckpts = previous_run(Path(run_dir))
    return finished or bool(ckpts)


def check_resumable(run_dir: str, cfg: Optional[Config] = None) -> None:
    """--resume: raise ConfigError when run_dir holds no checkpoint and no finished stage (training from
    scratch under --resume would say one thing and do another), or when `cfg` changes a key the run's
    checkpoints depend on (resume.resume_changes)."""
    if not resumable(run_dir):
        never = (" (this config has train.save_every=0: a run writes no checkpoint before its final model unless "
                 "Ctrl-C or SIGTERM stops it)"
                 if cfg is not None and cfg.train.save_every == 0 else "")
        raise ConfigError(
            f"--resume: run_dir={run_dir} holds no checkpoint and no finished stage, so there is nothing to "
            f"continue{never}. Drop --resume to train from scratch, or pass --resume-or-start to continue a run "
            "where there is one and start it where there is not (for a job script that may be requeued).")
    if cfg is not None:
        resume_changes(cfg)


def foreign_entries(run_dir: Path) -> list[str]:
    """Names in run_dir (and its stage dirs) that no trainfit run writes, sorted."""
    out = []
    for p in run_dir.iterdir():
        if STAGE_DIR.fullmatch(p.name) and p.is_dir():
            out += [f"{p.name}/{q.name}" for q in p.iterdir() if q.name not in STAGE_ENTRIES]
        elif p.name not in RUN_ENTRIES | STAGE_ENTRIES:
            out.append(p.name)
    return sorted(out)


def check_discardable(run_dir: Path) -> None:
    """Raise ConfigError unless --overwrite may delete run_dir whole (absent, empty, or only a run's files)."""
    if run_dir.is_symlink():
        raise ConfigError(f"run_dir={run_dir} is a symbolic link (to {os.readlink(run_dir)}); --overwrite discards a "
                          "run dir by renaming it and would leave the linked directory's files in place: pass the "
                          "directory itself as run_dir, or remove the link.")
    if not run_dir.exists():
        return
    if not run_dir.is_dir():
        raise ConfigError(f"run_dir={run_dir} is a file, not a directory; choose another run_dir.")
    here, where = Path.cwd().resolve(), run_dir.resolve()
    if where == Path(where.anchor) or where == Path.home().resolve() or where == here or where in here.parents:
        raise ConfigError(f"run_dir={run_dir} is {where}, the filesystem root, the home directory or the working "
                          "directory (or one above it); --overwrite deletes the whole run dir, so it refuses this one: "
                          "set run_dir to a directory of its own, e.g. run_dir=runs/new.")
    foreign = foreign_entries(run_dir)
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise ConfigError(f"run_dir={run_dir} holds files a trainfit run does not write ({shown}); --overwrite deletes "
                          "the whole run dir, so it stops rather than delete them: move them out of it, or choose "
                          "another run dir, e.g. run_dir=runs/new.")


def leftover_trash(run_dir: Path) -> list[Path]:
    """Siblings an earlier --overwrite renamed run_dir to and did not finish deleting."""
    pattern = re.compile(re.escape(run_dir.name + TRASH) + r"\d{8}-\d{6}-\d+")
    parent = run_dir.parent
    return sorted(p for p in parent.iterdir() if pattern.fullmatch(p.name)) if parent.is_dir() else []


def discard_previous_run(run_dir: Path) -> Optional[Path]:
    """For --overwrite: rename run_dir aside (atomic), then delete it. Returns the renamed path, or None
    when there was nothing to discard. Raises ConfigError where check_discardable refuses."""
    check_discardable(run_dir)
    old = leftover_trash(run_dir)
    moved = None
    if run_dir.exists():
        moved = run_dir.with_name(f"{run_dir.name}{TRASH}{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        try:
            run_dir.rename(moved)
        except OSError as e:  # e.g. run_dir is a mount point, or its parent is not writable
            raise ConfigError(f"--overwrite could not move the previous run in run_dir={run_dir} aside ({e}); "
                              "delete it by hand, or choose another run dir, e.g. run_dir=runs/new.") from None
    for p in [*old, *([moved] if moved else [])]:
        shutil.rmtree(p)
    return moved
