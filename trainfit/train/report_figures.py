"""The figures of report.html (train/report_html.py): plotly figures built from the columns of
metrics.jsonl (train/report_data.py), each written into the page as its JSON spec."""

from __future__ import annotations

import html
from typing import Optional

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs
from plotly.subplots import make_subplots

from trainfit.train.report_data import PHASES, RunRows, StageRows, events, extreme_indices, has, thinned

__all__ = ["get_plotlyjs"]   # re-exported: render() takes plotly.js from here with the figures

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


def _figure_block(fig_id: str, title: str, fig: Optional[go.Figure]) -> str:
    if fig is None:
        return ""
    spec = fig.to_json().replace("</", "<\\/")   # the JSON must not close its <script> element
    return (f'<h2>{html.escape(title)}</h2><div id="{fig_id}" class="chart"></div>\n'
            f'<script type="application/json" data-figure="{fig_id}">{spec}</script>\n')


