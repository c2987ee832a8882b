"""A plan as the numbers of its picture: per phase, the stacked components that make its total on the device,
the CPU RAM bar (offloaded states, host copies, the async queue) beside them, the card's capacity, the budget
after the margin, the peak, a header (the models and their parameters, the parallelism, the packages the
training machine needs) and the notes. `trainfit plan --png` (plan/chart_png.py) and `--html`
(app/plan_html.py) both draw `chart_layout.layout(bars(plan))`, so the two pictures show the same bytes at the
same places. No plotting library is imported here: the planner never needs one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from trainfit.core.machine import cpu_ram
from trainfit.plan.counts import count_text, describe, gpus_text
from trainfit.plan.memory import Plan, verdict
from trainfit.plan.topology import describe_parallelism

GiB = 2 ** 30
# Colours by group (the table's order): one hue a group, each component a shade of it (shades()), so a
# model's states read as one family and the legend still tells its blocks apart.
GROUP_COLOURS = {"policy": "#1f77b4", "reference": "#9467bd", "reward": "#e377c2", "value": "#8c564b",
                 "engine": "#17becf", "rollout": "#bcbd22", "activations": "#ff7f0e", "overhead": "#7f7f7f"}
# The legend's group titles: the model (or the part of the step) a group's blocks belong to.
ROLES = {"policy": "policy", "reference": "reference", "reward": "reward model", "value": "critic",
         "engine": "rollout engine", "rollout": "rollout", "activations": "activations and logits",
         "overhead": "CUDA context and fragmentation"}
COUNT_OF = {"policy": "policy", "reference": "reference", "reward": "reward model", "value": "critic"}


@dataclass
class Segment:
    name: str
    group: str
    gib: float
    note: str = ""
    colour: str = ""


@dataclass
class Bar:
    phase: str
    step: str           # the sub-step that peaks in this phase
    total_gib: float    # Phase.total: the segments sum to it
    segments: list[Segment] = field(default_factory=list)


@dataclass
class LegendGroup:
    group: str                                  # the components' group (GROUP_COLOURS)
    title: str                                  # "policy: Qwen/Qwen2.5-7B (7.62B parameters)"
    entries: list[tuple[str, str]]              # (component, colour)


@dataclass
class Chart:
    title: str
    stage: str
    verdict: str
    capacity_gib: Optional[float]   # the device's memory (the card, or this machine's RAM on a CPU device)
    budget_gib: Optional[float]     # capacity less the margin (None on a CPU device: the margin is the card's)
    margin: float
    gpu: Optional[str]
    peak_gib: float
    peak_phase: str
    bars: list[Bar]
    notes: list[str]                # problems first, then the plan's notes
    device: str = "gpu"             # gpu | cpu: what the phase bars are drawn against
    device_name: str = ""           # "A100 80GB" or "CPU (this machine's RAM)"
    cpu: Optional[Bar] = None       # CPU RAM per node
    ram_gib: Optional[float] = None  # the node's RAM, when known (this machine's, when it is the node)
    ram_source: str = ""
    header: list[str] = field(default_factory=list)
    legend: list[LegendGroup] = field(default_factory=list)


def shades(base: str, n: int) -> list[str]:
    """n distinct shades of `base`, dark to light: mixed with black below the base and white above it."""
    r, g, b = (int(base[i:i + 2], 16) for i in (1, 3, 5))
    out = []
    for k in range(n):
        t = 0.0 if n == 1 else -0.35 + 0.9 * k / (n - 1)     # -0.35 (darker) .. +0.55 (lighter)
        mix = (lambda c: c * (1 + t)) if t < 0 else (lambda c: c + (255 - c) * t)
        out.append("#" + "".join(f"{max(0, min(255, round(mix(c)))):02x}" for c in (r, g, b)))
    return out


def _scoring_segments(p: Plan, ph) -> list[Segment]:
    """The scoring phase stacks what stays resident from the train phase (each model's states as in train,
    less the peaking sub-step's temporaries and the freed gradients), its largest no-grad forward, and the
    CUDA context with fragmentation. The peaking sub-step's items are the last the plan lists before its
    overhead (memory._build appends them there); when they cannot be found so, the resident bytes are one
    block, so the bar still sums to the phase."""
    fwd = p.substeps.get(ph.step, 0)
    tail = [Segment(f"{ph.step} (no grad)", "activations", fwd / GiB, "the largest scoring forward"),
            Segment("CUDA context + allocator fragmentation", "overhead", (ph.total - ph.allocated) / GiB)]
    body = [i for i in p.items if i.train and i.group not in ("overhead", "engine")]
    step_bytes, k = p.substeps.get(p.phases["train"].step, 0), len(body)
    while k > 0 and sum(i.train for i in body[k:]) < step_bytes:
        k -= 1
    resident = [i for i in body[:k] if not i.between_steps]
    if sum(i.train for i in body[k:]) == step_bytes and sum(i.train for i in resident) == ph.allocated - fwd:
        return [Segment(i.name, i.group, i.train / GiB, i.note) for i in resident] + tail
    return [Segment("resident states (as in train, without gradients)", "policy", (ph.allocated - fwd) / GiB,
                    "the train phase's states less its peaking sub-step and the freed gradients")] + tail


def _phase_bars(p: Plan) -> list[Bar]:
    on = {"rollout": "rollout", "scoring": "rollout", "train": "train"}

    def label(k: str) -> str:   # distributed.rollout_gpus: each phase is one device's (memory.py)
        return f"{k} (GPU {','.join(map(str, p.devices[on[k]]))})" if p.devices else k
    out = []
    for name, ph in p.phases.items():
        if name == "scoring" and p.devices:
            fwd = p.substeps.get(ph.step, 0)
            segs = [Segment("resident on the rollout GPU (worker's copy, snapshots, reference)", "rollout",
                            (ph.allocated - fwd) / GiB, "what the rollout GPU holds through both phases"),
                    Segment(f"{ph.step} (no grad)", "activations", fwd / GiB, "the worker's scoring forward"),
                    Segment("CUDA context + allocator fragmentation", "overhead", (ph.total - ph.allocated) / GiB)]
        elif name == "scoring":
            segs = _scoring_segments(p, ph)
        else:
            segs = [Segment(i.name, i.group, getattr(i, name) / GiB, i.note) for i in p.items if getattr(i, name)]
        out.append(Bar(label(name), ph.step, ph.total / GiB, segs))
    return out


def _cpu_bar(p: Plan) -> Bar:
    """CPU RAM per node: each item's bytes per process times the node's training processes (memory.py's
    cpu_ram), so the bar sums to the plan's CPU RAM."""
    per_node = p.topology.get("processes_per_node", 1)
    segs = [Segment(i.name, i.group, i.cpu * per_node / GiB, i.note) for i in p.items if i.cpu]
    return Bar("CPU RAM per node" + (f" ({per_node} processes)" if per_node > 1 else ""), "", p.cpu_ram / GiB, segs)


def _on_cpu(p: Plan) -> bool:
    """Whether `train` runs this config on the CPU: train.device=cpu, or auto with no GPU given or detected."""
    device = p.topology.get("device", "auto")
    return device == "cpu" or (device == "auto" and p.gpu_source == "assumed")


def _ram(p: Plan, on_cpu: bool) -> tuple[Optional[float], str]:
    """The node's RAM when this machine is the node: it runs the CPU config, or its GPU was detected here."""
    if on_cpu or p.gpu_source.startswith("detected"):
        total = cpu_ram().get("total")
        if total:
            return total / GiB, "this machine"
    return None, ""


def _legend(p: Plan, bars_: list[Bar]) -> list[LegendGroup]:
    """A group a model (or part of the step), titled with its model and parameters; each component its shade,
    the same shade wherever it is drawn. Sets each segment's colour."""
    names: dict[str, list[str]] = {}
    for b in bars_:
        for s in b.segments:
            if s.name not in names.setdefault(s.group, []):
                names[s.group].append(s.name)
    counts = {c.model: c for c in p.counts}
    models = p.topology.get("models", {})
    groups = []
    for g in sorted(names, key=lambda k: list(GROUP_COLOURS).index(k) if k in GROUP_COLOURS else 99):
        colours = dict(zip(names[g], shades(GROUP_COLOURS.get(g, "#aaaaaa"), len(names[g]))))
        for b in bars_:
            for s in b.segments:
                if s.group == g:
                    s.colour = colours[s.name]
        title = ROLES.get(g, g)
        c = counts.get(COUNT_OF.get(g, ""))
        model = models.get(g) or (p.model if g in ("policy", "reference") else None)
        if model and g in COUNT_OF:
            title += f": {model}"
        if c is not None:
            title += (f" ({count_text(c.params)} parameters, " + (f"{count_text(c.trainable)} trainable)" if c.trained
                                                                 else "frozen)"))
        groups.append(LegendGroup(g, title, list(colours.items())))
    return groups


def bars(p: Plan) -> Chart:
    """The plan's phases as stacked bars. Rollout and train stack the plan's items (their bytes in that
    phase, which sum to the phase's total); scoring stacks the models resident from train (_scoring_segments);
    the CPU RAM bar stacks the items' CPU bytes per node."""
    out = _phase_bars(p)
    cpu_bar = _cpu_bar(p)
    on_cpu = _on_cpu(p)
    ram, ram_source = _ram(p, on_cpu)
    peak_phase = out[max(range(len(out)), key=lambda k: out[k].total_gib)].phase
    gpus = gpus_text(p)
    where = "on the CPU" if on_cpu else gpus
    title = f"{p.model}: {p.stage} {p.method}, {p.dtype}, micro {p.micro_batch} x {p.seq_len} tokens, {where}"
    header = [describe(p.counts) + "." if p.counts else f"{p.params / 1e9:.2f}B parameters.",
              "Parallelism: " + (describe_parallelism(p.topology, on_cpu) or gpus) + ".",
              (p.training_machine or "needed on the training machine: nothing beyond trainfit's own install").rstrip(".")
              + "."]
    if on_cpu:
        header.append(f"Device: the CPU (train.device={p.topology.get('device', 'auto')}"
                      + (", no GPU given or detected" if p.gpu_source == "assumed" else "")
                      + "): the bars are drawn against " + (f"{ram_source}'s RAM ({ram:.1f} GiB)" if ram else
                                                            "the machine's RAM (not known here)")
                      + f"; the verdict is the plan's, on {p.gpu}.")
    legend = _legend(p, out + [cpu_bar])
    card = p.gpu_memory / GiB if p.gpu_memory else None
    return Chart(title=title, stage=p.stage, verdict=verdict(p),
                 capacity_gib=ram if on_cpu else card,
                 budget_gib=None if on_cpu else (p.budget / GiB if p.budget else None), margin=p.margin, gpu=p.gpu,
                 peak_gib=p.peak / GiB, peak_phase=peak_phase, bars=out,
                 notes=[f"problem: {x}" for x in p.problems] + list(p.notes),
                 device="cpu" if on_cpu else "gpu",
                 device_name=(f"{ram_source}'s RAM" if ram else "CPU") if on_cpu else (p.gpu or "card"),
                 cpu=None if on_cpu else cpu_bar, ram_gib=ram, ram_source=ram_source, header=header, legend=legend)
