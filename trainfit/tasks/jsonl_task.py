"""A task from rows with `prompt` or `messages`, `answer`, and any metadata: a JSONL file, one row a line,
or any source trainfit/data/sources/ reads (parquet, dataset folders, hub ids), its columns mapped or recognised.

    {"prompt": "What is 6*7?", "answer": 42, "level": "easy"}
    {"messages": [{"role": "user", "content": "Capital of France?"}], "answer": "Paris",
     "completion": "The capital of France is Paris."}

Every field of a row reaches the reward functions (as `fields`). `completion`, when present, is the
SFT target; otherwise the target is the answer. Correctness compares numbers when the answer is a
number (the completion's last number, 1e-6 relative) and exact text otherwise; `task.name: dataset`
checks each row whose answer is mathematical with Math-Verify instead, and any other by normalised text
(math_reward.py). `task.answer_pattern` takes the
answer out of an answer column that carries its reasoning (GSM8K's "... #### 72").

Rows may carry images for vision-language policies, in either convention of SFT data (data/image_chat.py):
image parts in `messages` ({"type": "image", "image": "img/a.png"}) or an `images` list with one
`<image>` placeholder per image in `prompt` or `messages`; paths are relative to the JSONL's folder.
Every image is checked (exists, Pillow reads its header) when the task is built; pixels are read when
an example is used, so a large image task does not sit in memory.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from trainfit.config import ConfigError, TaskConfig
from trainfit.data import sources
from trainfit.data.image_chat import BASE_KEY, PLACEHOLDER, flatten_messages, has_images
from trainfit.data.records import Records, check_messages, load_records
from trainfit.data.text import json_error
from trainfit.models.images import image_size, load_image

from . import math_reward
from .base import EpochShuffle, Example, Task
from .shapes import ImageExample
from .math_reward import looks_mathematical
from .rewards import exact_equal, numeric_equal, parse_number

_ROW_HELP = ('every row needs `prompt` (a string) or `messages` (a list of {"role", "content"}) and '
             '`answer`, e.g. {"prompt": "2+2=", "answer": "4"}')


class _Lines(Records):
    """Rows read from a JSONL file; `lines[i]` is the line number of row i (`origins[i]` its file and line)."""

    lines: list[int]


def read_lines(path: str | Path, key: str, limit_bytes: Optional[int] = None) -> _Lines:
    """Every non-blank line of a JSONL file as an object, with its line number. Errors name the file, line
    and fix; what a row must hold is checked once the rows are in trainfit's shape (`_check_row`).
    `limit_bytes`: stop after the line that reaches this many bytes (a check of a large file's start)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{key}={str(path)!r} does not exist; give the path of a JSONL file ({_ROW_HELP}).")
    if p.suffix.lower() == ".json":   # a JSON list of rows (or JSON lines): read as data.path reads it
        return load_records(str(p), key, limit_bytes=limit_bytes, skipped=[] if limit_bytes else None)
    rows, rows.lines, seen = _Lines(), [], 0
    with p.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            seen += len(line)
            if limit_bytes is not None and seen > limit_bytes and rows:
                break
            if not line.strip():
                continue
            where = f"{key} {p}, line {lineno}"
            line = line.rstrip("\r\n")   # columns as an editor counts them (a missing `}` stops at the line's end)
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{where} is not valid JSON ({json_error(e, line)}); write one "
                                  f"JSON object per line: {_ROW_HELP}.") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{where} is a JSON {type(row).__name__}, not an object; {_ROW_HELP}.")
            rows.append(row)
            rows.lines.append(lineno)
            rows.origins.append(f"{p}, line {lineno}")
    if not rows:
        raise ConfigError(f"{key} {p} has no rows; {_ROW_HELP}.")
    return rows


def read_rows(task_cfg, held_out: bool = False) -> tuple[list[tuple[str, dict]], Optional[str]]:
    """((where, row) for each row of task.path, or of task.eval_path / eval_split with `held_out`, checked;
    the start line saying what was read, or None). `where` names the file and line, or the dataset and row."""
    found = sources.read_rows(task_cfg, "task", held_out=held_out, reader=read_lines)
    if found is None:
        return [], None
    out = []
    for i, row in enumerate(found):
        where = found.at(i)
        _check_row(row, where)
        out.append((where, row))
    return out, found.note if not found.shape.identity else None


