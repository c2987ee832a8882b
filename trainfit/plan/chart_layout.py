"""Where everything of a plan's picture goes, in pixels, computed once for both renderers (plan/chart_png.py
draws it with matplotlib, app/plan_html.py with plotly), so the PNG and the page show the same numbers at the
same places.

The figure, top to bottom: a header (verdict, the run, parameters, parallelism, the packages the training
machine needs); the device's phase bars with their capacity and budget lines, and beside them the CPU RAM bar
per node on its own scale with the node's RAM; the legend in a column at the right, a group a model. Labels are
placed by a greedy collision-avoiding pass: the capacity / budget / RAM labels in a gutter right of their axis
(spread apart vertically), the peak marker beside its bar, each bar's total above it (moved up until it
touches nothing, the axis raised to hold it), and a block's own label inside it only where it fits. Text sizes
are estimated from DejaVu Sans' advance widths (matplotlib's default font, which the page asks for first), with
slack, so the boxes computed here hold the drawn text.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field
from typing import Optional

from trainfit.plan.chart import Bar, Chart

FONT = "DejaVu Sans, Verdana, sans-serif"
LINE = 1.3                  # line height over font size (plotly's; matplotlib is told the same)
SLOT, BAR = 140, 0.55       # px a phase; a bar's width over its slot
LEFT, GUTTER, PLOT_H = 64, 110, 380
LEGEND_W, PAD = 270, 16
# DejaVu Sans advance widths in em (from its metrics; unlisted letters take their case's default)
NARROW, WIDE = set("fijlrtI.,:;'!|() -/[]"), set("mwMW%@")


def text_width(s: str, size: float) -> float:
    """Estimated width in px of one line of `s` at `size` px, a little over DejaVu Sans' own."""
    em = 0.0
    for ch in s:
        em += (0.36 if ch in NARROW else 0.95 if ch in WIDE else 0.64 if ch.isdigit() else
               0.74 if ch.isupper() else 0.62)
    return em * size * 1.05 + 2


@dataclass
class Box:
    x0: float
    y0: float
    x1: float
    y1: float

    def overlaps(self, o: "Box") -> bool:
        return self.x0 < o.x1 and o.x0 < self.x1 and self.y0 < o.y1 and o.y0 < self.y1


@dataclass
class Text:
    text: str                   # lines joined with "\n"
    x: float                    # the anchor, px from the figure's left
    y: float                    # px from the figure's top
    ha: str = "center"          # left | center | right
    va: str = "bottom"          # top | middle | bottom
    size: float = 11
    colour: str = "#222222"
    bold: bool = False
    role: str = "label"         # header | total | line | block | offscale | note
    background: bool = False

    @property
    def box(self) -> Box:
        lines = self.text.split("\n")
        w = max(text_width(t, self.size) for t in lines)
        h = len(lines) * self.size * LINE
        x0 = {"left": self.x, "center": self.x - w / 2, "right": self.x - w}[self.ha]
        y0 = {"top": self.y, "middle": self.y - h / 2, "bottom": self.y - h}[self.va]
        return Box(x0, y0, x0 + w, y0 + h)


@dataclass
class Block:
    slot: int
    y0: float                   # GiB
    y1: float
    colour: str
    name: str
    group: str
    note: str
    phase: str


@dataclass
class Axis:
    name: str                   # gpu | cpu
    box: Box                    # the plot area, px
    ymax: float                 # GiB at the top
    slots: list[str]            # the bars' names, left to right
    title: str
    ticks: list[float] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)
    lines: list[tuple[str, float, str, str]] = field(default_factory=list)   # (name, GiB, colour, dash|solid)
    band: Optional[tuple[float, float]] = None                               # the margin, shaded

    def y(self, gib: float) -> float:
        return self.box.y1 - gib / self.ymax * (self.box.y1 - self.box.y0)

    def x(self, slot: float) -> float:
        return self.box.x0 + (slot + 0.5) * SLOT

    def bar_box(self, b: Block) -> Box:
        return Box(self.x(b.slot) - SLOT * BAR / 2, self.y(b.y1), self.x(b.slot) + SLOT * BAR / 2, self.y(b.y0))


@dataclass
class Layout:
    width: float
    height: float
    axes: list[Axis]
    texts: list[Text]
    peak: tuple[float, float, str]          # px x, px y, the phase: a triangle pointing at the peak bar's top
    legend: list[tuple[Text, list[tuple[Box, str, Text, str]]]]   # (title, [(swatch, colour, label, component)])
    notes_height: float = 0                 # below `height`: the notes, drawn by the PNG (the page lists them)

    def labels(self) -> list[Text]:
        return [t for t in self.texts if t.role != "note"]


PEAK = 12                                   # the peak marker's size, px


def _wrap(s: str, px: float, size: float) -> str:
    chars = max(8, int(px / (size * 0.66)))
    return "\n".join(textwrap.wrap(s, chars, break_long_words=True, break_on_hyphens=False)) or s


