"""A plan as the numbers of its picture: per phase, the stacked components that make its total, with the
card's capacity, the budget after the margin, the peak, and the notes. `trainfit plan --png` draws them with
matplotlib (plan/report.py) and `--html` with plotly (app/plan_html.py), both from `bars(plan)`, so the two
pictures show the same bytes. No plotting library is imported here: the planner never needs one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from trainfit.plan.memory import Plan, verdict

GiB = 2 ** 30
# Colours by group (the table's order): one hue a group, so a stage's policy states read as one block.
GROUP_COLOURS = {"policy": "#1f77b4", "reference": "#9467bd", "reward": "#e377c2", "value": "#8c564b",
                 "engine": "#17becf", "rollout": "#bcbd22", "activations": "#ff7f0e", "overhead": "#7f7f7f"}


@dataclass
class Segment:
    name: str
    group: str
    gib: float
    note: str = ""


@dataclass
class Bar:
    phase: str
    step: str           # the sub-step that peaks in this phase
    total_gib: float    # Phase.total: the segments sum to it
    segments: list[Segment] = field(default_factory=list)


@dataclass
class Chart:
    title: str
    stage: str
    verdict: str
    capacity_gib: Optional[float]   # the card's memory
    budget_gib: Optional[float]     # capacity less the margin
    margin: float
    gpu: Optional[str]
    peak_gib: float
    peak_phase: str
    bars: list[Bar]
    notes: list[str]                # problems first, then the plan's notes


def bars(p: Plan) -> Chart:
    """The plan's phases as stacked bars. Rollout and train stack the plan's items (their bytes in that
    phase, which sum to the phase's total). The scoring phase has no items of its own (memory.py builds it
    from the train phase): it stacks the states resident from the train phase, the largest no-grad scoring
    forward, and the CUDA context with fragmentation."""
    out = []
    on = {"rollout": "rollout", "scoring": "rollout", "train": "train"}
    # distributed.rollout_gpus: each phase is one device's (memory.py), named with its GPU
    def label(k: str) -> str:
        return f"{k} (GPU {','.join(map(str, p.devices[on[k]]))})" if p.devices else k
    for name, ph in p.phases.items():
        if name == "scoring" and p.devices:
            fwd = p.substeps.get(ph.step, 0)
            segs = [Segment("resident on the rollout GPU (worker's copy, snapshots, reference)", "rollout",
                            (ph.allocated - fwd) / GiB, "what the rollout GPU holds through both phases"),
                    Segment(f"{ph.step} (no grad)", "activations", fwd / GiB, "the worker's scoring forward"),
                    Segment("CUDA context + allocator fragmentation", "overhead", (ph.total - ph.allocated) / GiB)]
        elif name == "scoring":
            fwd = p.substeps.get(ph.step, 0)
            segs = [Segment("resident states (as in train, without gradients)", "policy", (ph.allocated - fwd) / GiB,
                            "the train phase's states less its peaking sub-step and the freed gradients"),
                    Segment(f"{ph.step} (no grad)", "activations", fwd / GiB, "the largest scoring forward"),
                    Segment("CUDA context + allocator fragmentation", "overhead", (ph.total - ph.allocated) / GiB)]
        else:
            segs = [Segment(i.name, i.group, getattr(i, name) / GiB, i.note) for i in p.items if getattr(i, name)]
        out.append(Bar(label(name), ph.step, ph.total / GiB, segs))
    peak_phase = label(max(p.phases, key=lambda k: p.phases[k].total))
    gpus = (f"{len(p.devices['train'])} training GPU + {len(p.devices['rollout'])} rollout GPU" if p.devices
            else f"{p.world} GPU{'s' if p.world > 1 else ''}")
    title = (f"{p.model}: {p.stage} {p.method}, {p.dtype}, micro {p.micro_batch} x {p.seq_len} tokens, {gpus}")
    return Chart(title=title, stage=p.stage, verdict=verdict(p),
                 capacity_gib=p.gpu_memory / GiB if p.gpu_memory else None,
                 budget_gib=p.budget / GiB if p.budget else None, margin=p.margin, gpu=p.gpu,
                 peak_gib=p.peak / GiB, peak_phase=peak_phase, bars=out,
                 notes=[f"problem: {x}" for x in p.problems] + list(p.notes))
