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

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs
from plotly.subplots import make_subplots

from trainfit.config import ConfigError, load_config
from trainfit.train.report_data import (MAX_POINTS, PHASES, RunRows, StageRows, extreme_indices, has, load_run,
                                        run_root, thinned)
from trainfit.train.replay import REPLAY_FILE, write_replay

REPORT_FILE = "report.html"
# (metric, row kind) drawn as curves, in this order; a panel appears when some stage logged it.
CURVES = (("loss", "train"), ("reward", "train"), ("kl", "train"), ("entropy", "train"),
          ("accuracy", "eval"), ("eval_loss", "eval"), ("grad_norm", "train"))
# Time buckets (memstats.phase's time keys) by the memory phase they run in, in step order.
TIME_BUCKETS = (("data", "train"), ("sync", "rollout"), ("generate", "rollout"), ("rewards", "scoring"),
                ("logprobs", "scoring"), ("forward_backward", "train"), ("optimizer", "train"))
PHASE_COLOURS = {"rollout": "#1f77b4", "scoring": "#ff7f0e", "train": "#2ca02c"}
EVENT_COLOURS = {"oom": "#d62728", "resume": "#9467bd"}
TEMPLATE = "plotly_white"


def _stage_lines(fig: go.Figure, run: RunRows, rows: Optional[int] = None) -> None:
    """Dashed lines where each stage after the first begins, named at the top."""
    for s in run.stages[1:]:
        kw = {"row": "all", "col": 1} if rows else {}
        fig.add_vline(x=s.offset, line_dash="dash", line_color="grey", line_width=1, **kw)
    for s in run.stages if len(run.stages) > 1 else []:
        fig.add_annotation(x=s.offset, y=1.0, yref="paper", xanchor="left", yanchor="bottom", showarrow=False,
                           text=s.name, font={"size": 11, "color": "grey"})


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


def curves_figure(run: RunRows) -> Optional[go.Figure]:
    panels = [(k, kind) for k, kind in CURVES if any(has(s, kind, k) for s in run.stages)]
    if not panels:
        return None
    fig = make_subplots(rows=len(panels), cols=1, shared_xaxes=True, vertical_spacing=0.04,
                        subplot_titles=[f"{k} ({kind})" for k, kind in panels])
    for i, (key, kind) in enumerate(panels, start=1):
        for j, s in enumerate(run.stages):
            x, y, n = thinned(s, kind, key)
            if not n:
                continue
            fig.add_trace(go.Scatter(x=x, y=y, name=s.name, legendgroup=s.name, showlegend=i == 1,
                                     mode="lines+markers" if kind == "eval" or len(x) < 50 else "lines",
                                     line={"color": _colour(j)}, meta={"metric": key, "kind": kind, "stage": s.name,
                                                                       "points": n}),
                          row=i, col=1)
    _stage_lines(fig, run, rows=len(panels))
    marks = events(run)
    for e in marks:
        fig.add_vline(x=e["step"], line_color=EVENT_COLOURS[e["kind"]], line_width=2, row="all", col=1)
    fig.update_xaxes(title_text="optimizer step (run)", row=len(panels), col=1)
    fig.update_layout(template=TEMPLATE, height=230 * len(panels) + 80, margin={"t": 60, "l": 60, "r": 20},
                      meta={"events": marks})
    return fig


def _colour(i: int) -> str:
    return ("#636efa", "#ef553b", "#00cc96", "#ab63fa", "#ffa15a", "#19d3f3")[i % 6]


def _measured_prefix(s: StageRows) -> Optional[str]:
    keys = s.keys("train")
    for prefix in ("gpu_mem_peak_", "cpu_rss_sampled_"):
        if any(f"{prefix}{ph}_gib" in keys for ph in PHASES):
            return prefix
    return None


def planned(s: StageRows) -> dict[str, float]:
    """The stage's planned GiB per phase: its memory row (end of stage), else its plan row (start)."""
    row = s.latest("memory") or s.latest("plan") or {}
    out = {}
    for ph in PHASES:
        v = row.get(f"planned_{ph}_gib")
        if isinstance(v, (int, float)):
            out[ph] = float(v)
    return out


