"""What the fault-injection harness compares between a killed-and-resumed run and the uninterrupted one:
the final weights (every tensor of every .safetensors file, byte for byte, and whether each is finite) and
metrics.jsonl (each train step's row exactly once, the train and eval rows' values equal, timings aside).

Pure Python and numpy: the harness forks its runs from its own process, and a torch math call in the parent
would start the CPU thread pool that a forked child must not inherit.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

# Values that measure the machine, not the training: they differ between any two runs.
TIMING_WORDS = ("time", "per_s", "rss", "gib", "seconds", "_ms", "elapsed", "wait", "throughput",
                "latency", "util")
COMPARED_KINDS = ("train", "eval")
FLOAT_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16}


def read_safetensors(path: Path) -> dict[str, tuple[str, bytes]]:
    """{tensor name: (dtype, raw bytes)} of a .safetensors file (its 8-byte header length, JSON header, data)."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    return {k: (v["dtype"], data[v["data_offsets"][0]:v["data_offsets"][1]])
            for k, v in header.items() if k != "__metadata__"}


def non_finite(dtype: str, buf: bytes) -> int:
    """How many values of a tensor's raw bytes are NaN or infinite (0 for integer tensors)."""
    if dtype in FLOAT_DTYPES:
        return int((~np.isfinite(np.frombuffer(buf, dtype=FLOAT_DTYPES[dtype]))).sum())
    if dtype == "BF16":   # the top half of a float32: exponent bits all ones is inf or NaN
        bits = np.frombuffer(buf, dtype=np.uint16)
        return int(((bits & 0x7F80) == 0x7F80).sum())
    return 0


def weight_files(run_dir: Path) -> dict[str, Path]:
    """Every final .safetensors of a run, by its path relative to the run dir (checkpoints left out)."""
    return {str(p.relative_to(run_dir)): p for p in sorted(Path(run_dir).rglob("*.safetensors"))
            if "checkpoints" not in p.relative_to(run_dir).parts}


def compare_weights(ref_dir: Path, got_dir: Path) -> dict:
    """{"files", "tensors", "differing": [names], "missing": [names], "non_finite": [names]}: the run in
    `got_dir` against the one in `ref_dir`."""
    ref, got = weight_files(ref_dir), weight_files(got_dir)
    out = {"files": len(ref), "tensors": 0, "differing": [], "missing": sorted(set(ref) ^ set(got)),
           "non_finite": []}
    for rel in sorted(set(ref) & set(got)):
        a, b = read_safetensors(ref[rel]), read_safetensors(got[rel])
        out["missing"] += [f"{rel}:{k}" for k in sorted(set(a) ^ set(b))]
        for k in sorted(set(a) & set(b)):
            out["tensors"] += 1
            if a[k] != b[k]:
                out["differing"].append(f"{rel}:{k}")
            if non_finite(*b[k]):
                out["non_finite"].append(f"{rel}:{k}")
    return out


def read_rows(path: Path) -> list[dict]:
    """metrics.jsonl's rows; a line that is not JSON is kept as {"kind": "unreadable"} (so it is counted)."""
    rows = []
    for line in Path(path).read_text().splitlines() if Path(path).exists() else []:
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError:
                rows.append({"kind": "unreadable", "step": None})
    return rows


def metrics_files(run_dir: Path) -> dict[str, Path]:
    return {str(p.relative_to(run_dir)): p for p in sorted(Path(run_dir).rglob("metrics.jsonl"))}


def deterministic_values(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in ("step", "kind") and not any(w in k for w in TIMING_WORDS)}


def step_problems(rows: list[dict], steps: int) -> dict:
    """Train or eval rows logged more than once for a step ("train@3"), train steps 1..steps missing,
    unreadable lines."""
    seen: dict[tuple, int] = {}
    for r in rows:
        if r.get("kind") in COMPARED_KINDS:
            seen[r["kind"], r["step"]] = seen.get((r["kind"], r["step"]), 0) + 1
    return {"duplicated": [f"{k}@{s}" for (k, s), n in sorted(seen.items()) if n > 1],
            "missing": [s for s in range(1, steps + 1) if ("train", s) not in seen],
            "unreadable": sum(r.get("kind") == "unreadable" for r in rows)}


def compare_metrics(ref_dir: Path, got_dir: Path) -> dict:
    """Per metrics.jsonl of the uninterrupted run: its train step count, the resumed run's duplicated, missing
    and unreadable rows, and the (kind, step, key) values that differ. {"steps", "duplicated", "missing",
    "unreadable", "differing"} summed over the files."""
    out = {"steps": 0, "duplicated": [], "missing": [], "unreadable": 0, "differing": []}
    ref_files, got_files = metrics_files(ref_dir), metrics_files(got_dir)
    for rel, path in ref_files.items():
        ref_rows = read_rows(path)
        got_rows = read_rows(got_files[rel]) if rel in got_files else []
        steps = max((r["step"] for r in ref_rows if r.get("kind") == "train"), default=0)
        out["steps"] += steps
        problems = step_problems(got_rows, steps)
        out["duplicated"] += [f"{rel}:{s}" for s in problems["duplicated"]]
        out["missing"] += [f"{rel}:{s}" for s in problems["missing"]]
        out["unreadable"] += problems["unreadable"]
        want = {(r["kind"], r["step"]): deterministic_values(r) for r in ref_rows if r.get("kind") in COMPARED_KINDS}
        have = {(r["kind"], r["step"]): deterministic_values(r) for r in got_rows if r.get("kind") in COMPARED_KINDS}
        for key, values in want.items():
            for name, v in values.items():
                if key in have and have[key].get(name) != v:
                    out["differing"].append(f"{rel}:{key[0]}@{key[1]}:{name}")
    return out


def verdict(weights: dict, metrics: dict, keys: tuple = ()) -> dict:
    """The resumed run's summary against the uninterrupted one: `lost` (train steps missing, duplicated or
    unreadable, weight files or tensors missing), `equal` (nothing lost, every tensor and value the same) and
    `consistent` (nothing lost, finite weights, and the values named in `keys`, if any, the same)."""
    lost = (len(metrics["missing"]) + len(metrics["duplicated"]) + metrics["unreadable"] + len(weights["missing"]))
    keyed = [d for d in metrics["differing"] if d.rsplit(":", 1)[-1] in keys]
    return {"lost": lost,
            "equal": lost == 0 and not weights["differing"] and not metrics["differing"] and not weights["non_finite"],
            "consistent": lost == 0 and not weights["non_finite"] and not keyed and weights["files"] > 0}
