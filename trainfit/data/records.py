"""Reading records from .jsonl, .json and .txt files, and what a record must hold for the fields a stage reads.

The trainer reads every record (`load_records`); the pre-run check (train/datacheck.py) reads the same
records through the same function, up to a byte budget. Each record keeps where it came from
(`Records.origins`: "data/train.jsonl, line 31"), so an error about a row names the line of the user's
file however the rows were split or shuffled afterwards. The field checks (`check_text_record`,
`check_sft_record`, and `check_side` / `check_messages` for what a field holds, down to each message's
content) are the ones the encoders run, so the check and the trainer refuse the same rows.
"""

from __future__ import annotations

import glob
import json
import re
from pathlib import Path
from typing import Any, Optional

from trainfit.config import ConfigError

SUFFIXES = (".txt", ".jsonl", ".json")
# Read with Hugging Face `datasets` (data/sources/locate.py); named here so that every "no data there" error
# lists all that trainfit reads.
DATASET_SUFFIXES = (".parquet", ".arrow", ".csv", ".tsv")
READS = ", ".join(SUFFIXES + DATASET_SUFFIXES) + " files, or a folder written by datasets' save_to_disk"
MESSAGE = ('{"role": "user", "content": "..."} (content text, or a list of parts such as {"type": "text", "text": '
           '"..."})')
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
    or a glob's. ConfigError naming `key` and what trainfit reads when there are none (a path with
    parquet, arrow or CSV files never comes here: data/sources/ reads it with `datasets`)."""
    p = Path(path)
    if any(c in path for c in "*?["):
        found = [Path(f) for f in sorted(glob.glob(path, recursive=True)) if Path(f).is_file()]
        files = [f for f in found if f.suffix.lower() in SUFFIXES]
        if not files:
            raise ConfigError(f"{key}={path!r}: the glob matches no data trainfit reads ({_others(found)}; trainfit "
                              f"reads {READS}); check the pattern (use ** for subdirectories).")
    elif p.is_dir():
        found = [f for f in p.rglob("*") if f.is_file()]
        files = sorted(f for f in found if f.suffix.lower() in SUFFIXES)
        if not files:
            raise ConfigError(f"{key}={path!r} is a directory without data trainfit reads ({_others(found)}; trainfit "
                              f"reads {READS}); put the data there or point the key at the files.")
    elif p.is_file():
        if p.suffix.lower() not in SUFFIXES:
            raise ConfigError(f"{key}={path!r} has suffix {p.suffix!r}, which trainfit does not read; it reads "
                              f"{READS}: convert or rename it (raw text -> .txt, one JSON object a line -> .jsonl, "
                              "a table -> .parquet or .csv).")
        files = [p]
    else:
        raise ConfigError(f"{key}={path!r} does not exist; give an existing file, directory or glob "
                          "(e.g. data/*.jsonl).")
    return files


def _others(found: list) -> str:
    """What a path held instead of data, for its error ("it holds .md, .xlsx files")."""
    kinds = sorted({f.suffix.lower() or f.name for f in found})
    return f"it holds {', '.join(kinds[:6])} files" if kinds else "it holds no files"


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


def json_error(e: json.JSONDecodeError, line: Optional[str] = None) -> str:
    """A decoder error as words: 'Expecting value at column 3', 'Unterminated string starting at
    column 203' (that message already ends in 'at'); with the `line` parsed, a stop at its end says so
    (a line cut short, or missing its closing brace)."""
    end = ", the end of the line" if line is not None and e.pos >= len(line.rstrip()) else ""
    return f"{e.msg}{'' if e.msg.endswith(' at') else ' at'} column {e.colno}{end}"


def parse_line(line: str, f: Path, lineno: int, key: str) -> dict:
    """One JSONL line as a record; ConfigError naming the file, the line, the column the parser stopped
    at (counted in the line as an editor shows it, the line break left out) and the fix."""
    line = line.rstrip("\r\n")   # else a missing `}` is reported at column 1 of the "next line"
    try:
        r = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{key}: {f} line {lineno} is not valid JSON ({json_error(e, line)}); "
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
        except json.JSONDecodeError as e:
            if not _json_lines(text):   # one document (a list, a pretty-printed object): its own line and column
                raise ConfigError(f"{key}: {f} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); a "
                                  ".json file holds one JSON document (an object or a list of objects) or one "
                                  "object per line: fix it there.") from None
            obj = None  # JSON lines: read line by line below, an error naming its line
        if isinstance(obj, dict):
            return [obj], [str(f)], size
        if isinstance(obj, list):
            origins = [f"{f}, item {i} (line {line})" for i, line in enumerate(_item_lines(text))]
            for i, r in enumerate(obj):
                if not isinstance(r, dict):
                    raise ConfigError(f"{key} {origins[i]} is a {type(r).__name__}, not an object; each "
                                      "record must be a JSON object such as {\"text\": ...}.")
            return obj, origins, size
        return _lines(text.encode("utf-8").splitlines(keepends=True), f, key, budget, skipped)
    with f.open("rb") as fh:
        return _lines(fh, f, key, budget, skipped)


def _item_lines(text: str) -> list[int]:
    """The line (from 1) on which each item of the JSON list `text` (a valid document) starts, for errors that
    name an item as an editor shows it."""
    decode, space = json.JSONDecoder().raw_decode, re.compile(r"[\s,]*")
    lines, line, at = [], 1, 0
    i = space.match(text, text.index("[") + 1).end()
    while i < len(text) and text[i] != "]":
        line, at = line + text.count("\n", at, i), i
        lines.append(line)
        i = space.match(text, decode(text, i)[1]).end()
    return lines


def _json_lines(text: str) -> bool:
    """Whether a .json file that is not one JSON document is written as JSON lines: its first line holds
    more than an opening bracket or brace."""
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return first.startswith("{") and first != "{"


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


def check_sft_record(r: Any, fmt: str, where: str, auto: bool = False) -> None:
    """An SFT record holds what `fmt` (prompt_completion or messages) trains on, none of it null and each
    field text or chat messages (check_side). `auto`: fmt is the first row's shape (data.format=auto),
    which the error says rather than a setting the user never made."""
    need = ("messages",) if fmt == "messages" else ("prompt", "completion")
    if not isinstance(r, dict) or any(k not in r for k in need):
        keys = sorted(r) if isinstance(r, dict) else type(r).__name__
        if auto:
            raise ConfigError(f"{where} has keys {keys}, but the rows are read as {fmt} rows (the shape of the first "
                              f"row, data.format=auto), which need {list(need)}: give every row the first row's "
                              f"shape, or keep rows of another shape in a file of their own. Accepted shapes: {SHAPES}.")
        raise ConfigError(f"{where} has keys {keys} but data.format={fmt} needs {list(need)}; fix the record or "
                          f"the format. Accepted shapes: {SHAPES}.")
    problem = null_error(where, r, need)
    if problem:
        raise ConfigError(problem)
    for f in need:
        check_side(r[f], where, f)


def described(v: Any) -> str:
    """A value's kind in an error: 'null', 'an object with keys [...]', 'a list', 'a number (3)'."""
    if v is None:
        return "null"
    if isinstance(v, dict):
        return f"an object (a struct) with keys {sorted(v)}"
    if isinstance(v, bool):
        return f"a boolean ({json.dumps(v)})"
    if isinstance(v, (int, float)):
        return f"a number ({v})"
    return {"str": "text", "list": "a list"}.get(type(v).__name__, f"a {type(v).__name__}")