def _ticks(ymax: float) -> list[float]:
    raw = ymax / 6
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    return [round(k * step, 10) for k in range(int(ymax / step) + 1)]


def _gib(v: float) -> str:
    return f"{v:,.2f} GiB"


def _axis(name: str, x0: float, top: float, bars: list[Bar], title: str,
          lines: list[tuple[str, float, str, str]]) -> tuple[Axis, list[tuple[str, float, str, str]]]:
    """An axis for `bars` with the `lines` that keep the bars readable: a line far above the tallest bar
    (a tiny config against an 80 GiB card) is left off the scale and named above it instead."""
    tallest = max(b.total_gib for b in bars) or 1.0     # an empty CPU RAM bar: a 1 GiB scale
    on = [ln for ln in lines if ln[1] <= 5 * tallest]
    off = [ln for ln in lines if ln[1] > 5 * tallest]
    ymax = 1.08 * max([tallest] + [ln[1] for ln in on])
    ax = Axis(name, Box(x0, top, x0 + SLOT * len(bars), top + PLOT_H), ymax, [b.phase for b in bars], title,
              lines=on)
    for k, b in enumerate(bars):
        y = 0.0
        for s in b.segments:
            ax.blocks.append(Block(k, y, y + s.gib, s.colour, s.name, s.group, s.note, b.phase))
            y += s.gib
    return ax, off


def _spread(texts: list[Text], lo: float, hi: float) -> None:
    """Moves gutter labels (sorted top to bottom) apart vertically, inside [lo, hi] where they can."""
    texts.sort(key=lambda t: t.y)
    for a, b in zip(texts, texts[1:]):
        if b.box.y0 < a.box.y1 + 2:
            b.y += a.box.y1 + 2 - b.box.y0
    for t in texts[::-1]:
        if t.box.y1 > hi:
            t.y -= t.box.y1 - hi
    for a, b in zip(texts[::-1][1:], texts[::-1]):
        if a.box.y1 > b.box.y0 - 2:
            a.y -= a.box.y1 - (b.box.y0 - 2)
    for t in texts:
        t.y += max(0.0, lo - t.box.y0)


def _free(box: Box, taken: list[Box]) -> bool:
    return not any(box.overlaps(o) for o in taken)


def _place_axis(ax: Axis, bars: list[Bar], off: list, peak: Optional[str],
                strict: bool = True) -> tuple[list[Text], list]:
    """The labels of one axis; returns them and the peak marker's box (or []). Raises _Taller when a total
    does not fit under the axis' top, with the GiB the axis needs."""
    texts: list[Text] = []
    gutter = [Text(_wrap(name, GUTTER - 8, 10) + f"\n{_gib(v)}", ax.box.x1 + 6, ax.y(v), "left", "middle", 10,
                   colour, role="line") for name, v, colour, _ in ax.lines]
    gutter += [Text("above the scale:\n" + _wrap(name, GUTTER - 8, 10) + f"\n{_gib(v)}", ax.box.x1 + 6, ax.box.y0,
                    "left", "top", 10, colour, role="offscale") for name, v, colour, _ in off]
    _spread(gutter, ax.box.y0 - 10, ax.box.y1)
    texts += gutter
    taken = [ax.bar_box(b) for b in ax.blocks] + [t.box for t in texts]
    marker = []
    if peak in ax.slots:
        k = ax.slots.index(peak)
        top = bars[k].total_gib
        cx = ax.x(k) - SLOT * BAR / 2 - PEAK / 2 - 3
        marker = [Box(cx - PEAK / 2, ax.y(top) - PEAK / 2, cx + PEAK / 2, ax.y(top) + PEAK / 2)]
        taken += marker
    for k, b in enumerate(bars):
        head = ("peak " if b.phase == peak else "") + _gib(b.total_gib)
        what = b.step or ("nothing planned in CPU RAM" if not b.segments and ax.name == "cpu" else "")
        t = Text(head + ("\n" + _wrap(f"({what})", SLOT - 8, 10) if what else ""), ax.x(k), ax.y(b.total_gib) - 3,
                 "center", "bottom", 10.5, "#d62728" if b.phase == peak else "#222222", bold=b.phase == peak,
                 role="total", background=True)
        while not _free(t.box, taken):
            t.y -= 2
        if strict and t.box.y0 < ax.box.y0 + 2:
            raise _Taller(ax.ymax * (ax.box.y1 - ax.box.y0) / (ax.box.y1 - t.box.y0 + 4) * 1.02)
        texts.append(t)
        taken.append(t.box)
    for blk in ax.blocks:   # a block's own label, where it fits inside it and touches no other label
        bx = ax.bar_box(blk)
        if bx.y1 - bx.y0 < 10 * LINE + 2:
            continue
        v = blk.y1 - blk.y0
        for cand in (f"{textwrap.shorten(blk.name, 60)} {v:.2f}", f"{v:.2f}"):
            t = Text(cand, (bx.x0 + bx.x1) / 2, (bx.y0 + bx.y1) / 2, "center", "middle", 9, _ink(blk.colour),
                     role="block")
            if t.box.x1 - t.box.x0 <= bx.x1 - bx.x0 - 4 and _free(t.box, [x.box for x in texts] + marker):
                texts.append(t)
                break
    return texts, marker


