"""`trainfit plan CONFIG --html plan.html`: the plan as one offline HTML page, one panel per stage: each phase
(rollout, scoring, train) a stacked bar of its components, the card's capacity and the budget after the margin
as lines with the margin shaded between them, the peak marked, and the plan's notes beside the bars.

plotly, as for report.html (train/report_html.py says why): each figure is written into the page as its JSON
spec in a `<script type="application/json" data-figure=...>` block and drawn by the inlined plotly.js, so the
page opens offline and its numbers stay readable. The numbers come from plan/chart.py, which `--png` draws too.
plotly is imported with this module, which the `plan` command imports only for `--html`.
"""

from __future__ import annotations

import html
from pathlib import Path

import plotly.graph_objects as go

from trainfit.plan.chart import GROUP_COLOURS, Chart, bars
from trainfit.train.report_figures import TEMPLATE, get_plotlyjs
from trainfit.train.report_html import LOADER, STYLE

PAGE_STYLE = STYLE + """.stage{display:flex;gap:1.2em;align-items:flex-start}.stage .chart{flex:3;min-width:0}
.stage aside{flex:2;font-size:.88em}.stage aside li{margin-bottom:.4em}.verdict{font-weight:bold}
.FITS{color:#2ca02c}.bad{color:#d62728}"""


def figure(c: Chart) -> go.Figure:
    """One stage: a bar a phase, stacked from its segments; capacity and budget as named shapes."""
    fig = go.Figure()
    seen: set[str] = set()
    for b in c.bars:
        for s in b.segments:
            fig.add_trace(go.Bar(x=[b.phase], y=[s.gib], name=s.name, legendgroup=s.name, showlegend=s.name not in seen,
                                 marker={"color": GROUP_COLOURS.get(s.group, "#aaaaaa"),
                                         "line": {"color": "white", "width": 1}},
                                 customdata=[s.note], meta={"phase": b.phase, "component": s.name, "group": s.group},
                                 hovertemplate=f"{html.escape(s.name)}<br>%{{y:.3f}} GiB<br>%{{customdata}}"
                                               "<extra>%{x}</extra>"))
            seen.add(s.name)
    # the total of each phase above its bar, the peaking sub-step with it
    fig.add_trace(go.Scatter(x=[b.phase for b in c.bars], y=[b.total_gib for b in c.bars], mode="text",
                             text=[f"{b.total_gib:.2f} GiB<br>({html.escape(b.step)})" for b in c.bars],
                             textposition="top center", showlegend=False, hoverinfo="skip", meta={"role": "totals"}))
    fig.add_trace(go.Scatter(x=[c.peak_phase], y=[c.peak_gib], mode="markers", name=f"peak {c.peak_gib:.2f} GiB",
                             marker={"symbol": "triangle-down", "size": 14, "color": "#d62728"},
                             meta={"role": "peak"}, hovertemplate="peak %{y:.3f} GiB<extra>%{x}</extra>"))
    top = max([c.peak_gib] + [v for v in (c.capacity_gib, c.budget_gib) if v])
    if c.capacity_gib:
        fig.add_shape(type="line", name="capacity", xref="paper", x0=0, x1=1, y0=c.capacity_gib, y1=c.capacity_gib,
                      line={"color": "black", "width": 2})
        fig.add_annotation(xref="paper", x=1, y=c.capacity_gib, xanchor="right", yanchor="bottom", showarrow=False,
                           text=f"{html.escape(c.gpu or 'card')}: {c.capacity_gib:.1f} GiB")
    if c.budget_gib:
        fig.add_shape(type="line", name="budget", xref="paper", x0=0, x1=1, y0=c.budget_gib, y1=c.budget_gib,
                      line={"color": "#d62728", "width": 1.5, "dash": "dash"})
        fig.add_annotation(xref="paper", x=0, y=c.budget_gib, xanchor="left", yanchor="top", showarrow=False,
                           text=f"budget {c.budget_gib:.1f} GiB ({c.margin:.0%} margin kept free)")
    if c.capacity_gib and c.budget_gib:
        fig.add_shape(type="rect", name="margin", xref="paper", x0=0, x1=1, y0=c.budget_gib, y1=c.capacity_gib,
                      fillcolor="#d62728", opacity=0.08, line={"width": 0}, layer="below")
    # the legend below the bars: beside them it would take the width the bars and the notes need
    fig.update_layout(template=TEMPLATE, barmode="stack", height=460 + 24 * len(seen),
                      margin={"t": 50, "l": 60, "r": 20, "b": 50 + 24 * len(seen)},
                      title={"text": f"{html.escape(c.stage)}: {c.verdict}", "x": 0},
                      yaxis={"title": "GiB per GPU", "range": [0, top * 1.12]},
                      legend={"font": {"size": 10}, "orientation": "h", "yanchor": "top", "y": -0.06},
                      meta={"stage": c.stage, "capacity_gib": c.capacity_gib, "budget_gib": c.budget_gib,
                            "peak_gib": c.peak_gib, "peak_phase": c.peak_phase, "verdict": c.verdict})
    return fig


def panel(prefix: str, c: Chart, label: str = "") -> str:
    """A stage's chart with its verdict and notes beside it; the figure's id is `{prefix}-{stage}`."""
    fig_id = f"{prefix}-{c.stage}"
    spec = figure(c).to_json().replace("</", "<\\/")   # the JSON must not close its <script> element
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in c.notes) or "<li>no notes</li>"
    cls = "FITS" if c.verdict == "FITS" else "bad"
    return (f"<h2>{html.escape(label + c.title)}</h2><div class='stage'><div id='{fig_id}' class='chart'></div>"
            f"<aside><p class='verdict {cls}'>{html.escape(c.verdict)}: peak {c.peak_gib:.2f} GiB in {c.peak_phase}"
            + (f" of a {c.budget_gib:.1f} GiB budget" if c.budget_gib else "") + "</p>"
            f"<ul class='notes'>{notes}</ul></aside></div>\n"
            f'<script type="application/json" data-figure="{fig_id}">{spec}</script>\n')


def render(plans: list, source: str) -> str:
    charts = [bars(p) for p in plans]
    title = f"trainfit plan: {Path(source).name}"
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{PAGE_STYLE}</style><script>{get_plotlyjs()}</script></head><body><h1>{html.escape(title)}</h1>"
            "<p class='note'>Per GPU, before anything runs: each phase's components stacked to its total (hover a "
            "block for its note); the black line is the card, the dashed line the budget after the margin.</p>"
            + "".join(panel(f"plan-{i}", c) for i, c in enumerate(charts)) + f"<script>{LOADER}</script></body></html>")


def write_plan_html(plans: list, out: Path, source: str) -> Path:
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(render(plans, source), encoding="utf-8")
    tmp.replace(out)   # a browser reloading the page never reads half a file
    return out
