"""The benchmarks and reliability pages, from the JSON files in bench/results (written by the bench/ scripts).

The measured tables of the README are re-rendered from bench/results/readme_numbers with the function
that writes them into the README (bench/readme_numbers.py), so both show the same numbers. A result file
that is not there yet (another script has not run) is said to be "not measured yet", never invented."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench import readme_numbers
from docs.gen.tables import table

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
# Where the reliability numbers come from: the fault harness (python -m bench.faults).
FAULTS = RESULTS / "faults.json"
NOT_MEASURED = "Not measured yet"


def measured(config: str, results: Path = RESULTS) -> str:
    """The table of one example of `make readme-numbers`, exactly as the README shows it."""
    records = [json.loads(p.read_text()) for p in sorted((results / "readme_numbers").glob(f"{config}-s*.json"))]
    return readme_numbers.render(config, records) if records else f"{NOT_MEASURED}."


def measured_tables(results: Path = RESULTS) -> str:
    """One section per example of `make readme-numbers`."""
    parts = []
    for config in readme_numbers.CONFIGS:
        parts += [f"### {config}", "", f"`{readme_numbers.CONFIGS[config]}`, "
                  f"`make readme-numbers CONFIGS={config}`:", "", measured(config, results), ""]
    return "\n".join(parts)


def _scalars(d: dict) -> list[tuple[str, Any]]:
    return [(k, v) for k, v in d.items() if isinstance(v, (int, float, str, bool)) and len(str(v)) <= 300]


def result_files(results: Path = RESULTS) -> str:
    """Every JSON file of bench/results: what it measured, the command that wrote it and its top-level numbers."""
    parts = []
    for path in sorted(results.glob("*.json")):
        data = json.loads(path.read_text())
        parts += [f"### {path.stem}", "", f"`bench/results/{path.name}`", ""]
        if isinstance(data, list):
            data = {"records": len(data), **{k: v for k, v in (data[0] if data and isinstance(data[0], dict)
                                                                else {}).items() if k in ("what", "command")}}
        rows = _scalars(data)
        if rows:
            parts += [table(["field", "value"], ([f"`{k}`", v] for k, v in rows)), ""]
    return "\n".join(parts)


def _records_table(records: list[dict]) -> str:
    keys = list(dict.fromkeys(k for r in records for k, v in r.items() if not isinstance(v, (dict, list))))
    return table(keys, ([r.get(k, "") for k in keys] for r in records))


def reliability(faults: Path = FAULTS) -> str:
    """The fault harness's table: each injected fault and what the run did; "not measured yet" without it."""
    if not faults.is_file():
        return (f"{NOT_MEASURED}: `bench/results/{faults.name}` is written by `python -m bench.faults`, "
                "which has not been run on this version.")
    data = json.loads(faults.read_text())
    records = data if isinstance(data, list) else next((v for v in data.values() if isinstance(v, list)
                                                        and v and isinstance(v[0], dict)), [])
    parts = []
    if isinstance(data, dict) and _scalars(data):
        parts += [table(["field", "value"], ([f"`{k}`", v] for k, v in _scalars(data))), ""]
    if records and isinstance(records[0], dict):
        parts += [_records_table(records), ""]
    return "\n".join(parts) or f"{NOT_MEASURED}: `bench/results/{faults.name}` holds no rows."
