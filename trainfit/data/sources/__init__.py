"""Data from where users keep it: the one door through which stages, tasks and the planner read rows.

    rows = read_rows(cfg.data, "sft")                  # data.path (+ subset, split, revision, columns)
    held = read_rows(cfg.data, "sft", held_out=True)   # eval_path / eval_split, or None
    rows.note        # "read 7473 rows of openai/gsm8k[main] train: prompt <- question, answer <- answer (...)"
    rows[i]          # a row in trainfit's shapes (trainfit/data/sources/shapes.py), converted when read
    rows.to_list()   # every row; rows.select(indices) a subset; rows.table the Arrow dataset or JSONL list

JSONL, .json and .txt paths (files, folders, globs) are read by trainfit.data exactly as before; rows in
trainfit's own shapes pass unchanged. Everything else (parquet, arrow, csv/tsv, save_to_disk folders,
folders of those, hub ids) is read with Hugging Face `datasets` (locate.py), memory-mapped: rows are
converted one at a time, and SFT tokenizes the Arrow table with datasets.map (encode.py). Pretraining can
stream instead (stream.py). `datasets` is imported only for those paths (its import takes about a second).
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional, Sequence

from trainfit.config import ConfigError
from trainfit.data.text import Records, load_records, origin_of

from .locate import kind_of, local_only, open_split
from .shapes import Shape, recognise

__all__ = ["Rows", "kind_of", "local_only", "open_stream", "read_rows", "require_datasets", "section_name"]


def section_name(section) -> str:
    """`data` or `task`: the config section a DataConfig / TaskConfig is (for keys in messages)."""
    return "task" if type(section).__name__ == "TaskConfig" else "data"


def require_datasets(key: str, path: str) -> None:
    try:
        import datasets  # noqa: F401
    except ImportError:
        raise ConfigError(f"{key}={path!r} is read with Hugging Face `datasets`, a trainfit dependency this "
                          "environment lacks: `pip install datasets` (JSONL and .txt files need nothing more).") from None


class Rows(Sequence):
    """A source's rows in trainfit's shapes: `table` is the JSONL list or the Arrow dataset (memory-mapped),
    `shape` converts a row when it is read. Positions are the source's own (errors name them)."""

    def __init__(self, table: Any, shape: Shape, label: str, key: str, positions: Optional[list] = None,
                 source: Any = None):
        self.table, self.shape, self.label, self.key = table, shape, label, key
        self.positions = positions
        self._source = source if source is not None else table   # the rows as read, before any select

    @property
    def is_dataset(self) -> bool:
        return not isinstance(self.table, list)

    @property
    def note(self) -> str:
        n = len(self)
        return f"read {n:,} row{'s' if n != 1 else ''} of {self.label}: {self.shape.describe()}"

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if self.shape.identity:   # rows in trainfit's shapes pass as they are (no name to make)
            return self.table[i]
        return self.shape(self.table[i], self.position(i), self.at(i))

    def __iter__(self) -> Iterator[dict]:
        if self.shape.identity:
            yield from self.table
            return
        for i, row in enumerate(self.table):
            yield self.shape(row, self.position(i), self.at(i))

    def position(self, i: int) -> int:
        return self.positions[i] if self.positions is not None else i

    def origin(self, i: int) -> str:
        """Where row i was read: the file and line (JSONL, .json), else the source's row position."""
        pos = self.position(i)
        return origin_of(self._source, pos) or f"{self.label}, row {pos}"

    def at(self, i: int) -> str:
        """How errors name row i: its key and origin ("data.path train.jsonl, line 31")."""
        return f"{self.key} {self.origin(i)}"

    def to_list(self) -> Records:
        """Every row, each with its origin (errors name the row of the user's file after any split); a JSONL
        list already in trainfit's shapes is returned as it is."""
        if self.shape.identity and self.positions is None and isinstance(self.table, Records):
            return self.table
        return Records(list(self), [self.origin(i) for i in range(len(self))])

    def select(self, indices: Sequence[int]) -> "Rows":
        indices = list(indices)
        table = self.table.select(indices) if self.is_dataset else Records([self.table[i] for i in indices])
        return Rows(table, self.shape, self.label, self.key, [self.position(i) for i in indices], self._source)


