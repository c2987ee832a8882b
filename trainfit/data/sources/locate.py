"""Opening a data path with Hugging Face `datasets`: what kind of path it is, the split, and errors users can act on.

    kind_of("data/train.jsonl")       -> "plain"   (.txt/.jsonl/.json: trainfit.data reads them, as always)
    kind_of("data/train.parquet")     -> "file"    (parquet, arrow, csv, tsv: datasets' packaged builders)
    kind_of("data/saved")             -> "disk"    (a save_to_disk folder: load_from_disk)
    kind_of("data/shards")            -> "folder"  (a folder with parquet/arrow/csv files, or a hub repo's clone)
    kind_of("data/*.parquet")         -> "glob"
    kind_of("openai/gsm8k")           -> "hub"     (load_dataset with the subset, revision and HF's cache/token)

A hub id is read as `datasets` reads it: the HF cache (HF_DATASETS_CACHE), HF_HUB_OFFLINE and the token of
`hf auth login` / HF_TOKEN. Offline (or while the planner measures, `local_only`), only the cache is read.
"""

from __future__ import annotations

import contextlib
import csv
import glob
import json
import os
import re
from pathlib import Path
from typing import Any, Optional

from trainfit.core import quiet
from trainfit.config import ConfigError
from trainfit.data.records import DATASET_SUFFIXES, SUFFIXES as PLAIN

BUILDERS = {s: "csv" if s == ".tsv" else s[1:] for s in DATASET_SUFFIXES}   # parquet, arrow, csv (and tsv)
# Streaming reads plain files through datasets too: whole .txt files are one row, as trainfit.data reads them.
STREAM_BUILDERS = {".jsonl": "json", ".json": "json", ".txt": "text", **BUILDERS}
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_local_only = False


@contextlib.contextmanager
def local_only():
    """Read hub datasets from the local cache only (the planner downloads nothing)."""
    global _local_only
    before, _local_only = _local_only, True
    try:
        yield
    finally:
        _local_only = before