class _Taller(Exception):
    def __init__(self, ymax: float):
        self.ymax = ymax


def _ink(colour: str) -> str:
    r, g, b = (int(colour[i:i + 2], 16) for i in (1, 3, 5))
    return "#ffffff" if 0.299 * r + 0.587 * g + 0.114 * b < 140 else "#111111"


def _legend(c: Chart, x0: float, top: float) -> tuple[list, float]:
    out, y = [], top
    for g in c.legend:
        title = Text(_wrap(g.title, LEGEND_W - 8, 10), x0, y, "left", "top", 10, bold=True, role="legend")
        y = title.box.y1 + 2
        rows = []
        for name, colour in g.entries:
            label = Text(textwrap.shorten(name, int((LEGEND_W - 24) / 6.3), placeholder="..."), x0 + 16, y,
                         "left", "top", 10, role="legend")
            rows.append((Box(x0, y + 2, x0 + 11, y + 13), colour, label, name))
            y = label.box.y1 + 1
        out.append((title, rows))
        y += 6
    return out, y


def _header(c: Chart, width: float) -> list[Text]:
    bad = c.verdict != "FITS"
    lines = [(f"{c.stage}: {c.verdict}, peak {_gib(c.peak_gib)} in {c.peak_phase}"
              + (f" of a {c.budget_gib:.1f} GiB budget" if c.budget_gib else ""), 14, True,
              "#d62728" if bad else "#2ca02c"), (c.title, 11.5, True, "#222222")]
    lines += [(h, 11, False, "#333333") for h in c.header]
    out, y = [], 10.0
    for text, size, bold, colour in lines:
        t = Text(_wrap(text, width - 2 * PAD, size), PAD, y, "left", "top", size, colour, bold, role="header")
        out.append(t)
        y = t.box.y1 + 3
    return out


def layout(c: Chart) -> Layout:
    """The figure of one stage's chart, every label placed (see the module's docstring)."""
    n = len(c.bars)
    gpu_w = LEFT + SLOT * n + GUTTER
    cpu_w = (LEFT + SLOT + GUTTER) if c.cpu is not None else 0
    width = gpu_w + cpu_w + LEGEND_W + PAD
    header = _header(c, width)
    top = header[-1].box.y1 + 28
    gpu_lines = [(f"{c.device_name}", c.capacity_gib, "#000000", "solid")] if c.capacity_gib else []
    if c.budget_gib:
        gpu_lines.append((f"budget ({c.margin:.0%} margin)", c.budget_gib, "#d62728", "dash"))
    unit = "GiB per GPU" if c.device == "gpu" else "GiB of CPU RAM per process"
    specs = [("gpu", LEFT, c.bars, f"{unit} ({c.device_name})" if c.device == "gpu" else unit, gpu_lines)]
    if c.cpu is not None:
        ram = [(f"{c.ram_source}'s RAM", c.ram_gib, "#000000", "solid")] if c.ram_gib else []
        specs.append(("cpu", gpu_w + LEFT, [c.cpu], "GiB of CPU RAM per node", ram))
    axes, texts, peak = [], [], (0.0, 0.0, c.peak_phase)
    for name, x0, bars, title, lines in specs:
        ax, off = _axis(name, x0, top, bars, title, lines)
        if name == "gpu" and c.capacity_gib and c.budget_gib and (c.capacity_gib, c.budget_gib) == tuple(
                ln[1] for ln in ax.lines):
            ax.band = (c.budget_gib, c.capacity_gib)
        for attempt in range(9):   # raise the axis' top until every total fits under it (the last try keeps it)
            ax.ticks = _ticks(ax.ymax)
            try:
                placed, marker = _place_axis(ax, bars, off, c.peak_phase if name == "gpu" else None, attempt < 8)
                break
            except _Taller as e:
                ax.ymax = max(e.ymax, ax.ymax * 1.05)
        if marker:
            m = marker[0]
            peak = ((m.x0 + m.x1) / 2, (m.y0 + m.y1) / 2, c.peak_phase)
        axes.append(ax)
        texts += placed
    legend, legend_bottom = _legend(c, width - LEGEND_W - PAD + 8, top - 10)
    height = max(top + PLOT_H + 48, legend_bottom + 10)
    notes, y = [], height
    for n_ in c.notes:
        t = Text(_wrap("- " + n_, width - 2 * PAD, 10), PAD, y, "left", "top", 10, "#333333", role="note")
        notes.append(t)
        y = t.box.y1 + 2
    return Layout(width, height, axes, header + texts + notes, peak, legend, notes_height=y - height + 8)
