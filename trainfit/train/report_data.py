"""A run dir's metrics as the run report draws them: stages on one run-wide step axis, and series
thinned for drawing without losing their extremes.

Each stage's `metrics.jsonl` (train/report.py `MetricsLogger`) holds one row per logged step; `kind`
says what it is: `train` (the step's metrics, per-phase memory peaks and `time_<bucket>_s`), `eval`,
`plan` (the planner's GiB per phase, at the stage's start), `memory` (planned vs used at the end),
`oom` (a retry with a smaller micro-batch), `resume` (a restart from a checkpoint) and `warning`.

A pipeline's stages follow each other on the x axis (the same offsets as metrics.png): stage i starts
where stage i-1's last logged step ended.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from trainfit.train.rundir import STAGE_DIR, stage_dirs

PHASES = ("rollout", "scoring", "train")   # memstats.PHASES, named here so a report never imports torch
MAX_POINTS = 2000   # points drawn per series; more are thinned to each bucket's min and max


@dataclass
class StageRows:
    name: str                 # "0-sft" in a pipeline; the stage's own name for a single-stage run
    dir: Path
    rows: list[dict]
    offset: int               # run-wide x of this stage's step 0
    last: int                 # its last logged step
    config_text: str = ""     # the stage's resolved config.yaml

    _kinds: dict = field(default_factory=dict, repr=False)   # kind -> its rows (built once)
    _steps: dict = field(default_factory=dict, repr=False)   # kind -> their steps, as an array
    _keys: dict = field(default_factory=dict, repr=False)    # kind -> the keys its rows hold

    def of(self, kind: str) -> list[dict]:
        if not self._kinds:
            for r in self.rows:
                self._kinds.setdefault(r.get("kind"), []).append(r)
        return self._kinds.get(kind, [])

    def keys(self, kind: str) -> set[str]:
        """Every key some row of `kind` holds."""
        if kind not in self._keys:
            self._keys[kind] = set().union(*self.of(kind))
        return self._keys[kind]

    def steps(self, kind: str) -> np.ndarray:
        if kind not in self._steps:
            self._steps[kind] = np.fromiter((r.get("step", 0) for r in self.of(kind)), dtype=np.int64)
        return self._steps[kind]

    def latest(self, kind: str) -> Optional[dict]:
        rows = self.of(kind)
        return rows[-1] if rows else None


@dataclass
class RunRows:
    run_dir: Path
    stages: list[StageRows] = field(default_factory=list)


def run_root(stage_dir: Path) -> Path:
    """The run dir a stage dir belongs to (a pipeline's stages live in `<run_dir>/<i>-<stage>/`)."""
    return stage_dir.parent if STAGE_DIR.fullmatch(stage_dir.name) else stage_dir


def _read_rows(path: Path) -> list[dict]:
    """metrics.jsonl rows; a line cut short by a killed run (the last one) is skipped, not fatal."""
    out = []
    with open(path) as f:
        for line in f:
            if line.strip():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    return out


def _stage_name(d: Path) -> str:
    if STAGE_DIR.fullmatch(d.name):
        return d.name
    try:
        import yaml

        return str((yaml.safe_load((d / "config.yaml").read_text()) or {}).get("stage") or d.name)
    except (OSError, ValueError, AttributeError):
        return d.name


def load_run(run_dir: Path) -> RunRows:
    """Every stage of `run_dir` that has a metrics.jsonl, in pipeline order, with its x offset."""
    run = RunRows(Path(run_dir))
    offset = 0
    for d in stage_dirs(run.run_dir):
        path = d / "metrics.jsonl"
        if not path.is_file():
            continue
        rows = _read_rows(path)
        last = max((int(r.get("step", 0)) for r in rows), default=0)
        sc = d / "config.yaml"
        run.stages.append(StageRows(_stage_name(d), d, rows, offset, last, sc.read_text() if sc.is_file() else ""))
        offset += last
    return run


def _arrays(stage: StageRows, kind: str, key: str) -> tuple[np.ndarray, np.ndarray]:
    rows = stage.of(kind)
    nan = float("nan")
    ys = np.fromiter((v if type(v) in (float, int) else nan for v in (r.get(key) for r in rows)),
                     dtype=float, count=len(rows))
    keep = np.isfinite(ys)
    return stage.steps(kind)[keep] + stage.offset, ys[keep]


def has(stage: StageRows, kind: str, key: str) -> bool:
    """Whether some row of `kind` holds `key` (checked without reading the values: a cheap test)."""
    return key in stage.keys(kind)


def thinned(stage: StageRows, kind: str, key: str, max_points: int = MAX_POINTS) -> tuple[list, list, int]:
    """(run-wide steps, values, how many points the series has) of `key` in the stage's rows of `kind`
    (non-numbers left out), thinned for drawing by `thin`."""
    xs, ys = _arrays(stage, kind, key)
    keep = extreme_indices(ys, max_points)
    return xs[keep].tolist(), ys[keep].tolist(), len(ys)


def extreme_indices(ys, max_points: int = MAX_POINTS) -> np.ndarray:
    """Indices (ascending) of the points to draw: all of them up to `max_points`, else per bucket of
    consecutive points its smallest and largest value, so a spike or a dip is never thinned away."""
    n = len(ys)
    if n <= max_points:
        return np.arange(n)
    buckets = max(1, max_points // 2)
    size = -(-n // buckets)
    padded = np.full(buckets * size, np.nan)
    padded[:n] = np.asarray(ys, dtype=float)
    grid = padded.reshape(buckets, size)
    full = ~np.all(np.isnan(grid), axis=1)   # the last bucket may be all padding
    base = np.arange(buckets)[full] * size
    lo = base + np.nanargmin(grid[full], axis=1)
    hi = base + np.nanargmax(grid[full], axis=1)
    return np.unique(np.concatenate([lo, hi]))


def thin(xs: list, ys: list, max_points: int = MAX_POINTS) -> tuple[list, list]:
    """`xs`, `ys` down to at most `max_points` points, keeping each bucket's min and max (exact values)."""
    keep = extreme_indices(ys, max_points).tolist()
    return [xs[i] for i in keep], [ys[i] for i in keep]


def events(run: RunRows) -> list[dict]:
    """Out-of-memory retries and resumes, stage by stage in the order they were logged:
    {kind, step (run-wide), stage, text}."""
    out = []
    for s in run.stages:
        for r in (r for r in s.rows if r.get("kind") in ("oom", "resume")):
            text = (r.get("message") or f"micro-batch {r.get('micro_batch_size')}" if r["kind"] == "oom"
                    else f"resumed from {r.get('checkpoint', 'a checkpoint')}")
            out.append({"kind": r["kind"], "step": int(r["step"]) + s.offset, "stage": s.name, "text": text})
    return out