def _offline() -> bool:
    return _local_only or any(os.environ.get(k, "").strip().lower() in ("1", "true", "yes", "on")
                              for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _data_files(d: Path) -> list[Path]:
    return sorted(f for f in d.rglob("*") if f.is_file() and ".git" not in f.parts and not f.name.startswith("cache-"))


def kind_of(path: str) -> str:
    """plain | file | disk | folder | glob | hub (see the module docstring). A path that exists nowhere
    and is no hub id is "plain", so trainfit.data names it as missing."""
    p = Path(path).expanduser()
    if any(c in path for c in "*?["):
        files = [f for f in glob.glob(path, recursive=True) if Path(f).is_file()]
        return "glob" if any(Path(f).suffix.lower() in BUILDERS for f in files) else "plain"
    if p.is_dir():
        if (p / "dataset_dict.json").is_file() or ((p / "state.json").is_file() and (p / "dataset_info.json").is_file()):
            return "disk"
        return "folder" if any(f.suffix.lower() in BUILDERS for f in _data_files(p)) else "plain"
    if p.is_file():
        return "file" if p.suffix.lower() in BUILDERS else "plain"
    if _HUB_ID.match(path) and Path(path).suffix.lower() not in PLAIN + tuple(BUILDERS):
        return "hub"
    return "plain"


def label_of(path: str, subset: Optional[str], split: Optional[str]) -> str:
    """How messages name a dataset: `openai/gsm8k[main] train` (a file's one split goes unnamed)."""
    return f"{path}{f'[{subset}]' if subset else ''}{f' {split}' if split else ''}"


def open_split(path: str, *, subset: Optional[str], split: Optional[str], revision: Optional[str], key: str,
               split_key: str, streaming: bool = False) -> tuple[Any, str]:
    """(the split's Dataset or IterableDataset, its label) for a path of any kind but "plain" (and, when
    streaming, "plain" files too). Every failure is a ConfigError naming the key, the dataset and the fix."""
    import datasets

    quiet.adopt("datasets")   # its cache notices go to warnings.log with the other libraries' messages
    kind = kind_of(path)
    if kind != "hub":  # local reads take a moment; a hub download keeps datasets' progress bars
        datasets.disable_progress_bars()
    if subset and kind in ("file", "glob", "plain"):
        raise ConfigError(f"{key}={path!r} is a file, which has no configurations; remove the subset setting "
                          f"({key.split('.')[0]}.subset={subset!r}) or point {key} at a hub id or dataset folder.")
    try:
        if kind == "disk":
            ds, name, names = _open_disk(datasets, path, subset, split, key, split_key)
            ds = ds.to_iterable_dataset() if streaming else ds
        else:
            found = _load(datasets, path, kind, subset, revision, streaming, key)
            names = list(found.keys())
            name = _choose(names, path, subset, split, key, split_key)
            ds = found[name]
    except ConfigError:
        raise
    except Exception as e:  # datasets and pyarrow report bad input in many exception types
        raise ConfigError(_explain(e, path, kind, subset, key, split_key)) from None
    if getattr(ds, "num_rows", None) == 0:
        raise ConfigError(_empty(path, subset, name, names, key, split_key))
    if not streaming:
        _check_quotes(ds, path, kind, key)
    return ds, label_of(path, subset, name if kind in ("hub", "disk", "folder") or split else None)


def _check_quotes(ds, path: str, kind: str, key: str) -> None:
    """pandas (datasets' CSV reader) reads a quote opened in one field and closed rows later as one value
    holding those rows, in silence; Python's csv module in strict mode refuses it. Checked only when some text
    value spans lines (the sign of it), since quoted values with line breaks are legitimate."""
    import pyarrow as pa
    import pyarrow.compute as pc

    p = Path(path).expanduser()
    files = ([Path(f) for f in sorted(glob.glob(path, recursive=True))] if kind == "glob" else
             _data_files(p) if kind == "folder" else [p] if kind == "file" else [])
    files = [f for f in files if f.suffix.lower() in (".csv", ".tsv")]
    if not files:
        return
    texts = [c for c in ds.data.table.columns if pa.types.is_string(c.type) or pa.types.is_large_string(c.type)]
    if not any(pc.any(pc.match_substring(c, "\n")).as_py() for c in texts):
        return
    for f in files:
        with f.open(newline="", encoding="utf-8", errors="replace") as fh:
            reader, done = csv.reader(fh, delimiter="\t" if f.suffix.lower() == ".tsv" else ",", strict=True), 0
            try:
                for _ in reader:
                    done = reader.line_num
            except csv.Error as e:
                raise ConfigError(f"{key}={path!r}: {f} has an unbalanced quote: the field that starts on line {done + 1} "
                                  f"opens a quote that closes only on line {reader.line_num} ({e}), so the lines "
                                  "between would be read as one value. Close the quote, or write a quote inside a "
                                  'field as "".') from None


def _open_disk(datasets, path: str, subset: Optional[str], split: Optional[str], key: str, split_key: str):
    """(the split, its name, the split names) of a save_to_disk folder: a DatasetDict's split folder alone
    (datasets cannot load a dict with an empty split at all), or a saved Dataset as its one split."""
    root = Path(path).expanduser()
    if subset:
        raise ConfigError(f"{key}={path!r} is a save_to_disk folder, which has no configurations; remove "
                          f"{key.split('.')[0]}.subset={subset!r}.")
    if (root / "dataset_dict.json").is_file():
        names = list(json.loads((root / "dataset_dict.json").read_text())["splits"])
        name = _choose(names, path, subset, split, key, split_key)
        folder = root / name
    else:
        state = json.loads((root / "state.json").read_text())
        names, folder = [state.get("_split") or "train"], root
        name = _choose(names, path, subset, split, key, split_key)
    if not json.loads((folder / "state.json").read_text()).get("_data_files"):
        raise ConfigError(_empty(path, subset, name, names, key, split_key))
    return datasets.load_from_disk(str(folder)), name, names


def _load(datasets, path: str, kind: str, subset: Optional[str], revision: Optional[str], streaming: bool, key: str):
    if kind == "hub":
        with _hub_offline() if _offline() else contextlib.nullcontext():
            return datasets.load_dataset(path, subset, revision=revision, streaming=streaming)
    if kind == "folder":
        return datasets.load_dataset(str(Path(path).expanduser()), subset, streaming=streaming)
    p = Path(path).expanduser()
    if any(c in path for c in "*?["):
        files = sorted(f for f in glob.glob(path, recursive=True) if Path(f).is_file())
    else:  # a file, or (streaming plain files) a folder of them
        files = [str(f) for f in _data_files(p)] if p.is_dir() else [str(p)] if p.is_file() else []
    if not files:
        raise ConfigError(f"{key}={path!r} does not exist or holds no files; give an existing file, folder or glob.")
    table = STREAM_BUILDERS if streaming else BUILDERS
    builders = {table.get(Path(f).suffix.lower()) for f in files} - {None}
    if len(builders) != 1:
        raise ConfigError(f"{key}={path!r} matches files of {len(builders) or 'no'} readable kinds "
                          f"({', '.join(sorted({Path(f).suffix for f in files})) or 'none'}); point it at files "
                          f"of one kind ({', '.join(table)}).")
    builder = builders.pop()
    files = [f for f in files if table.get(Path(f).suffix.lower()) == builder]   # a README beside them is no data
    kwargs: dict = {}
    if builder == "csv" and all(f.lower().endswith(".tsv") for f in files):
        kwargs["sep"] = "\t"
    if builder == "text":
        kwargs["sample_by"] = "document"
    return datasets.load_dataset(builder, data_files={"train": files}, streaming=streaming, **kwargs)


@contextlib.contextmanager
def _hub_offline():
    """datasets reads HF_HUB_OFFLINE once, at import: the planner's local_only (and an HF_HUB_OFFLINE set
    after that import) take effect by setting its flag for the call. Offline, a hub id resolves from the
    datasets cache alone (datasets' CachedDatasetModuleFactory)."""
    from datasets import config

    before, config.HF_HUB_OFFLINE = config.HF_HUB_OFFLINE, True
    try:
        yield
    finally:
        config.HF_HUB_OFFLINE = before


def _choose(names: list, path: str, subset: Optional[str], split: Optional[str], key: str, split_key: str) -> str:
    """The split to read: `split`, else train, else the only one."""
    if split is None:
        if "train" in names or len(names) != 1:
            split = "train"
        else:
            split = names[0]
    if split not in names:
        raise ConfigError(f"{key}={path!r}{f' (subset {subset})' if subset else ''} has no split {split!r}; its "
                          f"splits are {', '.join(names)}: set {split_key} to one of them.")
    return split


def _empty(path: str, subset: Optional[str], split: str, names: list, key: str, split_key: str) -> str:
    return (f"{key}: split {split!r} of {label_of(path, subset, None)} has no rows (its splits: {', '.join(names)}); "
            f"choose a split with rows ({split_key}) or fix the data.")


def _root(e: BaseException) -> BaseException:
    while e.__cause__ is not None or e.__context__ is not None:
        nxt = e.__cause__ or e.__context__
        if nxt is e:
            break
        e = nxt
    return e


def _explain(e: Exception, path: str, kind: str, subset: Optional[str], key: str, split_key: str) -> str:
    """One paragraph for a failed load: what went wrong with which dataset, and the fix."""
    from datasets import config

    root = _root(e)
    msg = " ".join(str(e).split()) or type(e).__name__
    why = " ".join(str(root).split())[:300] or type(root).__name__
    where = f"{key}={path!r}"
    section = key.split(".")[0]
    if kind == "hub":
        cache = config.HF_DATASETS_CACHE
        if "Available configs in the cache" in msg or "Couldn't find cache" in msg:
            return (f"{where}: subset {subset!r} is not in the local datasets cache ({cache}) and the hub cannot be "
                    f"reached ({msg}); set {section}.subset to a cached one, or run once online.")
        if isinstance(e, ConnectionError) or "offline" in msg.lower() or "Couldn't reach" in msg:
            return (f"{where} is a hub dataset that is not in the local datasets cache ({cache}) and cannot be "
                    f"downloaded now (" + ("HF_HUB_OFFLINE is set" if _offline() else "the hub cannot be reached")
                    + f"): run once online so datasets caches it, or point {key} at a local copy (parquet, JSONL "
                    "or a save_to_disk folder).")
        if "Config name is missing" in msg or "BuilderConfig" in msg:
            return f"{where}: {msg} Set {section}.subset to one of them."
        if type(e).__name__ == "DatasetNotFoundError" or "doesn't exist on the Hub" in msg:
            return (f"{where}: {msg} Check the id (org/name); for a private or gated dataset log in with "
                    "`hf auth login` or set HF_TOKEN.")
    if "corresponds to no data" in msg or "BatchSize must be greater than 0" in why:
        split = re.search(r'Instruction "([^"]+)" corresponds to no data', msg)
        return (f"{where}: its {repr(split.group(1)) + ' ' if split else ''}split has no rows (its files hold none, "
                f"or one of them is empty); remove the empty file, add rows, or choose a split with rows ({split_key}).")
    if "EOF inside string" in why:
        row = re.search(r"starting at row (\d+)", why)
        return (f"{where}: a quoted field {f'opened on line {int(row.group(1)) + 1} ' if row else ''}is never closed (an "
                'unbalanced " in a CSV file); close the quote, or write a quote inside a field as "".')
    if type(root).__name__ == "EmptyDataError":
        return f"{where}: a CSV file there is empty (no header, no rows); remove it or write its rows."
    if "Parquet magic bytes" in why or "Parquet file size is 0" in why:
        return (f"{where}: a file there is not a parquet file ({why}); check how it was written (a CSV or JSON "
                "file saved with a .parquet name?) and give it the suffix of what it holds.")
    if kind == "folder" and subset:
        return f"{where}: {msg}; check {section}.subset against the folder's configurations."
    return (f"{where} could not be read by datasets ({type(root).__name__}: {why}); check that the files hold "
            "what their suffix says and are complete.")
