"""What a run shows and leaves behind: metrics JSONL + TensorBoard, a progress bar, a plot, a summary."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional, Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress
from rich.table import Table

from trainfit.train.storage import guarded_write


class MetricsLogger:
    """One JSON line per logged step (`kind` = train, eval, oom or memory), fanned out to the
    experiment trackers of logging.report_to (trackers.py) as `<kind>/<metric>` scalars."""

    def __init__(self, stage_dir: Path, trackers: Sequence = (), enabled: bool = True):
        self.enabled = enabled  # only rank 0 writes
        if enabled:
            stage_dir.mkdir(parents=True, exist_ok=True)
        self.path = stage_dir / "metrics.jsonl"
        self.trackers = list(trackers) if enabled else []

    def reset(self) -> None:
        if self.enabled:
            self.path.write_text("")

    def truncate_after(self, step: int, redone: Sequence[str] = ()) -> None:
        """On resume, drop lines a killed run wrote after its last checkpoint (they will be redone): those after
        `step`, those of the kinds in `redone` at `step` (the final evaluation follows the last checkpoint), and
        a line the kill cut short. Rewritten atomically: a kill during the rewrite keeps the previous file."""
        if not self.enabled or not self.path.exists():
            return
        keep = []
        for ln in self.path.read_text().splitlines():
            try:
                row = json.loads(ln)
            except ValueError:   # blank, or cut short by a kill mid-write
                continue
            if row["step"] < step or (row["step"] == step and row["kind"] not in redone):
                keep.append(ln)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(ln + "\n" for ln in keep))
        os.replace(tmp, self.path)

    def log(self, step: int, metrics: dict, kind: str = "train") -> None:
        if not self.enabled:
            return
        # Values at full precision (a float's shortest exact repr): a fixed number of decimals would write a
        # DPO margin of 8.4e-06 as 8e-06 and a smaller one as 0.
        row = {"step": step, "kind": kind, "time": round(time.time(), 3), **metrics}
        # A full disk: one paragraph and exit 2 (a line cut short is dropped by the resume's truncate_after).
        with guarded_write("a metrics row", self.path.parent / "checkpoints", self.path), open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        scalars = {f"{kind}/{k}": float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        if scalars:
            for t in self.trackers:
                t.log(step, scalars)

    def close(self) -> None:
        for t in self.trackers:
            t.close()
        self.trackers = []


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


class Progress:
    """A rich bar on a terminal; plain periodic lines otherwise (CI logs stay readable)."""

    SHOWN = ("loss", "reward", "accuracy", "tokens_per_s")

    def __init__(self, console: Console, total: int, start: int, enabled: bool):
        self.console, self.total, self.enabled = console, total, enabled
        self.live = enabled and console.is_terminal
        self.every = max(1, total // 10)
        self._bar: Optional[RichProgress] = None
        if self.live:
            self._bar = RichProgress(TextColumn("step"), MofNCompleteColumn(), BarColumn(),
                                     TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(),
                                     console=console, transient=False)
            self._task = self._bar.add_task("train", total=total, completed=start, info="")

    def __enter__(self):
        if self._bar:
            self._bar.__enter__()
        return self

    def __exit__(self, *exc):
        if self._bar:
            self._bar.__exit__(*exc)

    def _info(self, metrics: dict) -> str:
        parts = []
        for k in self.SHOWN:
            if k in metrics:
                v = metrics[k]
                parts.append(f"{k}={v:.0f}" if k == "tokens_per_s" else f"{k}={v:.4g}")
        return " ".join(parts)

    def update(self, step: int, metrics: dict) -> None:
        if self._bar:
            self._bar.update(self._task, completed=step, info=self._info(metrics))
        elif self.enabled and (step % self.every == 0 or step == self.total):
            self.console.print(f"step {step}/{self.total} {self._info(metrics)}", highlight=False)


def plot_run(stage_dirs: list[tuple[str, Path]], out_png: Path) -> Optional[Path]:
    """Loss, reward and held-out accuracy against a run-wide step axis, stages side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    all_rows = {d: read_metrics(d / "metrics.jsonl") for _, d in stage_dirs}
    has_acc = any("accuracy" in r for rows in all_rows.values() for r in rows)
    panels = [("loss", "train"), ("reward", "train"), ("accuracy" if has_acc else "eval_loss", "eval")]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    offset = 0
    for name, d in stage_dirs:
        rows = all_rows[d]
        if not rows:
            continue
        for ax, (key, kind) in zip(axes, panels):
            pts = [(r["step"] + offset, r[key]) for r in rows if r["kind"] == kind and key in r]
            if pts:
                ax.plot(*zip(*pts), marker="o" if kind == "eval" else None, markersize=3, label=name)
        last = max(r["step"] for r in rows)
        offset += last
        for ax in axes:
            ax.axvline(offset, color="grey", lw=0.5, ls="--")
    for ax, (key, _) in zip(axes, panels):
        ax.set_title(key)
        ax.set_xlabel("optimizer step (run)")
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png


def print_table(console: Console, table) -> None:
    """Print a table at its natural width when stdout is not a terminal: rich would otherwise fit
    it into 80 columns and wrap every cell one word per line in a pipe or a log file."""
    if console.is_terminal:
        console.print(table)
        return
    from rich.measure import Measurement

    natural = Measurement.get(console, console.options.update_width(100_000), table).maximum
    saved = console._width  # the width setter stores here; None = detect
    console.width = max(console.width, natural)
    try:
        console.print(table)
    finally:
        console._width = saved


def _pct(x: Optional[float]) -> str:
    return "" if x is None else f"{100 * x:.1f}%"


def _fmt(x: Optional[float], spec: str) -> str:
    return "" if x is None else format(x, spec)


def summary_table(stages: list[dict]) -> Table:
    """The run's stages as summary.json stores them (numbers), formatted for people."""
    table = Table(title="trainfit summary")
    for col in ("stage", "steps", "time", "accuracy before", "accuracy after", "final loss", "final reward", "output"):
        table.add_column(col)
    for r in stages:
        table.add_row(r["stage"], str(r["steps"]), f"{r['seconds']:.0f}s", _pct(r.get("accuracy_before")),
                      _pct(r.get("accuracy_after")), _fmt(r.get("loss"), ".4f"), _fmt(r.get("reward"), ".3f"),
                      r["output"])
    return table


def memory_table(stages: list[dict]) -> Optional[Table]:
    """Planned vs used memory per stage and phase (None when no stage measured any)."""
    rows = [(r, ph, m) for r in stages for ph, m in (r.get("memory") or {}).get("phases", {}).items()]
    if not rows:
        return None
    table = Table(title="memory: planned vs used (GiB)")
    for col in ("stage", "phase", "planned", "used", "error", "used is"):
        table.add_column(col)
    for r, ph, m in rows:
        err = m.get("error")
        table.add_row(r["stage"], ph, _fmt(m.get("planned_gib"), ".4g"), _fmt(m.get("used_gib"), ".4g"),
                      "" if err is None else f"{100 * err:+.1f}%", r["memory"]["basis"])
    return table


def time_breakdown(stage: dict) -> str:
    """`stage time: generate 12.0s (40%), ...` from the stage's per-phase seconds ('' when none)."""
    times = (stage.get("memory") or {}).get("time_s") or {}
    if not times:
        return ""
    total = max(stage["seconds"], 1e-9)
    parts = [f"{k} {v:.1f}s ({100 * v / total:.0f}%)" for k, v in sorted(times.items(), key=lambda kv: -kv[1])]
    return f"{stage['stage']} time: " + ", ".join(parts)
