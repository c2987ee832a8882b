"""Reading records from .jsonl, .json and .txt files, and what a record must hold for the fields a stage reads.

The trainer reads every record (`load_records`); the pre-run check (train/datacheck.py) reads the same
records through the same function, up to a byte budget. Each record keeps where it came from
(`Records.origins`: "data/train.jsonl, line 31"), so an error about a row names the line of the user's
file however the rows were split or shuffled afterwards. The field checks (`check_text_record`,
`check_sft_record`) are the ones the encoders run, so the check and the trainer refuse the same rows.
"""

from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Any, Optional

from trainfit.config import ConfigError

SUFFIXES = (".txt", ".jsonl", ".json")
SHAPES = ("`text` ({\"text\": ...}), `prompt_completion` ({\"prompt\": ..., \"completion\": ...}) or "
          "`messages` ({\"messages\": [{\"role\": ..., \"content\": ...}, ...]})")


class Records(list):
    """Records read from files; `origins[i]` says where record i was read ("train.jsonl, line 5")."""

    def __init__(self, items=(), origins=None):
        super().__init__(items)
        self.origins: list[str] = list(origins) if origins is not None else []


def origin_of(records, i: int) -> Optional[str]:
    """Where record i of `records` was read, when they are Records (else None)."""
    origins = getattr(records, "origins", None)
    return origins[i] if origins and i < len(origins) else None


def data_files(path: str, key: str = "data.path") -> list[Path]:
    """The data files `path` names: a file, a directory's .txt/.jsonl/.json files (recursively, sorted)
    or a glob's. ConfigError naming `key` when there are none."""
    p = Path(path)
    if any(c in path for c in "*?["):
        files = [Path(f) for f in sorted(glob.glob(path, recursive=True)) if Path(f).is_file()]
        files = [f for f in files if f.suffix.lower() in SUFFIXES]
        if not files:
            raise ConfigError(f"{key}={path!r}: the glob matches no {'/'.join(SUFFIXES)} files; check the "
                              "pattern (use ** for subdirectories).")
    elif p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in SUFFIXES)
        if not files:
            raise ConfigError(f"{key}={path!r} is a directory without {'/'.join(SUFFIXES)} files; put the "
                              "data there or point the key at the files.")
    elif p.is_file():
        if p.suffix.lower() not in SUFFIXES:
            raise ConfigError(f"{key}={path!r} has suffix {p.suffix!r}; trainfit reads {', '.join(SUFFIXES)} "
                              "files: rename it (raw text -> .txt, one JSON object a line -> .jsonl).")
        files = [p]
    else:
        raise ConfigError(f"{key}={path!r} does not exist; give an existing file, directory or glob "
                          "(e.g. data/*.jsonl).")
    return files


def no_records(path: str, key: str = "data.path") -> ConfigError:
    return ConfigError(f"{key}={path!r} holds no records (files are empty); add data or fix the path.")


def load_records(path: str, key: str = "data.path", limit_bytes: Optional[int] = None,
                 skipped: Optional[list] = None) -> Records:
    """Records from a file, a directory (its .txt/.jsonl/.json files, recursively, sorted) or a glob.

    A .txt file is one record {"text": whole file}; .jsonl is one object per non-empty line; .json is
    an object, a list of objects, or JSON lines. `key` names the config key in error messages.
    `limit_bytes` reads only the start (the pre-run check of large data): a whole-document file that
    does not fit, and the lines past the budget, are listed in `skipped` instead of read.
    """
    out, seen = Records(), 0
    for f in data_files(path, key):
        left = None if limit_bytes is None else limit_bytes - seen
        if left is not None and f.suffix.lower() in (".txt", ".json") and f.stat().st_size > left:
            skipped.append(str(f))   # one document: read whole, or not at all
            continue
        records, origins, used = _read(f, key, left, skipped)
        out.extend(records)
        out.origins.extend(origins)
        seen += used
    if not out and limit_bytes is None:
        raise no_records(path, key)
    return out


def json_error(e: json.JSONDecodeError) -> str:
    """A decoder error as words: 'Expecting value at column 3', 'Unterminated string starting at
    column 203' (that message already ends in 'at')."""
    return f"{e.msg}{'' if e.msg.endswith(' at') else ' at'} column {e.colno}"


def parse_line(line: str, f: Path, lineno: int, key: str) -> dict:
    """One JSONL line as a record; ConfigError naming the file, the line and the fix."""
    try:
        r = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{key}: {f} line {lineno} is not valid JSON ({json_error(e)}); "
                          "JSONL needs one complete JSON object per line: fix or remove that line.") from None
    if not isinstance(r, dict):
        raise ConfigError(f"{key}: {f} line {lineno} is a {type(r).__name__}, not a JSON object; write "
                          "each record as an object such as {\"prompt\": ..., \"completion\": ...}.")
    return r


def _read_file(f: Path, key: str) -> list[dict]:
    """Every record of one file."""
    return _read(f, key, None, None)[0]