def _where(section, held_out: bool) -> Optional[tuple[str, str, Optional[str], str]]:
    """(path, its key, split, the split's key) of the training rows or the held-out ones (None: none)."""
    s = section_name(section)
    if not held_out:
        return section.path, f"{s}.path", section.split, f"{s}.split"
    if not section.eval_path and not section.eval_split:
        return None
    key = f"{s}.eval_path" if section.eval_path else f"{s}.path"
    return section.eval_path or section.path, key, section.eval_split, f"{s}.eval_split"


def _check_revision(section, key: str, path: str) -> None:
    """A revision is a hub dataset's: given with local data only, it would be ignored without a word."""
    s = section_name(section)
    if section.revision and not any(kind_of(p) == "hub" for p in (section.path, section.eval_path) if p):
        raise ConfigError(f"{s}.revision={section.revision!r} picks a version of a hub dataset, but {key}={path!r} "
                          f"is local data, which has none: remove {s}.revision, or give {key} a hub id (org/name).")


def read_rows(section, want: str, *, held_out: bool = False,
              reader: Optional[Callable[[str, str], list]] = None) -> Optional[Rows]:
    """The rows of a DataConfig / TaskConfig section for `want` (text | sft | pairs | task): its training
    rows, or with `held_out` its eval_path / eval_split rows (None when it has neither). `reader(path,
    key)` reads plain (JSONL/.txt) paths, default trainfit.data.text.load_records."""
    found = _where(section, held_out)
    if found is None:
        return None
    path, key, split, split_key = found
    s = section_name(section)
    text_field = getattr(section, "text_field", "text")
    if kind_of(path) == "plain":
        for name, value in (("subset", section.subset), ("revision", section.revision), ("split", split)):
            if value:
                what = split_key if name == "split" else f"{s}.{name}"
                raise ConfigError(f"{what}={value!r} applies to datasets with {name}s (hub ids, dataset folders), "
                                  f"but {key}={path!r} is a JSONL/text file: remove {what}, or give {key} a dataset.")
        if reader is None:
            records = load_records(path, key=key)
        else:
            records = reader(path, key)
        # Named by the first row's file and line: the shape (or an error about it) is the first row's.
        shape = recognise(records[0], want, section.columns, f"{key} {origin_of(records, 0) or path}", s, text_field,
                          plain=True)
        return Rows(records, shape, path, key)
    require_datasets(key, path)
    _check_revision(section, key, path)
    ds, label = open_split(path, subset=section.subset, split=split, revision=section.revision, key=key,
                           split_key=split_key)
    return Rows(ds, recognise(ds[0], want, section.columns, f"{key} {label}", s, text_field), label, key)


def open_stream(section, want: str = "text") -> tuple[Callable[[], Any], Shape, str]:
    """(a function opening the training split as a datasets IterableDataset from its start, the Shape of
    its rows, its label), for data.streaming. Plain files stream through datasets' json/text builders."""
    s = section_name(section)
    key = f"{s}.path"
    require_datasets(key, section.path)
    _check_revision(section, key, section.path)

    def open_():
        return open_split(section.path, subset=section.subset, split=section.split, revision=section.revision,
                          key=key, split_key=f"{s}.split", streaming=True)

    ds, label = open_()
    first = next(iter(ds), None)
    if first is None:
        raise ConfigError(f"{key}={section.path!r} streams no rows; check the path and {s}.split.")
    shape = recognise(first, want, section.columns, f"{key} {label}", s, getattr(section, "text_field", "text"))
    return (lambda: open_()[0]), shape, label
