"""Per-GPU memory of a training config, by component and phase, before anything runs.

Each component is counted for the two phases of a step: `rollout` (GRPO/PPO generation) and `train`
(scoring forwards, forward/backward, optimizer step). Within the training phase the sub-step with
the highest peak is the one reported (forward/backward, optimizer step, or a no-grad scoring
forward); all sub-steps are kept in `Plan.substeps`. A stage with a no-grad scoring forward (DPO's
reference, GRPO/PPO's reference, old log-probs or reward model) also gets a `scoring` phase: the
train phase's resident bytes plus its largest scoring forward, the phase the trainer measures as
`scoring` (train/memstats.py).

Stated constants (not measured per machine):
- CUDA_CONTEXT: 512 MiB per process for the CUDA context and cuBLAS/cuDNN workspaces, which
  torch.cuda.max_memory_allocated does not see but the card does.
- FRAGMENTATION: 5% of allocated bytes that the caching allocator holds in partly used blocks.
The rollout engine's constants are in rollout.py. Model states are counted (states.py), the body's
activations traced (trace.py), the head and loss traced at their exact size (head.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

from trainfit.config import Config, ConfigError, RolloutConfig, shared_gpu_note, validate
from trainfit.config.stages import stage_spec
from trainfit.plan import components, hardware
from trainfit.plan.counts import plan_counts
from trainfit.plan.items import Item, Phase
from trainfit.plan.lengths import Lengths, cap_lengths, caps, data_lengths
from trainfit.plan.preference import pair_work
from trainfit.plan.rollout import async_items, rollout_items
from trainfit.plan.screens import rollout_screens, screens_dict
from trainfit.plan.topology import topology
from trainfit.plan.work import work_summary

MiB, GiB = 1024 ** 2, 1024 ** 3
CUDA_CONTEXT = 512 * MiB
FRAGMENTATION = 0.05
DEFAULT_GPU = "h100-80gb"
# The sub-steps (`Plan.substeps`) that are no-grad scoring forwards: the `scoring` phase.
SCORING_SUBSTEPS = ("reference forward", "old log-probs forward", "reward forward", "kto z0 forward")


@dataclass
class Plan:
    model: str
    stage: str
    method: str
    dtype: str
    gpu: Optional[str]
    gpu_memory: Optional[int]
    gpu_source: str
    num_gpus: int
    world: int
    params: int
    trainable_params: int
    seq_len: int
    micro_batch: int
    accumulation: int
    items: list[Item]
    phases: dict[str, Phase]
    substeps: dict[str, int]
    peak: int
    budget: Optional[int]
    margin: float
    fits: Optional[bool]
    headroom: Optional[int]
    cpu_ram: int        # per node
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    suggestions: list = field(default_factory=list)
    work: dict = field(default_factory=dict)
    prompt_len: int = 0
    lengths: dict = field(default_factory=dict)   # lengths.Lengths: measured from the data, or the caps
    # The same plan at the configured caps (max_prompt_length + max_new_tokens, max_seq_length), when the
    # data is shorter: {seq_len, prompt_len, phases {name: {allocated, total}}, peak, fits}; else None.
    worst_case: Optional[dict] = None
    # One entry per model the stage holds (counts.Count): the trained ones sum to the trainer's start line.
    counts: list = field(default_factory=list)
    # "needed on the training machine: ..." (core/extras.training_machine_line): the packages only the
    # trainer imports, which the plan does not need here; None when the stage needs none.
    training_machine: Optional[str] = None
    # distributed.rollout_gpus: {"train": [GPU indices], "rollout": [...]} (config/devices.py). The phases are
    # then per device: `rollout` and `scoring` on the rollout GPU, `train` on the training GPU. Else {}.
    devices: dict = field(default_factory=dict)
    # Nodes, GPUs, engine and ZeRO stage, offload, the models held (topology.py), for the pictures.
    topology: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["verdict"] = verdict(self)
        return d


def verdict(p: Plan) -> str:
    """FITS, DOES NOT FIT (the peak is over the budget), DOES NOT RUN (the memory fits, but a problem
    of the plan stops the run, e.g. screenshots over the episode's token budget), or UNKNOWN (no card)."""
    if p.fits is None:
        return "UNKNOWN"
    if p.fits:
        return "FITS"
    return "DOES NOT RUN" if p.problems and p.headroom is not None and p.headroom >= 0 else "DOES NOT FIT"


def with_gpus(cfg: Config, num_gpus: Optional[int]) -> Config:
    if num_gpus is None or num_gpus == cfg.distributed.num_gpus:
        return cfg

    raw = cfg.model_dump()
    raw["distributed"]["num_gpus"] = num_gpus
    try:
        return validate(raw)
    except ConfigError as e:
        raise ConfigError(f"With {num_gpus} GPUs per node: {e}") from None


def seq_lengths(cfg: Config) -> tuple[int, int]:
    """(prompt tokens, tokens per training sequence) at the caps (lengths.cap_lengths)."""
    return cap_lengths(cfg)


def plan(cfg: Config, gpu: Optional[str] = None, num_gpus: Optional[int] = None, *,
         margin: Optional[float] = None, from_data: bool = True) -> Plan:
    """The bare plan of `cfg` (plan_on without its card); trainfit.plan.plan adds the suggestions."""
    return plan_on(cfg, gpu, num_gpus, margin=margin, from_data=from_data)[0]


def plan_on(cfg: Config, gpu: Optional[str] = None, num_gpus: Optional[int] = None, *,
            margin: Optional[float] = None, from_data: bool = True) -> tuple[Plan, hardware.GPU]:
    """Plan the per-GPU memory of `cfg` on `gpu` (name, else hardware.gpu, else NVML, else H100 80GB), and
    the card it was planned on.

    Sequences are planned at the lengths the data gives (lengths.py: the run's tokenizer on its
    prompts / items; `from_data=False` or unknown data: the caps); when those are shorter than the
    caps, the plan at the caps is attached as `worst_case`."""
    cfg = with_gpus(cfg, num_gpus)
    card, how = hardware.resolve_gpu(gpu, cfg.hardware)   # an unknown name: UnknownGPU, a ConfigError
    notes: list[str] = []
    if card is None:
        card, how = hardware.find_gpu(DEFAULT_GPU), "assumed"
        notes.append(f"No GPU given or detected: planned for {card.name}; pass --gpu NAME.")
    margin = cfg.hardware.memory_margin if margin is None else margin
    lens = data_lengths(cfg) if from_data else caps(cfg)
    p = _build(cfg, card, how, list(notes), margin, lens)
    if (lens.prompt, lens.seq) != (lens.cap_prompt, lens.cap_seq):
        w = _build(cfg, card, how, list(notes), margin, caps(cfg))
        p.worst_case = {"seq_len": w.seq_len, "prompt_len": w.prompt_len, "peak": w.peak, "fits": w.fits,
                        "phases": {k: {"allocated": v.allocated, "total": v.total} for k, v in w.phases.items()}}
        p.notes.append(f"Worst case at the caps ({_caps_text(cfg.stage, cfg.rollout, w)}): peak {w.peak / GiB:.2f} GiB"
                       + ("" if w.fits is None else f", {'fits' if w.fits else 'does NOT fit'} the budget") + ".")
    return p, card


def _caps_text(stage: str, r: RolloutConfig, w: Plan) -> str:
    if stage_spec(stage).rollout:
        return (f"prompts of rollout.max_prompt_length={r.max_prompt_length} + max_new_tokens, "
                f"{w.seq_len} tokens a sequence")
    return f"data.max_seq_length={w.seq_len} tokens a sequence"


def _build(cfg: Config, card: hardware.GPU, how: str, notes: list[str], margin: float, lens: Lengths) -> Plan:
    """The plan's components (components.py) assembled into the phases of a step."""
    c = components.start(cfg, notes, lens)
    m, pe, accum = cfg.model, cfg.peft, c.bp.accumulation
    items: list[Item] = []
    pol, wdesc = components.policy_states(c, items)
    # Training sub-steps: bytes above the resident states.
    fb, fb_forward, screens = components.forward_backward(c, pol)
    c.substeps["policy forward/backward"] = fb
    opt = c.substeps["optimizer step"] = components.optimizer_step(c, pol)
    ref_copy, rf = components.scoring_models(c, items)
    val, vf = components.critic(c, items, pol, wdesc, fb_forward, opt) if c.stage.critic else (None, None)
    problems: list[str] = []
    shared = shared_gpu_note(cfg.rollout.mode, cfg.device_split(), "cpu" if cfg.train.device == "cpu" else "cuda")
    notes += [shared] if shared else []
    split = cfg.device_split() if c.rl and cfg.rollout.mode == "async" else None
    split = split if split is not None and split.separate else None
    # With rollout GPUs, what the worker holds lives on them: its engine's items, its copy, and a full
    # fine-tune's reference copy (only the worker scores with it, train/async_rollout.py).
    on_rollout = [i for i in items if i.group == "reference" and i.rollout] if split else []
    first = len(items)
    if c.rl:
        rollout_items(Item, items, cfg, c.facts, c.tr, card, lens.prompt, c.seq, c.bp, notes, problems)
        if cfg.rollout.mode == "async":
            async_items(Item, items, cfg, pol, c.seq, c.bp, notes, own_device=split is not None)
    if screens:  # the episode's token budget; each engine's share for the screenshots
        rollout_screens(Item, items, cfg, c.src, c.facts, screens, c.bp, notes, problems)
    on_rollout += items[first:]
    totals = {k: sum(i.train for i in v) for k, v in c.substeps.items()}
    # The training GPU peaks at its own sub-steps; the scoring forwards run on the rollout GPU.
    step_name = max((k for k in totals if not (split and k in SCORING_SUBSTEPS)), key=totals.get)
    resident = _by_device(items, on_rollout) if split else 0
    items += [i for i in c.substeps[step_name] if i.train]
    phases, overhead = _phases(cfg.rollout, items, c.rl, step_name)
    if split:
        phases = _rollout_gpu_scoring(phases, totals, resident)
        notes.append(f"distributed.rollout_gpus={cfg.distributed.rollout_gpus}: {split.describe()}; the "
                     "rollout column is the rollout GPU, the train column the training GPU.")
    else:
        phases = _with_scoring(phases, totals, step_name, sum(i.train for i in items if i.between_steps))
    items.append(Item("CUDA context + allocator fragmentation", "overhead", **overhead,
                      note=f"{CUDA_CONTEXT // MiB} MiB context + {FRAGMENTATION:.0%} of allocated"))
    peak = max(ph.total for ph in phases.values())
    budget = int(card.memory * (1 - margin))
    if card.detected and card.free is not None and card.free < peak:
        notes.append(f"Only {card.free / 2**30:.1f} GiB of the card is free now (other processes).")
    tag = {"none": "", "4bit": f" + {m.bnb_4bit_quant_type.upper()} base", "8bit": " + int8 base"}[m.quantization]
    return Plan(model=m.name, stage=cfg.stage, method=("full" if c.full else f"{pe.method} r={pe.r}") + tag,
                dtype=m.dtype, gpu=card.name, gpu_memory=card.memory, gpu_source=how,
                num_gpus=cfg.distributed.num_gpus, world=cfg.world_size, params=c.facts.n_params,
                trainable_params=pol.trainable_params, seq_len=c.row_seq, micro_batch=cfg.train.micro_batch_size,
                accumulation=accum, items=[i for i in items if i.rollout or i.train or i.cpu], phases=phases,
                substeps=totals, peak=peak, budget=budget, margin=margin, fits=peak <= budget and not problems,
                headroom=budget - peak,
                cpu_ram=sum(i.cpu for i in items) * (cfg.world_size // cfg.distributed.num_nodes),  # training processes
                problems=problems, notes=notes,
                work=_work(cfg, c.facts, pol, c.bp, lens.prompt, c.row_seq, c.par, val is not None, c.work_seq,
                           pol.asleep + (val.asleep if val is not None else 0)),
                prompt_len=lens.prompt,
                lengths=lens.summary() | ({"screens": screens_dict(screens)} if screens else {}),
                counts=plan_counts(cfg, c.facts, pol, ref_copy, vf, val, rf),
                devices={"train": list(split.train), "rollout": list(split.rollout)} if split else {},
                topology=topology(cfg))


def _phases(r: RolloutConfig, items: list[Item], rl: bool, step_name: str) -> tuple[dict, dict]:
    """Each phase's allocated bytes, its total on the card (fragmentation, the CUDA context, the vLLM
    envelope whole), and the overhead per phase."""
    phases, overhead = {}, {}
    for ph in (("rollout", "train") if rl else ("train",)):
        alloc = sum(getattr(i, ph) for i in items if i.group != "engine")
        envelope = sum(getattr(i, ph) for i in items if i.group == "engine")  # vLLM's budget is whole already
        overhead[ph] = int(alloc * FRAGMENTATION) + CUDA_CONTEXT
        phases[ph] = Phase(ph, alloc, alloc + envelope + overhead[ph], step_name if ph == "train" else
                           {"hf": "HF generate", "vllm": "vLLM generation", "openai": "remote"}[r.engine])
    return phases, overhead


def _with_scoring(phases: dict, totals: dict, step_name: str, grads: int) -> dict:
    """The phases with `scoring` (between rollout and train) when a scoring forward runs: the train phase's
    resident bytes (its allocated less the peaking sub-step, less the accumulated gradients `grads`: the
    scoring forwards run before the step's first backward, the last step's gradients already freed) plus
    the largest scoring sub-step."""
    scoring = [k for k in SCORING_SUBSTEPS if k in totals]
    if not scoring:
        return phases
    name = max(scoring, key=totals.get)
    alloc = phases["train"].allocated - totals[step_name] - grads + totals[name]
    out = {k: v for k, v in phases.items() if k == "rollout"}
    out["scoring"] = Phase("scoring", alloc, alloc + int(alloc * FRAGMENTATION) + CUDA_CONTEXT, name)
    return {**out, "train": phases["train"]}


def _by_device(items: list[Item], on_rollout: list[Item]) -> int:
    """Re-reads the columns per device: an item of the rollout GPU (`on_rollout`) keeps its bytes there in
    the `rollout` column (whichever phase it was counted in) and none on the training GPU; every other item
    is the training GPU's (`train` column), which generates nothing. Returns the rollout GPU's resident
    bytes (those held through both phases: the copy, snapshots, a reference, a graph-kept cache)."""
    ids = {id(i) for i in on_rollout}
    resident = 0
    for i in items:
        if id(i) in ids:
            resident += max(i.rollout, i.train) if i.train else 0
            i.rollout, i.train = max(i.rollout, i.train), 0
        else:
            i.rollout = 0
    return resident


def _rollout_gpu_scoring(phases: dict, totals: dict, resident: int) -> dict:
    """The rollout GPU's `scoring` phase when a scoring forward runs: its resident bytes plus the largest
    scoring sub-step (the worker's reference forward), in place of the training GPU's."""
    scoring = [k for k in SCORING_SUBSTEPS if k in totals]
    if not scoring:
        return phases
    name = max(scoring, key=totals.get)
    alloc = resident + totals[name]
    scored = Phase("scoring", alloc, alloc + int(alloc * FRAGMENTATION) + CUDA_CONTEXT, name)
    return {"rollout": phases["rollout"], "scoring": scored, "train": phases["train"]}


def _work(cfg, facts, pol, bp, prompt: int, seq: int, par, has_value: bool, train_seq: float, asleep: int) -> dict:
    w = work_summary(cfg, facts, pol, bp, prompt, seq, par, has_value, train_seq)
    if asleep:   # the train states to CPU RAM and back around each rollout's generation, over PCIe (steptime.py)
        w["offload_bytes"] = w.get("offload_bytes", 0) + 2 * asleep
    return pair_work(cfg, w, facts, bp, train_seq) if stage_spec(cfg.stage).reference == "preference" else w


