"""Showing a plan: a rich table per component and phase, JSON for machines, a stacked-bar PNG (the HTML page is
app/plan_html.py: it needs plotly, which the planner does not)."""

from __future__ import annotations

import json
from typing import Optional

from trainfit.plan.chart import GROUP_COLOURS, bars
from trainfit.plan.counts import describe
from trainfit.plan.items import GIB as GB, gib
from trainfit.plan.memory import Plan, verdict

GROUP_ORDER = ("policy", "reference", "reward", "value", "engine", "rollout", "activations", "overhead")


def _gb(x: Optional[int]) -> str:
    return "" if not x else gib(x)


def render(p: Plan, console) -> None:
    from rich.markup import escape
    from rich.table import Table

    rl = "rollout" in p.phases
    src = (p.lengths or {}).get("source")
    length = f"{p.seq_len} tokens" + (" (from the data)" if src == "data" else " (at the caps)" if src == "caps" else "")
    split = p.devices   # distributed.rollout_gpus: the rollout column is the rollout GPU, train the training GPU
    gpus = (f"{len(split['train'])} training GPU + {len(split['rollout'])} rollout GPU" if split
            else f"{p.world} GPU{'s' if p.world > 1 else ''}")
    title = (f"{p.model} - {p.stage} {p.method}, {p.dtype} - micro {p.micro_batch} x {length}, "
             f"accumulation {p.accumulation}, {gpus}")
    table = Table(title=title, title_justify="left", show_lines=False)
    table.add_column("component")
    if rl:
        table.add_column(f"rollout GPU {_ids(split['rollout'])} GiB" if split else "rollout GiB", justify="right")
    table.add_column(f"training GPU {_ids(split['train'])} GiB" if split else "train GiB", justify="right")
    table.add_column("CPU RAM GiB", justify="right")
    table.add_column("note", style="dim")
    for item in sorted(p.items, key=lambda i: GROUP_ORDER.index(i.group) if i.group in GROUP_ORDER else 99):
        row = [item.name] + ([_gb(item.rollout)] if rl else []) + [_gb(item.train), _gb(item.cpu), item.note]
        table.add_row(*row)
    table.add_section()
    totals = ["per-GPU peak"] + ([_gb(p.phases["rollout"].total)] if rl else []) + [
        _gb(p.phases["train"].total), _gb(p.cpu_ram) + (" /node" if p.cpu_ram else ""),
        f"train peak at: {p.phases['train'].step}"]
    if "scoring" in p.phases and split:   # the worker's scoring forward, on the rollout GPU
        table.add_row("scoring peak", _gb(p.phases["scoring"].total), "", "",
                      f"at: {p.phases['scoring'].step} (no grad, on the rollout GPU)", style="bold")
    elif "scoring" in p.phases:   # a no-grad scoring forward: its own phase, at or below the train peak
        table.add_row(*(["scoring peak"] + ([""] if rl else []) + [_gb(p.phases["scoring"].total), "",
                        f"at: {p.phases['scoring'].step} (no grad)"]), style="bold")
    table.add_row(*totals, style="bold")
    console.print(table)
    console.print(f"{describe(p.counts)}. GPU: {p.gpu} ({(p.gpu_memory or 0) / GB:.1f} GiB, {p.gpu_source}); budget "
                  f"{_gb(p.budget)} GiB after a {p.margin:.0%} margin.", highlight=False)
    v = verdict(p)
    color = {"FITS": "green", "DOES NOT FIT": "red", "DOES NOT RUN": "red"}.get(v, "yellow")
    head = f"headroom {p.headroom / GB:+.2f} GiB" if p.headroom is not None else ""
    problems = list(p.problems)
    if v == "DOES NOT RUN":  # the memory fits: the problem is the verdict's reason, said first
        console.print(f"[bold red]{v}[/] - {escape(problems.pop(0))} Memory is not the problem: peak "
                      f"{_gb(p.peak)} GiB ({head}).", highlight=False, soft_wrap=True)
    else:
        console.print(f"[bold {color}]{v}[/] - peak {_gb(p.peak)} GiB ({head})"
                      + (" at the data's lengths" if p.worst_case else ""), highlight=False)
    if p.worst_case:
        w = p.worst_case
        wv = "UNKNOWN" if w["fits"] is None else ("FITS" if w["fits"] else "DOES NOT FIT")
        console.print(f"worst case at the caps ({w['seq_len']} tokens a sequence): peak {_gb(w['peak'])} GiB - "
                      f"{wv}" + "".join(f"; {k} {_gb(ph['total'])} GiB" for k, ph in w["phases"].items()),
                      highlight=False)
    for prob in problems:
        console.print(f"[red]problem:[/] {escape(prob)}", highlight=False)
    if p.suggestions:
        st = Table(title="Changes that lower the peak (planned again, cheapest first)", title_justify="left")
        st.add_column("change")
        st.add_column("saves GiB", justify="right")
        st.add_column("fits")
        st.add_column("overrides", style="dim")
        for s in p.suggestions:  # escaped: "trainfit[deepspeed]" is not markup
            st.add_row(escape(s.change), _gb(s.saving), "yes" if s.fits else "no", " ".join(s.overrides))
        console.print(st)
    if p.training_machine:
        console.print(p.training_machine, highlight=False, markup=False, soft_wrap=True)
    for note in p.notes:
        console.print(f"[dim]note: {escape(note)}[/]", highlight=False)