def _check_row(row: dict, where: str) -> None:
    if "prompt" not in row and "messages" not in row:
        raise ConfigError(f"{where} has neither `prompt` nor `messages`; {_ROW_HELP}.")
    if "prompt" in row and not isinstance(row["prompt"], str):
        raise ConfigError(f"{where}: `prompt` is a {type(row['prompt']).__name__}, not a string; {_ROW_HELP}.")
    if "messages" in row:
        if not isinstance(row["messages"], list) or not row["messages"]:
            raise ConfigError(f"{where}: `messages` must be a non-empty list of objects with `role` and "
                              f"`content`; {_ROW_HELP}.")
        check_messages(row["messages"], where)   # each message: a role, and content that is text (not null)
    if row.get("answer") is None:
        raise ConfigError(f"{where} has no `answer`; {_ROW_HELP}.")
    if "completion" in row and not isinstance(row["completion"], str):
        raise ConfigError(f"{where}: `completion` (the SFT target) must be a string.")


def answer_text(value: Any) -> str:
    """Answers are strings everywhere; JSON numbers keep their JSON spelling (42, 0.5)."""
    return value if isinstance(value, str) else json.dumps(value)


class JsonlTask(Task):
    """Rows with a prompt and an answer, from a JSONL file (`task.name: jsonl`) or any source task.path
    reads (trainfit/data/sources/). `task.name: dataset` is the same task with each row checked by
    Math-Verify when its answer is mathematical (a number or a math expression) and by normalised text
    otherwise; `jsonl` compares numbers as numbers and other answers as exact text."""

    name = "jsonl"

    def __init__(self, path: str, eval_path: Optional[str] = None, seed: int = 1234,
                 num_eval: int = 200, chat: bool = False, source=None, name: str = "jsonl") -> None:
        super().__init__(seed=seed, num_eval=num_eval, chat=chat)
        self.name = name
        cfg = source or TaskConfig(name=name, path=path, eval_path=eval_path, seed=seed, num_eval=num_eval, chat=chat)
        self._pattern = _compile(cfg.answer_pattern)
        rows, note = read_rows(cfg)
        held, held_note = read_rows(cfg, held_out=True)
        self.notes = [n for n in (note, held_note) if n]
        if cfg.eval_path or cfg.eval_split:
            train_rows, eval_rows = rows, held[:num_eval]
        else:
            if num_eval >= len(rows):
                raise ConfigError(
                    f"task.num_eval={num_eval} would hold out all {len(rows)} rows of {path}, leaving none "
                    f"to train on; set task.num_eval below {len(rows)} or give task.eval_path.")
            order = list(range(len(rows)))
            random.Random(f"trainfit-jsonl-split|{seed}").shuffle(order)
            cut = len(rows) - num_eval
            train_rows = [rows[j] for j in sorted(order[:cut])]
            eval_rows = [rows[j] for j in order[cut:]]
        self._train = [self._to_example(row, path, where) for where, row in train_rows]
        self._eval = [self._to_example(row, eval_path or path, where) for where, row in eval_rows]
        self.num_train = len(self._train)
        # Each pass over the data is a fresh seeded permutation (consecutive epochs differ).
        self._order = EpochShuffle(self.num_train, f"trainfit-jsonl|{seed}")
        self.math = name == "dataset" and self._mathematical()

    def _mathematical(self) -> bool:
        """Whether any answer is mathematical. Each row is judged on its own (math_reward.answer_equal):
        Math-Verify where its answer is math, normalised text elsewhere; the start line says which."""
        answers = [_item_example(ex).answer for ex in self._train + self._eval]
        text = [a for a in answers if not looks_mathematical(a)]
        hint = "" if self._pattern else "; if the answers carry their reasoning, set task.answer_pattern"
        if not text:
            math_reward.require()
            self.notes.append("answers are mathematical: the default reward and accuracy use math_verify")
            return True
        rule = ("normalised text (the last \\boxed{} or the whole completion against the answer; \\text{}, $, "
                f"case and spacing ignored){hint}")
        if len(text) == len(answers):
            self.notes.append(f"no answer is mathematical (e.g. {text[0][:60]!r}): the default reward and "
                              f"accuracy compare {rule}")
            return False
        math_reward.require()
        self.notes.append(f"{len(answers) - len(text)} of {len(answers)} answers are mathematical and checked by "
                          f"math_verify; the other {len(text)} (e.g. {text[0][:60]!r}) by {rule}")
        return True

    def _answer(self, row: dict, where: str) -> tuple[str, str]:
        """(the answer, the SFT target). task.answer_pattern takes the answer out of a longer text, which
        stays the target."""
        full = answer_text(row["answer"])
        if self._pattern is None:
            return full, row.get("completion", full)
        m = self._pattern.search(full)
        if m is None:
            raise ConfigError(f"{where}: task.answer_pattern {self._pattern.pattern!r} does not match its answer "
                              f"{full[:120]!r}; fix the pattern (its first group is the answer) or the row.")
        return (m.group(1) if self._pattern.groups else m.group(0)).strip(), row.get("completion", full)

    def _to_example(self, row: dict, path: str, where: str) -> "Example | _ImageRow":
        answer, target = self._answer(row, where)
        fields = dict(row, answer=answer)
        images: list[Path] = []
        if has_images(row):  # text with `<image>` placeholders + the image paths, checked now
            row, images = _placeholder_row(row, Path(path).parent, where)
        # A row may carry both; the chat setting decides which one the model sees.
        if "messages" in row and (self.chat or "prompt" not in row):
            ex = Example(None, [dict(m) for m in row["messages"]], answer, target, fields)
        else:
            ex = self.make_example(row["prompt"], answer, target, fields)
        return _ImageRow(ex, images) if images else ex

    def train_example(self, i: int) -> Example:
        return _loaded(self._train[self._order(i)])

    def eval_examples(self) -> list[Example]:
        return [_loaded(ex) for ex in self._eval]

    def reward_funcs(self):
        return [("math_verify" if self.math else "correctness", self.correctness_reward)]

    def is_correct(self, completion: str, ex: Example) -> bool:
        if self.name == "dataset":   # decided per row
            return math_reward.answer_equal(completion, ex.answer)
        if parse_number(ex.answer) is not None:
            return numeric_equal(completion, ex.answer)
        return exact_equal(completion, ex.answer)


