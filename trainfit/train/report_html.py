"""`report.html`: a run as one self-contained HTML page (curves, planned vs used memory, step time by
phase, throughput, out-of-memory retries and resumes, the config and its batch arithmetic).

    trainfit report runs/demo           # writes runs/demo/report.html (and replay.html with episodes)

The trainer writes it too, into the run dir, at every evaluation and at the end of a run
(`logging.plot`); a report that fails to build only prints a warning, it never stops training.

Why plotly: its figures are JSON specs that plotly.js draws in the browser, with zoom, hover and
legend toggles, and plotly.js inlined in the page makes it one offline file (~5 MB) that opens with no
server and no network. The figure data stays readable in the page (`<script type="application/json">`
blocks, and each chart div's `.data` once drawn), so tests compare it with metrics.jsonl. Vega-Lite
(Altair) inlines its three JavaScript libraries only through one more package (vl-convert) and wants
its data as data frames; matplotlib (metrics.png) gives pictures without the numbers.

Series longer than report_data.MAX_POINTS are thinned for drawing to each bucket's min and max, so a
100k-step run draws quickly and its spikes stay visible (bench/report_speed.py times it).
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Optional

from trainfit.config import ConfigError, load_config
from trainfit.train.report_data import (MAX_POINTS, RunRows, StageRows, events, load_run,
                                        run_root)
from trainfit.train.replay import REPLAY_FILE, write_replay

REPORT_FILE = "report.html"
def batch_arithmetic(s: StageRows) -> str:
    """The stage's batch as the trainer split it (BatchPlan.describe), from its saved config."""
    path = s.dir / "config.yaml"
    if not path.is_file():
        return ""
    try:
        return load_config(path).batch_plan().describe()
    except ConfigError as e:
        return f"(config not readable here: {e})"


def _summary_table(run: RunRows) -> str:
    path = run.run_dir / "summary.json"
    try:
        stages = json.loads(path.read_text())["stages"] if path.is_file() else []
    except (ValueError, KeyError):
        stages = []
    if not stages:
        return "<p>The run has not finished: no summary.json yet.</p>"
    pct = lambda v: "" if v is None else f"{100 * v:.1f}%"   # noqa: E731
    num = lambda v, f: "" if v is None else format(v, f)     # noqa: E731
    rows = "".join(f"<tr><td>{html.escape(str(r['stage']))}</td><td>{r['steps']}</td><td>{r['seconds']:.0f}s</td>"
                   f"<td>{pct(r.get('accuracy_before'))}</td><td>{pct(r.get('accuracy_after'))}</td>"
                   f"<td>{num(r.get('loss'), '.4f')}</td><td>{num(r.get('reward'), '.3f')}</td></tr>" for r in stages)
    return ("<table><tr><th>stage</th><th>steps</th><th>time</th><th>accuracy before</th><th>accuracy after</th>"
            f"<th>final loss</th><th>final reward</th></tr>{rows}</table>")


def _events_table(run: RunRows) -> str:
    ev = events(run)
    if not ev:
        return "<p>No out-of-memory retries and no resumes.</p>"
    rows = "".join(f"<tr><td>{e['kind']}</td><td>{e['stage']}</td><td>{e['step']}</td>"
                   f"<td>{html.escape(e['text'])}</td></tr>" for e in ev)
    return f"<table><tr><th>event</th><th>stage</th><th>step (run)</th><th>what</th></tr>{rows}</table>"


def _config_blocks(run: RunRows) -> str:
    out = []
    for s in run.stages:
        arith = batch_arithmetic(s)
        out.append(f"<h3>{html.escape(s.name)}</h3><p class='batch'>{html.escape(arith)}</p>"
                   f"<details><summary>config.yaml</summary><pre>{html.escape(s.config_text)}</pre></details>")
    return "".join(out)


STYLE = """body{font-family:system-ui,sans-serif;margin:1.5em auto;max-width:1200px;color:#222}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ddd}
table{border-collapse:collapse}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;font-size:.9em}
pre{background:#f6f6f6;padding:8px;overflow:auto;font-size:.85em}.chart{width:100%}.note{color:#666;font-size:.9em}"""
# Draws each figure from its JSON block; plotly.js is inlined before it.
LOADER = """document.querySelectorAll('script[data-figure]').forEach(function (s) {
  var spec = JSON.parse(s.textContent);
  Plotly.newPlot(s.dataset.figure, spec.data, spec.layout, {responsive: true, displaylogo: false});
});"""


def render(run: RunRows, replay_link: Optional[str]) -> str:
    # plotly (~1 s to import) only when a report is drawn: training imports this module at start.
    from trainfit.train.report_figures import (_figure_block, curves_figure, get_plotlyjs, memory_figure,
                                                throughput_figure, time_figure)

    figures = [("fig-curves", "loss, reward, KL, entropy, accuracy, gradient norm", curves_figure(run)),
               ("fig-memory", "memory: planned vs used", memory_figure(run)),
               ("fig-time", "step time by phase", time_figure(run)),
               ("fig-throughput", "throughput", throughput_figure(run))]
    blocks = "".join(_figure_block(i, t, f) for i, t, f in figures)
    if not blocks:
        blocks = "<p>No metrics logged yet.</p>"
    link = (f'<p><a id="replay-link" href="{html.escape(replay_link)}">episode replay</a> '
            "(sampled episodes, failures first)</p>" if replay_link else "")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>trainfit report: {html.escape(str(run.run_dir))}"
            f"</title><style>{STYLE}</style><script>{get_plotlyjs()}</script></head><body>"
            f"<h1>trainfit report: {html.escape(str(run.run_dir))}</h1>{_summary_table(run)}{link}"
            f"<p class='note'>Series longer than {MAX_POINTS} points are drawn thinned to each bucket's minimum "
            "and maximum; the lines' hover values are logged values.</p>"
            f"{blocks}<h2>out-of-memory retries and resumes</h2>{_events_table(run)}"
            f"<h2>config and batch arithmetic</h2>{_config_blocks(run)}"
            f"<script>{LOADER}</script></body></html>")


def write_report(run_dir: Path, out: Optional[Path] = None) -> Path:
    """Write `report.html` for `run_dir` (and `replay.html` beside it when the run kept episodes);
    returns the report's path."""
    run_dir = Path(run_dir)
    run = load_run(run_dir)
    out = Path(out) if out is not None else run_dir / REPORT_FILE
    replay = write_replay(run_dir, out.parent / REPLAY_FILE)
    link = None
    if replay is not None:
        try:
            link = str(replay.resolve().relative_to(out.parent.resolve()))
        except ValueError:
            link = replay.resolve().as_uri()
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(render(run, link), encoding="utf-8")
    tmp.replace(out)   # a browser reloading the page never reads half a file
    return out


def refresh(stage_dir: Path, console=None) -> Optional[Path]:
    """The trainer's call at an evaluation and at the end: rewrite the run's report; a failure is
    printed as a warning and never stops training."""
    try:
        return write_report(run_root(Path(stage_dir)))
    except Exception as e:  # noqa: BLE001 - the report is a view of the run, never a reason to stop it
        if console is not None:
            console.print(f"warning: report.html not written ({type(e).__name__}: {e})", style="yellow",
                          markup=False, highlight=False)
        return None
