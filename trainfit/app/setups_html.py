"""`trainfit hardware CONFIG --html FILE` and `trainfit fit CONFIG --html FILE`: the candidate setups side by side
as one offline page (plotly, as plan_html.py): per setup its planned peak GiB per GPU against its budget, and its
estimated step time, so the choice is visible. `fit`'s page adds the memory plan of your config and of the
fitted one (plan_html's panels). Step times are the roofline estimates `fit` and `hardware` rank by.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Optional

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from trainfit.app.plan_html import PAGE_STYLE, panel
from trainfit.plan.chart import bars
from trainfit.train.report_figures import TEMPLATE, get_plotlyjs
from trainfit.train.report_html import LOADER

GiB = 2 ** 30
FIT_COLOURS = {True: "#2ca02c", False: "#d62728", None: "#999999"}


def setups_figure(rows: list[dict]) -> go.Figure:
    """rows: {setup, peak_gib, budget_gib, fits, step_s}; a row a setup, in the given order (best first)."""
    names = [r["setup"] for r in rows]
    fig = make_subplots(rows=1, cols=2, shared_yaxes=True, horizontal_spacing=0.04,
                        subplot_titles=["planned peak GiB per GPU (| = budget)", "estimated step time, s"])
    fig.add_trace(go.Bar(y=names, x=[r["peak_gib"] for r in rows], orientation="h", name="peak",
                         marker={"color": [FIT_COLOURS[r["fits"]] for r in rows]}, showlegend=False,
                         meta={"what": "peak_gib"}, hovertemplate="%{y}: peak %{x:.2f} GiB<extra></extra>"),
                  row=1, col=1)
    fig.add_trace(go.Scatter(y=names, x=[r["budget_gib"] for r in rows], mode="markers", name="budget",
                             marker={"symbol": "line-ns-open", "size": 16, "color": "black", "line": {"width": 2}},
                             showlegend=False, meta={"what": "budget_gib"},
                             hovertemplate="%{y}: budget %{x:.1f} GiB<extra></extra>"),
                  row=1, col=1)
    fig.add_trace(go.Bar(y=names, x=[r["step_s"] for r in rows], orientation="h", name="step time",
                         marker={"color": [FIT_COLOURS[r["fits"]] for r in rows]}, showlegend=False,
                         meta={"what": "step_s"}, hovertemplate="%{y}: %{x:.2f} s (estimate)<extra></extra>"),
                  row=1, col=2)
    fig.update_yaxes(autorange="reversed", row=1, col=1)   # the first row (the best) on top
    fig.update_layout(template=TEMPLATE, height=max(280, 140 + 26 * len(rows)),
                      margin={"t": 50, "l": 200, "r": 20}, meta={"setups": names})
    return fig


def _block(fig_id: str, fig: go.Figure, aside: str) -> str:
    spec = fig.to_json().replace("</", "<\\/")   # the JSON must not close its <script> element
    return (f"<div class='stage'><div id='{fig_id}' class='chart'></div><aside>{aside}</aside></div>\n"
            f'<script type="application/json" data-figure="{fig_id}">{spec}</script>\n')


def page(title: str, rows: list[dict], notes: list[str], plans: Optional[list[tuple[str, object]]] = None) -> str:
    """The page: the setups figure with the notes beside it, then a plan panel per (label, Plan)."""
    aside = ("<p class='note'>green: fits, red: does not fit, grey: not planned</p><ul class='notes'>"
             + "".join(f"<li>{html.escape(n)}</li>" for n in notes) + "</ul>")
    body = _block("setups", setups_figure(rows), aside)
    for i, (label, p) in enumerate(plans or []):
        body += panel(f"plan-{i}", bars(p), f"{label}: ")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{PAGE_STYLE}</style><script>{get_plotlyjs()}</script></head><body><h1>{html.escape(title)}</h1>"
            f"{body}<script>{LOADER}</script></body></html>")


def write_page(out: str, text: str) -> Path:
    path = Path(out)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)   # a browser reloading the page never reads half a file
    return path


def hardware_rows(rows: list[dict]) -> list[dict]:
    """`rank_setups`' rows (peak_gb and budget_gb are GiB) in the figure's keys."""
    return [{"setup": r["setup"], "peak_gib": r["peak_gb"], "budget_gib": r["budget_gb"], "fits": r["fits"],
             "step_s": r["step_s"]} for r in rows]


def fit_rows(res) -> list[tuple[str, object, dict]]:
    """(label, candidate, row) for your config, the fitted (or closest) one and the faster alternatives."""
    out = []
    named = [("your config", res.user), ("fitted" if res.best else "closest (does not fit)", res.best or res.closest)]
    named += [(f"faster, changes what is trained ({i + 1})", a) for i, a in enumerate(res.alternatives)]
    for label, c in named:
        if c is None:
            continue
        p = c.plan
        out.append((label, c, {"setup": label, "peak_gib": p.peak / GiB, "budget_gib": (p.budget or 0) / GiB,
                               "fits": p.fits, "step_s": c.step.total}))
    return out


def write_hardware_html(out: str, config: str, rows: list[dict]) -> Path:
    """`hardware --html`: `rank_setups`' rows, best first, with each row's note beside the chart."""
    notes = [f"{r['setup']}: {r['note']}" for r in rows if r["note"]]
    return write_page(out, page(f"trainfit hardware: {Path(config).name}", hardware_rows(rows), notes))


def write_fit_html(out: str, config: str, res, reasons: list[str]) -> Path:
    """`fit --html`: the candidates side by side with fit's reasons beside them, then the plans of your config
    and of the fitted (or closest) one."""
    cands = fit_rows(res)
    return write_page(out, page(f"trainfit fit: {Path(config).name} on {res.card.name}", [r for _, _, r in cands],
                                reasons, [(label, c.plan) for label, c, _ in cands[:2]]))
