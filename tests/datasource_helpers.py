"""Local datasets for the data-source tests: the same rows written as parquet, an Arrow save_to_disk folder,
CSV, JSONL or one JSON document, and a hub dataset's entry in the datasets cache (what `load_dataset` leaves there after a
download), so hub ids resolve offline. Nothing is downloaded."""

from __future__ import annotations

import json
from pathlib import Path

FORMATS = ("parquet", "arrow", "csv", "jsonl")


def use_cache(monkeypatch, root: Path) -> Path:
    """An empty datasets cache under `root`, offline: for this process (datasets read its settings at
    import) and for the CLI runs it starts. Returns the cache folder."""
    import datasets

    cache = root / "hf-datasets"
    cache.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    return cache


def write(rows: list[dict], fmt: str, base: Path) -> str:
    """`rows` as a dataset of format `fmt` at base.<suffix> (arrow: a save_to_disk folder; json: one JSON
    document, a list of objects over several lines); its path."""
    import datasets

    datasets.disable_progress_bars()
    if fmt == "json":
        path = base.with_suffix(".json")
        path.write_text(json.dumps(rows, indent=1))
        return str(path)
    if fmt == "jsonl":
        path = base.with_suffix(".jsonl")
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return str(path)
    ds = datasets.Dataset.from_list(rows)
    if fmt == "parquet":
        ds.to_parquet(str(base.with_suffix(".parquet")))
        return str(base.with_suffix(".parquet"))
    if fmt == "csv":
        ds.to_csv(str(base.with_suffix(".csv")), index=False)
        return str(base.with_suffix(".csv"))
    ds.save_to_disk(str(base))
    return str(base)


def cache_hub_dataset(cache: Path, repo_id: str, config: str, splits: dict[str, list[dict]], work: Path) -> Path:
    """Write `splits` into the datasets cache as `load_dataset(repo_id, config)` leaves a download there
    (<cache>/<org>___<name>/<config>/0.0.0/<hash>/: Arrow files + dataset_info.json), built by datasets'
    own parquet builder from local parquet files."""
    import datasets
    from datasets.data_files import DataFilesDict
    from datasets.naming import camelcase_to_snakecase
    from datasets.packaged_modules.parquet.parquet import Parquet

    work.mkdir(parents=True, exist_ok=True)
    files = {name: [write(rows, "parquet", work / f"{config}-{name}")] for name, rows in splits.items()}
    org, name = repo_id.split("/")
    folder = f"{org}___{camelcase_to_snakecase(name)}"   # as datasets names it: trl-lib___capybara
    builder = Parquet(cache_dir=str(work / "build"), dataset_name=name, config_name=config, hash="0" * 16,
                      data_files=DataFilesDict.from_patterns(files, base_path=str(work)))
    out = cache / folder / config / "0.0.0" / ("0" * 16)
    datasets.disable_progress_bars()
    builder.download_and_prepare(output_dir=str(out))
    return out


def gsm8k_rows(n: int, start: int = 0) -> list[dict]:
    """GSM8K's columns: a word problem, and a worked answer ending in "#### <number>"."""
    rows = []
    for i in range(start, start + n):
        a, b = 2 + i % 7, 3 + i % 5
        rows.append({"question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
                     "answer": f"He has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}"})
    return rows


def capybara_rows(n: int, start: int = 0) -> list[dict]:
    """trl-lib/Capybara's columns: source, OpenAI-style messages, num_turns."""
    return [{"source": "test", "num_turns": 1,
             "messages": [{"role": "user", "content": f"Say {i} twice."},
                          {"role": "assistant", "content": f"{i} {i}"}]} for i in range(start, start + n)]