def check_side(v: Any, where: str, field: str) -> None:
    """A field a row is trained on or prompted with (prompt, completion, chosen, rejected): text, a number
    (trained as its text) or chat messages (check_messages); an object or a boolean would be trained on as
    its Python spelling. Null is null_error's."""
    if isinstance(v, list):
        check_messages(v, where, field, empty_ok=field == "prompt")
    elif v is not None and (isinstance(v, bool) or not isinstance(v, (str, int, float))):
        raise ConfigError(f"{where}: `{field}` holds {described(v)}, not text or a list of chat messages "
                          "({role, content}); write it as one of those, or map the column that holds it "
                          "(data.columns).")


def check_messages(msgs: Any, where: str, field: str = "messages", empty_ok: bool = False) -> None:
    """Chat messages as the encoders read them: a list of {role, content} objects, each content text or a
    list of parts ({"type": "text", "text": ...}, image parts); a null content only beside `tool_calls`.
    Refused otherwise, naming the row, the field and the message: a null content would be rendered as an
    empty turn and trained on, an object or a nested list as its Python spelling."""
    if not isinstance(msgs, list) or not (msgs or empty_ok):
        raise ConfigError(f"{where}: `{field}` holds {described(msgs) if msgs != [] else 'no messages'}, not a list "
                          f"of chat messages; write each message as {MESSAGE}, or drop the row.")
    for j, m in enumerate(msgs):
        at = f"{where}: `{field}` item {j}"
        if not isinstance(m, dict):
            raise ConfigError(f"{at} is {described(m)}, not a message; write each message as {MESSAGE}, or drop "
                              "the row.")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str):
            raise ConfigError(f"{at} has role {described(role)}; a message's role is text (system, user, assistant "
                              f"or tool), as in {MESSAGE}: fix it or drop the row.")
        if content is None and not m.get("tool_calls"):
            raise ConfigError(f"{at} ({role}) has no content{' (`content: null`)' if 'content' in m else ''}; "
                              "every message is read as text, and a null one would be an empty turn trained on: "
                              'give it text (an empty turn is written "") or drop the row.')
        parts = content if isinstance(content, list) else None
        if content is not None and parts is None and not isinstance(content, str):
            raise ConfigError(f"{at} ({role}) has content {described(content)}, not text or a list of parts; write "
                              f"it as {MESSAGE}, or map the column that holds the text (data.columns).")
        for k, part in enumerate(parts or []):
            text = part.get("text") if isinstance(part, dict) else None
            if not isinstance(part, dict) or not isinstance(part.get("type"), str) or (
                    part["type"] == "text" and not isinstance(text, str)):
                shown = described(part) + (f" whose text is {described(text)}" if isinstance(part, dict)
                                           and part.get("type") == "text" else "")
                raise ConfigError(f"{at} ({role}) content part {k} is {shown}; a part is {{\"type\": \"text\", "
                                  "\"text\": \"...\"} or an image part ({\"type\": \"image\", ...}): fix it or drop "
                                  "the row.")