def _compile(pattern: Optional[str]):
    if not pattern:
        return None
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ConfigError(f"task.answer_pattern={pattern!r} is not a valid regular expression ({e}); e.g. "
                          "'####\\s*(.+)' takes what follows GSM8K's ####.") from None


def _item_example(item: "Example | _ImageRow") -> Example:
    return item.example if isinstance(item, _ImageRow) else item


@dataclass(frozen=True)
class _ImageRow:
    """A row with images as stored: its example (text with `<image>` placeholders) and image paths."""

    example: Example
    paths: list


def _loaded(item: "Example | _ImageRow") -> Example:
    """The example as the stages use it: an ImageExample with its images read (RGB PIL)."""
    if not isinstance(item, _ImageRow):
        return item

    ex = item.example
    return ImageExample(ex.prompt, ex.messages, ex.answer, ex.target, ex.fields,
                        images=[load_image(p, "task.path") for p in item.paths])


def _placeholder_row(row: dict, base: Path, where: str) -> tuple[dict, list[Path]]:
    """The row with its images as `<image>` placeholders in the text (image parts flattened, as
    data/image_chat.py does for SFT rows) and the image paths in order, each one checked readable."""
    from types import SimpleNamespace


    listed = row.get("images") or row.get("image") or []
    listed = [listed] if isinstance(listed, str) else list(listed)
    if "messages" in row:
        marked = {**row, "images": listed, BASE_KEY: str(base)}
        messages, images = flatten_messages(marked, SimpleNamespace(placeholder=PLACEHOLDER), where)
        row = {**row, "messages": messages}
    else:
        if row["prompt"].count(PLACEHOLDER) != len(listed):
            raise ConfigError(f"{where}: the row lists {len(listed)} images but its prompt holds "
                              f"{row['prompt'].count(PLACEHOLDER)} {PLACEHOLDER} placeholders; put one "
                              f"{PLACEHOLDER} where each image goes.")
        if not all(isinstance(p, str) and p for p in listed):
            raise ConfigError(f"{where}: `images` must be a list of file paths (relative to the JSONL), "
                              f"got {listed!r}.")
        images = [Path(p) if Path(p).is_absolute() else base / p for p in listed]
    for p in images:
        image_size(p, where)   # exists and Pillow can read it: an error now, not mid-run
    return row, images
