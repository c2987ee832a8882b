"""Showing a plan: a rich table per component and phase, and JSON for machines (its pictures: the PNG is
plan/chart_png.py, the HTML page app/plan_html.py, both drawing plan/chart_layout.py)."""

from __future__ import annotations

import json
from typing import Optional

from trainfit.plan.counts import describe, gpus_text
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
    gpus = gpus_text(p)
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
    head = _headroom(p.headroom)
    problems = list(p.problems)
    if v == "DOES NOT RUN":  # the memory fits: the problem is the verdict's reason, said first
        console.print(f"[bold red]{v}[/] - {escape(problems.pop(0))} Memory is not the problem: peak "
                      f"{_gb(p.peak)} GiB ({head}).", highlight=False, soft_wrap=True)
    else:
        console.print(f"[bold {color}]{v}[/] - peak {_gb(p.peak)} GiB" + (f" ({head})" if head else "")
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


def _headroom(h: Optional[int]) -> str:
    """`headroom 3.20 GiB`, or `over the budget by 1,381.73 GiB`: a plan over its budget has no negative headroom."""
    if h is None:
        return ""
    return f"headroom {h / GB:,.2f} GiB" if h >= 0 else f"over the budget by {-h / GB:,.2f} GiB"


def _ids(gpus: list[int]) -> str:
    return ",".join(map(str, gpus))


def to_json(p: Plan) -> str:
    d = p.to_dict()
    d["suggestions"] = [s.__dict__ if hasattr(s, "__dict__") else s for s in p.suggestions]
    return json.dumps(d, indent=2, default=lambda o: o.__dict__ if hasattr(o, "__dict__") else str(o))

