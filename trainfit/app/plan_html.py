"""`trainfit plan CONFIG --html plan.html`: the plan as one offline HTML page, one panel per stage, each the
figure of plan/chart_layout.py (the figure `--png` draws too, plan/chart_png.py): a header with the verdict, the
models and their parameters, the parallelism and the packages the training machine needs; each phase (rollout,
scoring, train) a stacked bar of its components against the device's capacity and budget; the CPU RAM bar per
node beside them against the node's RAM; the legend a group a model; the plan's notes beside the figure.

plotly, as for report.html (train/report_html.py says why): each figure is written into the page as its JSON
spec in a `<script type="application/json" data-figure=...>` block and drawn by the inlined plotly.js, so the
page opens offline and its numbers stay readable. The figure has the layout's size in pixels and no automatic
margins, so every label sits where the layout placed it: in paper coordinates, the pixel over the size.
plotly is imported with this module, which the `plan` command imports only for `--html`.
"""

from __future__ import annotations

import html
from pathlib import Path

import plotly.graph_objects as go

from trainfit.plan.chart import Chart, bars
from trainfit.plan.chart_layout import BAR, FONT, PEAK, SLOT, Layout, layout
from trainfit.train.report_figures import TEMPLATE, get_plotlyjs
from trainfit.train.report_html import LOADER, STYLE

PAGE_STYLE = STYLE + """.stage{display:flex;flex-wrap:wrap;gap:1.2em;align-items:flex-start}.stage .chart{flex:none}
.stage aside{flex:1;min-width:22em;font-size:.88em}.stage aside li{margin-bottom:.4em}.verdict{font-weight:bold}
.FITS{color:#2ca02c}.bad{color:#d62728}"""
VA = {"top": "top", "middle": "middle", "bottom": "bottom"}


def _text(s: str, bold: bool) -> str:
    s = html.escape(s).replace("\n", "<br>")
    return f"<b>{s}</b>" if bold else s


def _axes(fig: go.Figure, lay: Layout) -> dict[str, tuple[str, str]]:
    """An x and y axis per layout axis, at its pixel box; returns their trace references ("x2", "y2")."""
    W, H, refs = lay.width, lay.height, {}
    for k, a in enumerate(lay.axes, start=1):
        sx = "" if k == 1 else str(k)
        fig.update_layout({
            f"xaxis{sx}": {"domain": [a.box.x0 / W, a.box.x1 / W], "range": [-0.5, len(a.slots) - 0.5],
                           "tickvals": list(range(len(a.slots))), "automargin": False, "anchor": f"y{sx}",
                           "ticktext": [html.escape(s).replace(" (", "<br>(") for s in a.slots],
                           "showgrid": False, "zeroline": False, "fixedrange": True, "tickfont": {"size": 10.5}},
            f"yaxis{sx}": {"domain": [1 - a.box.y1 / H, 1 - a.box.y0 / H], "range": [0, a.ymax], "anchor": f"x{sx}",
                           "tickvals": a.ticks, "automargin": False, "title": {"text": html.escape(a.title),
                                                                              "font": {"size": 10.5}},
                           "tickfont": {"size": 10}, "showline": True, "linecolor": "#444"}})
        refs[a.name] = (f"x{sx}", f"y{sx}")
    return refs