def _read(f: Path, key: str, budget: Optional[int], skipped: Optional[list]) -> tuple[list, list, int]:
    """(records, their origins, bytes read) of one file; JSON lines stop after `budget` bytes (at least one
    line is read), the rest named in `skipped`."""
    suffix = f.suffix.lower()
    if suffix in (".txt", ".json"):
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{key}: {f} is not UTF-8 ({e}); convert it, e.g. `iconv -t utf-8`.") from None
        size = len(text.encode("utf-8"))
        if suffix == ".txt":
            return ([{"text": text}], [str(f)], size) if text.strip() else ([], [], size)
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            obj = None  # not one JSON document: read it as JSON lines below
        if isinstance(obj, dict):
            return [obj], [str(f)], size
        if isinstance(obj, list):
            for i, r in enumerate(obj):
                if not isinstance(r, dict):
                    raise ConfigError(f"{key}: {f} item {i} is a {type(r).__name__}, not an object; each "
                                      "record must be a JSON object such as {\"text\": ...}.")
            return obj, [f"{f}, item {i}" for i in range(len(obj))], size
        return _lines(text.encode("utf-8").splitlines(keepends=True), f, key, budget, skipped)
    with f.open("rb") as fh:
        return _lines(fh, f, key, budget, skipped)


def _lines(lines, f: Path, key: str, budget, skipped: list) -> tuple[list, list, int]:
    """The JSON lines of file `f` (an iterable of its byte lines), up to `budget` bytes."""
    records, origins, seen = [], [], 0
    for lineno, raw in enumerate(lines, start=1):
        seen += len(raw)
        if budget is not None and seen > budget and lineno > 1:
            skipped.append(f"{f} from line {lineno}")
            break
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{key}: {f} line {lineno} is not UTF-8 ({e}); convert the file, e.g. "
                              "`iconv -t utf-8`.") from None
        if line.strip():
            records.append(parse_line(line, f, lineno, key))
            origins.append(f"{f}, line {lineno}")
    return records, origins, seen


def detect_format(record: dict, text_field: str = "text") -> str:
    """The shape of one record: "messages", "prompt_completion" or "text" (checked in that order)."""
    if isinstance(record.get("messages"), list):
        return "messages"
    if "prompt" in record and "completion" in record:
        return "prompt_completion"
    if isinstance(record.get(text_field), str):
        return "text"
    raise ConfigError(f"A record has keys {sorted(record)}, which match no known shape. Accepted shapes: "
                      f"{SHAPES}. If raw text sits under another key, set data.text_field to it.")


def sft_format(first: dict, fmt: str, text_field: str = "text", where: str = "") -> str:
    """The SFT format of rows whose first row is `first` (data.format, `auto` = the first row's shape)."""
    if fmt == "auto":
        try:
            fmt = detect_format(first, text_field)
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}" if where else str(e)) from None
    if fmt == "text":
        raise ConfigError(f"{where + ': ' if where else ''}SFT needs prompt/completion or messages records, but "
                          "the data is raw text; use stage pretrain for text, or reshape the records (data.format).")
    if fmt not in ("prompt_completion", "messages"):
        raise ConfigError(f"data.format={fmt!r} is not one of auto, text, prompt_completion, messages.")
    return fmt


def null_fields(r: dict, fields) -> list[str]:
    """The fields of `fields` a row has as JSON null (None)."""
    return [f for f in fields if f in r and r[f] is None]


def null_error(where: str, r: dict, fields) -> Optional[str]:
    """A paragraph for a row with a null field: it would otherwise be trained on as the text "None"."""
    nulls = null_fields(r, fields)
    if not nulls:
        return None
    empty = " (an empty prompt is written \"\")" if "prompt" in nulls else ""
    return (f"{where} has {', '.join(f'`{f}: null`' for f in nulls)}; every field a row is trained on needs a "
            f"value{empty}: fill it or drop the row.")


def check_text_record(r: dict, text_field: str, where: str) -> str:
    """The text of a pretraining record, or the ConfigError naming the row and data.text_field."""
    t = r.get(text_field) if isinstance(r, dict) else None
    if not isinstance(t, str):
        keys = sorted(r) if isinstance(r, dict) else type(r).__name__
        raise ConfigError(f"{where} has keys {keys} but pretraining reads the text field {text_field!r}; set "
                          "data.text_field (or data.columns.text) to the key holding the text.")
    return t


def check_sft_record(r: Any, fmt: str, where: str) -> None:
    """An SFT record holds what `fmt` (prompt_completion or messages) trains on, none of it null."""
    need = ("messages",) if fmt == "messages" else ("prompt", "completion")
    if not isinstance(r, dict) or any(k not in r for k in need):
        keys = sorted(r) if isinstance(r, dict) else type(r).__name__
        raise ConfigError(f"{where} has keys {keys} but data.format={fmt} needs {list(need)}; fix the record or "
                          f"the format. Accepted shapes: {SHAPES}.")
    problem = null_error(where, r, need)
    if problem:
        raise ConfigError(problem)
