"""What a stage reads, checked before anything loads: data files, the task, the reward functions.

Data is read by the trainer's own reader (trainfit/data/sources/: the same files, the same shape
recognition and data.columns mapping) and each row is checked by the trainer's own row checks
(pretrain: the text field; sft: the fields of its format; rm / dpo: a prompt and the two answers, or
KTO's unpaired rows), so the check accepts what `train` reads and refuses what it refuses, with the
file and line (or the dataset row) in the error. `trainfit data` makes this check before it prints
anything, so the three doors give one answer. The task is built as the trainer builds it (a JSONL task
reads and checks its rows and images) and GRPO / PPO resolve their reward functions (user modules are
imported).

Large data: every line is checked up to CHECK_BYTES per key (about a second or two of parsing);
beyond that only the start is checked and a note says so, since `train` reads the whole file anyway
as it loads (the same line checks, the same messages) before its first step. A user with a 10 GB
JSONL gets a dry run in seconds that checked its first 256 MiB, not a second full read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from trainfit.data import sources
from trainfit.config import Config, ConfigError, TaskConfig
from trainfit.data.records import check_sft_record, check_text_record, load_records, no_records, sft_format
from trainfit.tasks.pairs import check_pair_row, check_unpaired_row, is_unpaired
from trainfit.config.stages import stage_spec
from trainfit.tasks import build_task
from trainfit.tasks.jsonl_task import read_lines
from trainfit.tasks.rewards import BUILTIN_REWARDS, load_reward, resolve_rewards
from trainfit.data.image_chat import has_images
from trainfit.plan.lengths import missing_locally

CHECK_BYTES = 256 * 2 ** 20
CHECK_ROWS = 10_000  # rows of a dataset source converted before the first step (its columns, each row's shape)


def uses_data(cfg: Config) -> bool:
    """Whether the stage trains on data.path (else on its task): as train/sft.py and train/rm.py decide."""
    if stage_spec(cfg.stage).data in ("text", "sft"):
        # With an environment to evaluate in (sft on expert trajectories), task.name names the held-out episodes.
        return bool(cfg.data.path) and (not cfg.task.name or stage_spec(cfg.stage).eval_episodes(cfg))
    return stage_spec(cfg.stage).reads_pairs and bool(cfg.data.path)


def uses_task(cfg: Config) -> bool:
    return bool(cfg.task.name) and not uses_data(cfg)


def check_stage(cfg: Config, planning: bool = False) -> list[str]:
    """Check what the stage reads; ConfigError on the first problem. Returns notes (a large file
    checked only at its start). `planning`: a local data path not on this machine yet is left to
    `train` (the plan is made at the length caps and says so, plan/lengths.py)."""
    notes: list[str] = []
    if uses_data(cfg) and not (planning and missing_locally(cfg.data.path)):
        notes += check_records(cfg, cfg.data.path, "data.path")
        if cfg.data.eval_path or cfg.data.eval_split:   # the held-out rows too: a bad one stops `train` as well
            key = "data.eval_path" if cfg.data.eval_path else "data.path"
            notes += check_records(cfg, cfg.data.eval_path or cfg.data.path, key, held=True)
    if uses_task(cfg):
        notes += check_task(cfg.task, cfg.stage)
    return notes


def check_records(cfg: Config, path: str, key: str, budget: int = CHECK_BYTES, held: bool = False) -> list[str]:
    """The rows of `path` (with `held`, the held-out rows: data.eval_path, or data.path's data.eval_split) read,
    recognised and mapped (data.columns) by the trainer's reader (trainfit/data/sources/), each converted and
    checked with the trainer's own row checks: files up to `budget` bytes, a dataset's first CHECK_ROWS rows.
    A hub dataset not in the local cache is left to `train`, with a note. Returns notes (what was not checked)."""
    data = stage_spec(cfg.stage).data
    want = "sft" if data == "none" else data   # text | sft | pairs
    if sources.kind_of(path) == "plain":
        skipped: list[str] = []
        records = load_records(path, key, limit_bytes=budget, skipped=skipped)
        if not records and not skipped:
            raise no_records(path, key)
        if records:
            _check_rows(cfg, sources.read_rows(cfg.data, want, held_out=held, reader=lambda p, k: records), key)
        if skipped:
            return [f"{key}: checked the first {budget / 2 ** 20:.0f} MiB of the data; {', '.join(skipped[:3])}"
                    + (f" and {len(skipped) - 3} more files" if len(skipped) > 3 else "")
                    + " are checked as `train` reads them."]
        return []
    try:
        with sources.local_only():
            rows = sources.read_rows(cfg.data, want, held_out=held)
    except ConfigError:
        if sources.kind_of(path) != "hub":
            raise
        return [f"{key}={path!r} is not in the local Hugging Face cache; `train` downloads and checks it."]
    _check_rows(cfg, rows, key, CHECK_ROWS)
    return []


def _check_rows(cfg: Config, rows, key: str, limit: Optional[int] = None) -> None:
    """Rows (sources.Rows) converted to trainfit's shapes (a conversion error names the row) and checked
    as the stage's encoder checks them (tasks/pairs.py, data/records.py)."""
    spec, d = stage_spec(cfg.stage), cfg.data
    n = len(rows) if limit is None else min(len(rows), limit)
    unpaired = bool(n) and spec.unpaired_rows and is_unpaired(rows[0])  # train/dpo.py decides on the first row
    fmt = None
    for i in range(n):
        r, where = rows[i], rows.at(i)
        if unpaired:
            check_unpaired_row(r, where, cfg.dpo.loss_type, key)
        elif spec.reads_pairs:
            check_pair_row(r, where)
        elif has_images(r):  # vision rows: chat rows, or image-caption pairs (data/image_chat.py)
            if not isinstance(r.get("messages"), list) and not isinstance(r.get(d.text_field), str):
                raise ConfigError(f"{where} has keys {sorted(r)}; rows with images are chat rows (`messages`, with "
                                  "image parts or `images` + <image>) or image-caption pairs (`image` or `images`, "
                                  f"and {d.text_field!r}).")
        elif spec.data == "text":
            check_text_record(r, d.text_field, where)
        else:
            fmt = fmt or sft_format(r, d.format, d.text_field, where)
            check_sft_record(r, fmt, where, d.format == "auto")


def check_task(t: TaskConfig, stage: str) -> list[str]:
    """Build the task as the trainer does, and resolve GRPO / PPO's reward functions (for `stage`)."""
    rl = stage_spec(stage).rollout
    files = [(p, k) for p, k in ((t.path, "task.path"), (t.eval_path, "task.eval_path")) if p]
    if t.name == "jsonl" and any(Path(p).is_file() and Path(p).stat().st_size > CHECK_BYTES for p, _ in files):
        for p, k in files:  # too large to build twice: check the rows of its start, and the named rewards
            read_lines(p, k, limit_bytes=CHECK_BYTES)
        if rl:
            for spec in t.rewards:
                if spec != "default" and spec not in BUILTIN_REWARDS:
                    load_reward(spec)
        return [f"task.path: checked the rows of the first {CHECK_BYTES / 2 ** 20:.0f} MiB; the rest are checked "
                "as `train` builds the task."]
    if t.path and sources.kind_of(t.path) == "hub":
        try:
            with sources.local_only():  # nothing downloads before train
                task = build_task(t)
        except ConfigError:
            return [f"task.path={t.path!r} is not in the local Hugging Face cache; `train` downloads and checks it."]
    else:
        task = build_task(t)
    if rl:
        resolve_rewards(t, task)
    return []