def memory_figure(run: RunRows) -> Optional[go.Figure]:
    fig, basis = go.Figure(), set()
    for s in run.stages:
        prefix = _measured_prefix(s)
        if prefix:
            basis.add("GPU max_memory_allocated" if prefix.startswith("gpu") else "CPU RSS of the process")
        plan = planned(s)
        for ph in PHASES:
            colour = PHASE_COLOURS[ph]
            if ph in plan:
                fig.add_trace(go.Scatter(x=[s.offset, s.offset + max(s.last, 1)], y=[plan[ph], plan[ph]],
                                         mode="lines", line={"color": colour, "dash": "dash"},
                                         name=f"{s.name} {ph} planned",
                                         legendgroup=ph, meta={"stage": s.name, "phase": ph, "what": "planned"}))
            if prefix:
                x, y, n = thinned(s, "train", f"{prefix}{ph}_gib")
                if n:
                    fig.add_trace(go.Scatter(x=x, y=y, mode="markers", marker={"color": colour, "size": 5},
                                             name=f"{s.name} {ph} used", legendgroup=ph,
                                             meta={"stage": s.name, "phase": ph, "what": "used",
                                                   "key": f"{prefix}{ph}_gib",
                                                   "points": n}))
        cap = (s.latest("plan") or {}).get("capacity_gib")
        if isinstance(cap, (int, float)):
            fig.add_trace(go.Scatter(x=[s.offset, s.offset + max(s.last, 1)], y=[cap, cap], mode="lines",
                                     line={"color": "#d62728", "width": 2}, name=f"{s.name} card capacity",
                                     meta={"stage": s.name, "what": "capacity"}))
    if not fig.data:
        return None
    _stage_lines(fig, run)
    used = " and ".join(sorted(basis)) or "no measurement"
    fig.update_layout(template=TEMPLATE, height=420, yaxis_title="GiB", xaxis_title="optimizer step (run)",
                      title={"text": f"memory per phase: planned (dashed line) vs used (points: {used})",
                             "font": {"size": 14}})
    return fig


def time_figure(run: RunRows) -> Optional[go.Figure]:
    fig = go.Figure()
    for s in run.stages:
        train = s.of("train")
        present = s.keys("train")
        keys = [b for b, _ in TIME_BUCKETS if f"time_{b}_s" in present]
        keys += sorted({k[5:-2] for k in present if k.startswith("time_") and k.endswith("_s")} - set(keys))
        if not keys:
            continue
        # One set of steps for every bucket (so the bars still stack): the extremes of the step's total.
        cols = {b: [_num(r.get(f"time_{b}_s")) for r in train] for b in keys}
        keep = extreme_indices([sum(t) for t in zip(*cols.values())]).tolist()
        x = [int(train[i]["step"]) + s.offset for i in keep]
        phase_of = dict(TIME_BUCKETS)
        for b in keys:
            ph = phase_of.get(b, "other")
            fig.add_trace(go.Bar(x=x, y=[cols[b][i] for i in keep], name=f"{b} ({ph})",
                                 legendgroup=b, showlegend=not any(t.legendgroup == b for t in fig.data),
                                 marker={"color": _bucket_colour(b)},
                                 meta={"stage": s.name, "bucket": b, "phase": ph, "points": len(train)}))
    if not fig.data:
        return None
    _stage_lines(fig, run)
    fig.update_layout(template=TEMPLATE, barmode="stack", bargap=0, height=380, yaxis_title="seconds",
                      xaxis_title="optimizer step (run)",
                      title={"text": "step time by phase (generate, score, train)", "font": {"size": 14}})
    return fig


def _num(v) -> float:
    return v if type(v) in (float, int) else 0.0


def _bucket_colour(b: str) -> str:
    return {"sync": "#aec7e8", "generate": "#1f77b4", "rewards": "#ffbb78", "logprobs": "#ff7f0e",
            "forward_backward": "#2ca02c", "optimizer": "#98df8a", "data": "#c7c7c7"}.get(b, "#7f7f7f")


def throughput_figure(run: RunRows) -> Optional[go.Figure]:
    keys = [(k, t) for k, t in (("tokens_per_s", "tokens / s"), ("step_time", "step time (s)"))
            if any(has(s, "train", k) for s in run.stages)]
    if not keys:
        return None
    fig = make_subplots(rows=len(keys), cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=[t for _, t in keys])
    for i, (key, _) in enumerate(keys, start=1):
        for j, s in enumerate(run.stages):
            x, y, n = thinned(s, "train", key)
            if n:
                fig.add_trace(go.Scatter(x=x, y=y, mode="lines", name=s.name, legendgroup=s.name, showlegend=i == 1,
                                         line={"color": _colour(j)},
                                         meta={"metric": key, "stage": s.name, "points": n}), row=i, col=1)
    _stage_lines(fig, run, rows=len(keys))
    fig.update_layout(template=TEMPLATE, height=200 * len(keys) + 80, margin={"t": 60})
    return fig


def batch_arithmetic(s: StageRows) -> str:
    """The stage's batch as the trainer split it (BatchPlan.describe), from its saved config."""
    path = s.dir / "config.yaml"
    if not path.is_file():
        return ""
    try:
        return load_config(path).batch_plan().describe()
    except ConfigError as e:
        return f"(config not readable here: {e})"


def _figure_block(fig_id: str, title: str, fig: Optional[go.Figure]) -> str:
    if fig is None:
        return ""
    spec = fig.to_json().replace("</", "<\\/")   # the JSON must not close its <script> element
    return (f'<h2>{html.escape(title)}</h2><div id="{fig_id}" class="chart"></div>\n'
            f'<script type="application/json" data-figure="{fig_id}">{spec}</script>\n')


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
