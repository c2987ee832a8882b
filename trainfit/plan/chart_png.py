"""`trainfit plan --png`: each stage's figure of chart_layout.layout drawn with matplotlib, one figure under
the other, each followed by its notes. The layout is in pixels; here a pixel is a point (figsize in px / 72)
saved at twice that resolution, so text sizes and places are the page's.

Drawn with matplotlib, not plotly: plotly writes PNGs only through kaleido, an extra package that downloads its
own Chromium; matplotlib is already a dependency (the trainer's metrics.png). Imported only for `--png`."""

from __future__ import annotations

from trainfit.plan.chart import bars
from trainfit.plan.chart_layout import BAR, LINE, PEAK, Layout, layout

DPI = 144
VA = {"top": "top", "middle": "center", "bottom": "bottom"}


def _draw(fig, lay: Layout, top: float, W: float, total_h: float) -> None:
    """One stage's layout, its top `top` px below the top of the figure (W x total_h px)."""

    def rect(b):   # a px box of the layout as a figure fraction [left, bottom, width, height]
        return [b.x0 / W, 1 - (top + b.y1) / total_h, (b.x1 - b.x0) / W, (b.y1 - b.y0) / total_h]
    for a in lay.axes:
        ax = fig.add_axes(rect(a.box))
        ax.set_xlim(-0.5, len(a.slots) - 0.5)
        ax.set_ylim(0, a.ymax)
        for blk in a.blocks:
            ax.bar(blk.slot, blk.y1 - blk.y0, bottom=blk.y0, width=BAR, color=blk.colour, edgecolor="white",
                   linewidth=0.6)
        for _name, v, colour, dash in a.lines:
            ax.axhline(v, color=colour, lw=1.4 if dash == "solid" else 1.2, ls="--" if dash == "dash" else "-")
        if a.band:
            ax.axhspan(*a.band, color="#d62728", alpha=0.08, lw=0)
        ax.set_yticks(a.ticks)
        ax.set_xticks(range(len(a.slots)), [s.replace(" (", "\n(") for s in a.slots], fontsize=10.5)
        ax.tick_params(labelsize=10)
        ax.set_ylabel(a.title, fontsize=10.5)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
    over = fig.add_axes([0, 1 - (top + lay.height + lay.notes_height) / total_h, lay.width / W,
                         (lay.height + lay.notes_height) / total_h])
    over.set_xlim(0, lay.width)
    over.set_ylim(lay.height + lay.notes_height, 0)
    over.axis("off")
    over.patch.set_alpha(0)
    for t in lay.texts:
        over.text(t.x, t.y, t.text, ha=t.ha, va=VA[t.va], fontsize=t.size, color=t.colour, linespacing=LINE,
                  fontweight="bold" if t.bold else "normal", multialignment=t.ha,
                  bbox={"facecolor": "white", "alpha": 0.85, "edgecolor": "none", "pad": 0.5} if t.background else None)
    x, y, _ = lay.peak
    over.plot([x], [y], marker=">", color="#d62728", markersize=PEAK * 0.8, linestyle="none")
    for title, rows in lay.legend:
        over.text(title.x, title.y, title.text, ha="left", va="top", fontsize=title.size, fontweight="bold",
                  linespacing=LINE)
        for sw, colour, label, _name in rows:
            over.add_patch(_patch(sw, colour))
            over.text(label.x, label.y, label.text, ha="left", va="top", fontsize=label.size, linespacing=LINE)


def _patch(b, colour):
    from matplotlib.patches import Rectangle

    return Rectangle((b.x0, b.y0), b.x1 - b.x0, b.y1 - b.y0, facecolor=colour, edgecolor="none")


def figure(plans: list):
    """The matplotlib figure of `plans` (a stage each), and the layouts drawn in it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lays = [layout(bars(p)) for p in plans]
    W = max(lay.width for lay in lays)
    H = sum(lay.height + lay.notes_height for lay in lays)
    fig = plt.figure(figsize=(W / 72, H / 72), dpi=DPI)
    top = 0.0
    for lay in lays:
        _draw(fig, lay, top, W, H)
        top += lay.height + lay.notes_height
    return fig, lays


def save_png(plans: list, path: str) -> None:
    import matplotlib.pyplot as plt

    fig, _ = figure(plans)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
