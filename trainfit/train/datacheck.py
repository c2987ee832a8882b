"""What a stage reads, checked before anything loads: data files, the task, the reward functions.

Each record must parse and have the fields its stage reads (pretrain: the text field; sft: the
fields of its format; rm: a prompt and the two answers), with the file and line in the error. The
task is built as the trainer builds it (a JSONL task reads and checks its rows and images) and GRPO /
PPO resolve their reward functions (user modules are imported).

Large data: every line is checked up to CHECK_BYTES per key (about a second or two of parsing);
beyond that only the start is checked and a note says so, since `train` reads the whole file anyway
as it loads (the same line checks, the same messages) before its first step. A user with a 10 GB
JSONL gets a dry run in seconds that checked its first 256 MiB, not a second full read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from trainfit.data import sources
from trainfit.config import Config, ConfigError, DPOConfig, DataConfig, TaskConfig
from trainfit.data.text import SHAPES, _read_file, data_files, detect_format, no_records, parse_line
from trainfit.tasks.pairs import UNPAIRED_SHAPE, is_unpaired, unpaired_loss_error
from trainfit.config.stages import stage_spec
from trainfit.tasks import build_task
from trainfit.tasks.jsonl_task import read_lines
from trainfit.tasks.rewards import BUILTIN_REWARDS, load_reward, resolve_rewards
from trainfit.data.image_chat import has_images

CHECK_BYTES = 256 * 2 ** 20
CHECK_ROWS = 10_000  # rows of a dataset source converted before the first step (its columns, each row's shape)
_PAIR_SHAPE = ("`prompt` (text or messages) or `messages`, plus `chosen` and `rejected` (text or messages), e.g. "
               '{"prompt": "2+2=", "chosen": "4", "rejected": "5"}')


def uses_data(cfg: Config) -> bool:
    """Whether the stage trains on data.path (else on its task): as train/sft.py and train/rm.py decide."""
    if stage_spec(cfg.stage).data in ("text", "sft"):
        # With an environment to evaluate in (sft on expert trajectories), task.name names the held-out episodes.
        return bool(cfg.data.path) and (not cfg.task.name or stage_spec(cfg.stage).eval_episodes(cfg))
    return stage_spec(cfg.stage).reads_pairs and bool(cfg.data.path)


def uses_task(cfg: Config) -> bool:
    return bool(cfg.task.name) and not uses_data(cfg)


def check_stage(cfg: Config) -> list[str]:
    """Check what the stage reads; ConfigError on the first problem. Returns notes (a large file
    checked only at its start)."""
    notes: list[str] = []
    if uses_data(cfg):
        notes += check_records(cfg, cfg.data.path, "data.path")
        if cfg.data.eval_path:
            notes += check_records(cfg, cfg.data.eval_path, "data.eval_path")
    if uses_task(cfg):
        notes += check_task(cfg.task, cfg.stage)
    return notes


def _records(path: str, key: str, budget: int, skipped: list[str]) -> Iterator[tuple[str, dict]]:
    """(where, record) of every record of `path` up to `budget` bytes; files or lines past it are
    listed in `skipped`."""
    seen = 0
    for f in data_files(path, key):
        size = f.stat().st_size
        suffix = f.suffix.lower()
        if suffix in (".txt", ".json"):  # one document: read whole, or not at all
            if seen + size > budget:
                skipped.append(str(f))
                continue
            seen += size
            for i, r in enumerate(_read_file(f, key)):
                yield f"{key} {f}" + (f", item {i}" if suffix == ".json" else ""), r
            continue
        with f.open("rb") as fh:
            for lineno, raw in enumerate(fh, start=1):
                seen += len(raw)
                if seen > budget and lineno > 1:
                    skipped.append(f"{f} from line {lineno}")
                    break
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ConfigError(f"{key}: {f} line {lineno} is not UTF-8 ({e}); convert the file, e.g. "
                                      "`iconv -t utf-8`.") from None
                if line.strip():
                    yield f"{key} {f}, line {lineno}", parse_line(line, f, lineno, key)


def check_dataset(cfg: Config, key: str) -> list[str]:
    """A dataset source (parquet, Arrow, CSV, save_to_disk, hub id): opened from what is on this machine
    (nothing downloads), its columns mapped to the stage's shape, and its first CHECK_ROWS rows converted,
    as the trainer converts them. A hub dataset not in the local cache is left to `train`, with a note."""
    data = stage_spec(cfg.stage).data
    want = "sft" if data == "none" else data   # text | sft | pairs
    held = key.endswith("eval_path")
    path = cfg.data.eval_path if held else cfg.data.path
    try:
        with sources.local_only():
            rows = sources.read_rows(cfg.data, want, held_out=held)
    except ConfigError:
        if sources.kind_of(path) != "hub":
            raise
        return [f"{key}={path!r} is not in the local Hugging Face cache; `train` downloads and checks it."]
    for i in range(min(len(rows or ()), CHECK_ROWS)):
        r = rows[i]  # converting a row raises the ConfigError that names it
        if stage_spec(cfg.stage).unpaired_rows and is_unpaired(rows[0]):
            _check_unpaired(cfg.dpo, r, f"{key}, row {i}", key)
    return []


def _check_unpaired(dpo: DPOConfig, r: dict, where: str, key: str) -> None:
    """An unpaired row as preference.encode_policy_rows reads it: only for kto, a boolean label."""
    if dpo.loss_type != "kto":
        raise ConfigError(unpaired_loss_error(key, dpo.loss_type))
    if not is_unpaired(r) or not ("prompt" in r or "messages" in r):
        raise ConfigError(f"{where} has keys {sorted(r)}; unpaired rows (the first row's shape) need {UNPAIRED_SHAPE}.")
    if not isinstance(r["label"], bool):
        raise ConfigError(f"{where} has label={r['label']!r}; an unpaired row's `label` is true (a desirable "
                          "completion) or false (an undesirable one): write it as a JSON boolean.")


def check_records(cfg: Config, path: str, key: str, budget: int = CHECK_BYTES) -> list[str]:
    """Every record of `path` (up to `budget` bytes) parses and has the fields `cfg.stage` reads."""
    if sources.kind_of(path) != "plain":
        return check_dataset(cfg, key)
    d, fmt, n, unpaired = cfg.data, None, 0, None
    skipped: list[str] = []
    for where, r in _records(path, key, budget, skipped):
        n += 1
        if unpaired is None:   # stage dpo reads KTO's unpaired rows when the first row is one (train/dpo.py)
            unpaired = stage_spec(cfg.stage).unpaired_rows and is_unpaired(r)
        if unpaired:
            _check_unpaired(cfg.dpo, r, where, key)
        elif stage_spec(cfg.stage).reads_pairs:
            if "chosen" not in r or "rejected" not in r or not ("prompt" in r or "messages" in r):
                raise ConfigError(f"{where} has keys {sorted(r)}; stage {cfg.stage} rows need {_PAIR_SHAPE}.")
        elif has_images(r):  # vision rows: chat rows, or image-caption pairs (data/image_chat.py)
            if not isinstance(r.get("messages"), list) and not isinstance(r.get(d.text_field), str):
                raise ConfigError(f"{where} has keys {sorted(r)}; rows with images are chat rows (`messages`, with "
                                  "image parts or `images` + <image>) or image-caption pairs (`image` or `images`, "
                                  f"and {d.text_field!r}).")
        elif stage_spec(cfg.stage).data == "text":
            if not isinstance(r.get(d.text_field), str):
                raise ConfigError(f"{where} has keys {sorted(r)} but pretraining reads the text field "
                                  f"{d.text_field!r}; set data.text_field to the key holding the text.")
        else:
            fmt = fmt or _sft_format(r, where, d)
            need = ("messages",) if fmt == "messages" else ("prompt", "completion")
            if any(k not in r for k in need):
                raise ConfigError(f"{where} has keys {sorted(r)} but data.format={fmt} needs {list(need)}; fix the "
                                  f"record or the format. Accepted shapes: {SHAPES}.")
    if not n and not skipped:
        raise no_records(path, key)
    if skipped:
        return [f"{key}: checked the first {budget / 2 ** 20:.0f} MiB of the data; {', '.join(skipped[:3])}"
                + (f" and {len(skipped) - 3} more files" if len(skipped) > 3 else "")
                + " are checked as `train` reads them."]
    return []


def _sft_format(r: dict, where: str, d: DataConfig) -> str:
    fmt = d.format
    if fmt == "auto":
        try:
            fmt = detect_format(r, d.text_field)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
    if fmt == "text":
        raise ConfigError(f"{where}: SFT needs prompt/completion or messages records, but the data is raw text; use "
                          "stage pretrain for text, or reshape the records (data.format).")
    return fmt


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
