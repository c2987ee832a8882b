"""`trainfit report RUN_DIR [--out FILE]`: the run's report.html (curves, planned vs used memory per
phase, step time by phase, throughput, out-of-memory retries and resumes, config and batch arithmetic),
and replay.html beside it when the run kept episodes (train/report_html.py, train/replay.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    app.command("report")(report)


def report(
    run_dir: str = typer.Argument(..., help="A run dir (the config's run_dir), finished or still training."),
    out: Optional[str] = typer.Option(None, "--out", help="Where to write the report (default RUN_DIR/report.html)."),
) -> None:
    """Write the run's report.html: one offline HTML file (plotly, inlined) with the run's curves, planned vs used
    memory per phase, step time by phase, throughput, OOM retries and resumes, and the config; replay.html beside
    it shows the kept episodes (screenshots with the clicks drawn), failures first."""
    from trainfit.app.cli import console, fail   # here: cli imports this module at its start
    from trainfit.train.report_html import write_report
    from trainfit.train.rundir import stage_dirs

    d = Path(run_dir)
    if not d.is_dir() or not any((s / "metrics.jsonl").is_file() for s in stage_dirs(d)):
        raise fail(f"run dir {run_dir!r} holds no metrics.jsonl (neither in it nor in a stage folder such as 0-sft/); "
                   "pass the run_dir of a run that has started training, e.g. `trainfit report runs/demo`.")
    path = write_report(d, Path(out) if out else None)
    replay = path.parent / "replay.html"
    console.print(f"report: {path}" + (f"\nepisode replay: {replay}" if replay.exists() else ""), highlight=False)