def figure(c: Chart) -> go.Figure:
    """One stage's figure: the layout's blocks as bars, its lines as shapes, its labels as annotations."""
    lay = layout(c)
    W, H = lay.width, lay.height
    fig = go.Figure()
    refs = _axes(fig, lay)
    for a in lay.axes:
        xr, yr = refs[a.name]   # plotly draws an axis only under a trace: an empty one holds an empty CPU bar's
        fig.add_trace(go.Scatter(x=[], y=[], xaxis=xr, yaxis=yr, showlegend=False, hoverinfo="skip",
                                 meta={"role": "axis", "axis": a.name}))
        for b in a.blocks:
            fig.add_trace(go.Bar(
                x=[b.slot], y=[b.y1 - b.y0], base=[b.y0], width=BAR, xaxis=xr, yaxis=yr,
                name=html.escape(b.name), showlegend=False,
                marker={"color": b.colour, "line": {"color": "white", "width": 1}},
                customdata=[[b.name, b.note]], meta={"phase": b.phase, "component": b.name, "group": b.group,
                                                     "axis": a.name},
                hovertemplate="%{customdata[0]}<br>%{y:.3f} GiB<br>%{customdata[1]}<extra>" + html.escape(b.phase)
                              + "</extra>"))
        for name, v, colour, dash in a.lines:
            role = "ram" if a.name == "cpu" else ("capacity" if dash == "solid" else "budget")
            fig.add_shape(type="line", name=role, xref=f"{xr} domain", yref=yr, x0=0, x1=1, y0=v, y1=v,
                          line={"color": colour, "width": 2 if dash == "solid" else 1.5,
                                "dash": "dash" if dash == "dash" else "solid"})
        if a.band:
            fig.add_shape(type="rect", name="margin", xref=f"{xr} domain", yref=yr, x0=0, x1=1, y0=a.band[0],
                          y1=a.band[1], fillcolor="#d62728", opacity=0.08, line={"width": 0}, layer="below")
    px, py, phase = lay.peak
    gpu = lay.axes[0]
    fig.add_trace(go.Scatter(x=[(px - gpu.box.x0) / SLOT - 0.5], y=[c.peak_gib], mode="markers", showlegend=False,
                             xaxis=refs["gpu"][0], yaxis=refs["gpu"][1], name=f"peak {c.peak_gib:.2f} GiB",
                             marker={"symbol": "triangle-right", "size": PEAK, "color": "#d62728"},
                             meta={"role": "peak", "phase": phase},
                             hovertemplate=f"peak %{{y:.3f}} GiB<extra>{html.escape(phase)}</extra>"))
    for t in lay.labels() + [t for title, rows in lay.legend for t in [title] + [r[2] for r in rows]]:
        fig.add_annotation(xref="paper", yref="paper", x=t.x / W, y=1 - t.y / H, xanchor=t.ha, yanchor=VA[t.va],
                           text=_text(t.text, t.bold), showarrow=False, align=t.ha, borderpad=0, name=t.role,
                           font={"size": t.size, "color": t.colour},
                           bgcolor="rgba(255,255,255,0.85)" if t.background else None)
    for _, rows in lay.legend:   # the legend as the layout placed it (the PNG's), a swatch a component
        for sw, colour, _, name in rows:
            fig.add_shape(type="rect", name="swatch", xref="paper", yref="paper", x0=sw.x0 / W, x1=sw.x1 / W,
                          y0=1 - sw.y1 / H, y1=1 - sw.y0 / H, fillcolor=colour, line={"width": 0})
    fig.update_layout(template=TEMPLATE, barmode="overlay", width=W, height=H, autosize=False,
                      margin={"t": 0, "l": 0, "r": 0, "b": 0, "pad": 0, "autoexpand": False},
                      font={"family": FONT}, hoverlabel={"font": {"family": FONT}},
                      showlegend=False,
                      meta={"stage": c.stage, "capacity_gib": c.capacity_gib, "budget_gib": c.budget_gib,
                            "peak_gib": c.peak_gib, "peak_phase": c.peak_phase, "verdict": c.verdict,
                            "device": c.device, "cpu_ram_gib": c.cpu.total_gib if c.cpu else None,
                            "ram_gib": c.ram_gib, "header": c.header})
    return fig


def panel(prefix: str, c: Chart, label: str = "") -> str:
    """A stage's figure with its notes beside it (its header names the run, so a title is only the caller's
`label`, "your config: grpo"); the figure's id is `{prefix}-{stage}`."""
    fig_id = f"{prefix}-{c.stage}"
    spec = figure(c).to_json().replace("</", "<\\/")   # the JSON must not close its <script> element
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in c.notes) or "<li>no notes</li>"
    cls = "FITS" if c.verdict == "FITS" else "bad"
    return ((f"<h2>{html.escape(label + c.stage)}</h2>" if label else "") + "<div class='stage'>"
            f"<div id='{fig_id}' class='chart'></div>"
            f"<aside><p class='verdict {cls}'>{html.escape(c.verdict)}: peak {c.peak_gib:.2f} GiB in {c.peak_phase}"
            + (f" of a {c.budget_gib:.1f} GiB budget" if c.budget_gib else "") + "</p>"
            f"<ul class='notes'>{notes}</ul></aside></div>\n"
            f'<script type="application/json" data-figure="{fig_id}">{spec}</script>\n')


def render(plans: list, source: str) -> str:
    charts = [bars(p) for p in plans]
    title = f"trainfit plan: {Path(source).name}"
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{PAGE_STYLE}</style><script>{get_plotlyjs()}</script></head><body><h1>{html.escape(title)}</h1>"
            "<p class='note'>Before anything runs: each phase's components stacked to its total on the device, and "
            "the CPU RAM per node beside them (hover a block for its note); the black line is the device's memory, "
            "the dashed line the budget after the margin.</p>"
            + "".join(panel(f"plan-{i}", c) for i, c in enumerate(charts)) + f"<script>{LOADER}</script></body></html>")


def write_plan_html(plans: list, out: Path, source: str) -> Path:
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(render(plans, source), encoding="utf-8")
    tmp.replace(out)   # a browser reloading the page never reads half a file
    return out