def _ids(gpus: list[int]) -> str:
    return ",".join(map(str, gpus))


def to_json(p: Plan) -> str:
    d = p.to_dict()
    d["suggestions"] = [s.__dict__ if hasattr(s, "__dict__") else s for s in p.suggestions]
    return json.dumps(d, indent=2, default=lambda o: o.__dict__ if hasattr(o, "__dict__") else str(o))


def save_png(plans: list[Plan], path: str) -> None:
    """One row a stage: each phase a bar stacked from its components (chart.bars, the numbers `--html` draws),
    the card and the budget as lines, the peak marked, and the notes beside the bars.

    Drawn with matplotlib, not plotly: plotly writes PNGs only through kaleido, an extra package that
    downloads its own Chromium; matplotlib is already a dependency (the trainer's metrics.png)."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    charts = [bars(p) for p in plans]
    width = 3.0 + 1.9 * max(len(c.bars) for c in charts)
    fig, axes = plt.subplots(len(charts), 2, figsize=(width + 5.5, 5.2 * len(charts)), squeeze=False,
                             gridspec_kw={"width_ratios": [width, 5.5]})
    for c, (ax, side) in zip(charts, axes):
        names = [b.phase for b in c.bars]
        top = 1.12 * max([c.peak_gib] + [v for v in (c.capacity_gib, c.budget_gib) if v])
        bottoms, labelled = [0.0] * len(names), set()
        for k, b in enumerate(c.bars):
            for s in b.segments:
                ax.bar(k, s.gib, bottom=bottoms[k], width=0.55, color=GROUP_COLOURS.get(s.group, "#aaaaaa"),
                       edgecolor="white", linewidth=0.6)
                if s.gib >= 0.04 * top:   # name the blocks tall enough to hold a label
                    ax.text(k, bottoms[k] + s.gib / 2, textwrap.shorten(s.name, 34), ha="center", va="center",
                            fontsize=6)
                labelled.add(s.group)
                bottoms[k] += s.gib
            ax.text(k, b.total_gib, f"{b.total_gib:.2f} GiB", ha="center", va="bottom", fontsize=8)
        k_peak = names.index(c.peak_phase)
        ax.plot([k_peak], [c.peak_gib], marker="v", color="#d62728", markersize=10, linestyle="none",
                label=f"peak {c.peak_gib:.2f} GiB")
        if c.capacity_gib:
            ax.axhline(c.capacity_gib, color="black", lw=1.4, label=f"{c.gpu} ({c.capacity_gib:.1f} GiB)")
        if c.budget_gib:
            ax.axhline(c.budget_gib, color="#d62728", ls="--", lw=1.2, label=f"budget ({c.margin:.0%} margin)")
        if c.capacity_gib and c.budget_gib:
            ax.axhspan(c.budget_gib, c.capacity_gib, color="#d62728", alpha=0.08)
        for g in labelled:
            ax.bar(0, 0, color=GROUP_COLOURS.get(g, "#aaaaaa"), label=g)   # a legend entry per group
        ax.set_xticks(range(len(names)), names)
        ax.set_ylim(0, top)
        ax.set_ylabel("GiB per GPU")
        ax.set_title(f"{c.stage}: {c.verdict}", fontsize=10, loc="left")
        ax.legend(fontsize=7, loc="upper left")
        side.axis("off")
        side.text(0, 1, "\n".join(textwrap.fill(n, 70, subsequent_indent="  ") for n in
                                  [textwrap.fill(c.title, 70)] + [f"- {n}" for n in c.notes]),
                  va="top", ha="left", fontsize=7, transform=side.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
