"""`trainfit fit`: the fastest plan that fits the card, searched over the knobs the user left free.

    from trainfit.config import load_config
        r = fit(load_config("examples/sft_7b_zero2_offload.yaml"), gpu="h200")
    r.best.cfg, r.best.plan.peak, r.best.step.total, r.best.overrides, r.missing

Never changed: global batch, model, sequence lengths, stage, task. Searched, in tiers that are tried
in order (the first tier where anything fits wins, so a method is only changed when needed):
  0 same training math: micro-batch (accumulation derived), gradient checkpointing (none, the
    first L/4, L/2, 3L/4 or all L layers), log-probs in chunks, ZeRO stage (several GPUs),
    optimizer/parameter offload (--allow-offload, or already on), rollout memory share (vLLM) or
    sequences generated together (HF), vLLM sleep;
  1 8-bit AdamW (--allow-optimizer);  2 LoRA (--allow-method);  3 a 4-bit base (--allow-method);
  4 (--allow-screens, when the plan has environment screenshots and no earlier tier fits) fewer kept
    screenshots (rollout.max_images_per_episode) and lower model.max_pixels, never below the floors
    rollout.fit_min_images_per_episode and model.fit_min_pixels: the setting that fits with the most
    image tokens an episode (then the most pixels a screenshot) wins, whatever its speed, since it
    changes what the agent sees; the other knobs and tiers are searched on top of it.
Within a tier plans are ranked by the calibrated step-time estimate (see `estimate`); plans within
TIE of the fastest count as tied and the one changing the fewest knobs wins. Faster plans of later
allowed tiers are reported as alternatives, not chosen. ZeRO is DeepSpeed's mixed precision (fp32
master weights), so no option leaves DeepSpeed for plain torch (bf16 AdamW would change the math).

Cost: a warm plan() is ~0.3 ms, every combination ~10^4 plans; so the micro-batch and the rollout
knob are binary-searched per combination of the others (memory grows with both, speed never drops),
and a combination that only adds memory savers to one that fits at the largest micro-batch and
rollout setting is skipped: it cannot be faster; so is one that differs only in training-step knobs
from one whose rollout phase fits and runs at no setting (fit_space._rollout_neutral): it cannot fit.
"""

from __future__ import annotations

import math
import re
import time
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any, Optional

from trainfit.config import Config, ConfigError, apply_override, validate
from trainfit.core import progress
from trainfit.models.runnable import stage_not_trainable
from trainfit.plan import hardware, steptime
from trainfit.plan.memory import DEFAULT_GPU, Plan, plan
from trainfit.plan.split import compare_splits, suggest_split
from trainfit.plan.states import DTYPE_BYTES
from trainfit.plan.suggest import Suggestion, suggestions
from trainfit.plan.fit_space import (SCREENS_TIER, Allow, _adds_only_savers, _combos, _flags_for, _most_saving,
                                     _rollout_knob, _rollout_neutral, _tiers, divisors, screen_ladder, screen_overrides)

__all__ = ["Allow", "Candidate", "FitResult", "divisors", "fit", "override_list", "search", "vllm_waves"]

GiB = 2 ** 30
TIE = 0.01          # a change must buy more than 1% of estimated step time to beat fewer changes
PCIE_BPS = 25e9     # host<->GPU bytes/s, as hardware.roofline_step assumes for optimizer offload


@dataclass
class Candidate:
    cfg: Config
    plan: Plan
    step: hardware.StepTime
    tier: int
    overrides: dict[str, Any]     # dotted key -> value, against the user's config

    @property
    def fits(self) -> bool:
        return bool(self.plan.fits)

    @property
    def over(self) -> int:
        return self.plan.peak - (self.plan.budget or 0)


@dataclass
class FitResult:
    user: Optional[Candidate]          # the user's config on the target card
    best: Optional[Candidate]          # the fastest that fits, or None
    closest: Optional[Candidate]       # when nothing fits: the smallest overshoot seen
    card: hardware.GPU
    how: str = ""                      # how the card was chosen (--gpu, hardware.gpu, NVML, assumed)
    alternatives: list[Candidate] = field(default_factory=list)  # faster, in later allowed tiers
    would_fit_with: list[str] = field(default_factory=list)      # flags that make it fit when nothing does
    micro_clamped_from: Optional[int] = None  # the user's micro-batch when it did not divide the new per-GPU batch
    screens_floor: str = ""            # with --allow-screens on a plan with screenshots: how far they may be lowered
    # An RL stage on 2+ GPUs: sync against async splits of them (plan/split.py), and the split suggested.
    splits: list = field(default_factory=list)
    split_pick: Any = None
    # Nothing fits: the planner's first fitting change beyond fit's knobs (suggest.py, planned), if any.
    planner_fix: Optional[Suggestion] = None
    plan_calls: int = 0
    pruned: int = 0
    seconds: float = 0.0

    @property
    def missing(self) -> int:
        """Bytes the closest plan is over budget (0 when it fits or only has a non-memory problem)."""
        return max(0, self.closest.over) if self.closest and not self.best else 0


def override_list(ovs: dict[str, Any]) -> list[str]:
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in ovs.items()]


def knob_count(ovs: dict[str, Any]) -> int:
    """Changed knobs, counting a parallel setting (strategy, stage, offloads) or a method as one."""
    group = lambda k: "parallel" if k.startswith("distributed.") else (  # noqa: E731
        "method" if k in ("peft.method", "model.quantization") else k)
    return len({group(k) for k in ovs})


def estimate(p: Plan, cfg: Config, card: hardware.GPU, dense: Optional[Plan] = None) -> hardware.StepTime:
    """The step-time estimate of a plan (steptime.estimate: the roofline with measured efficiency
    constants, labelled with its basis), plus what its work summary leaves out: a step reads the full
    weights however they are partitioned or offloaded (bytes from `dense`, the config planned without
    ZeRO/offload); vLLM with too small a KV cache generates in waves, each re-reading the weights per
    token; HF generate under ZeRO-3/FSDP gathers the weights over the GPU link for every token, and
    with parameter offload over PCIe, which forward and backward then cross too."""
    work = dict(p.work)
    if dense is not None:
        work.update({k: dense.work[k] for k in ("train_bytes", "decode_bytes_per_step") if k in dense.work})
    waves = vllm_waves(p)
    if waves > 1 and work.get("decode_steps"):
        work["decode_steps"] = work["decode_steps"] * waves
    st = steptime.estimate(work, card, p.world)
    d, n, eng = cfg.distributed, max(1, p.world), cfg.engine()
    sharded = eng == "fsdp" or (eng == "deepspeed" and d.zero_stage == 3)
    weights = p.params * DTYPE_BYTES[cfg.model.dtype]
    hf_tokens = work.get("decode_steps", 0) if cfg.rollout.engine == "hf" else 0
    if sharded and n > 1:
        st.rollout += hf_tokens * weights * (n - 1) / n / (card.link_gbs * 1e9)
    if sharded and d.offload_params:
        st.rollout += hf_tokens * weights / n / PCIE_BPS
        st.comm += 2 * p.accumulation * weights / n / PCIE_BPS
    return st


# rollout.py states the engine's KV capacity only in its note; parsed here rather than re-deriving
# its formula (one source of truth). tests/test_fit.py checks the pattern still matches.
_VLLM_NOTE = re.compile(r"\(([\d,]+) tokens; this step needs ([\d,]+)")


def vllm_waves(p: Plan) -> int:
    for note in p.notes:
        m = _VLLM_NOTE.search(note)
        if m:
            cap, need = (int(x.replace(",", "")) for x in m.groups())
            return max(1, math.ceil(need / max(cap, 1)))
    return 1


class _Search:
    """Plans configs given as overrides of the user's, memoised; keeps the closest miss."""

    def __init__(self, base: Config, card: hardware.GPU, margin: Optional[float], cpu_ram: Optional[int]):
        self.base, self.card, self.margin, self.cpu_ram = base, card, margin, cpu_ram
        self.values = {f"{a}.{b}": v for a, sec in base.model_dump().items() if isinstance(sec, dict)
                       for b, v in sec.items()}
        self.memo: dict[tuple, Optional[Candidate]] = {}
        self.calls, self.closest = 0, None  # planner calls made; the closest miss (a Candidate)

    def get(self, ovs: dict[str, Any], tier: int, track: bool = True) -> Optional[Candidate]:
        ovs = {k: v for k, v in ovs.items() if self.values.get(k) != v}  # only real changes: the memo key
        key = tuple(sorted(ovs.items()))
        if key not in self.memo:
            self.memo[key] = self._plan(ovs, tier)
        cand = self.memo[key]
        if track and cand is not None and not cand.fits:
            c = self.closest
            # ties (a rollout phase that no training knob changes) go to the fewest knobs changed
            key = lambda x: (bool(x.plan.problems), x.over, knob_count(x.overrides))  # noqa: E731
            if c is None or key(cand) < key(c):
                self.closest = cand
        return cand

    def _plan(self, ovs: dict[str, Any], tier: int) -> Optional[Candidate]:
        raw = self.base.model_dump()
        for k, v in ovs.items():
            raw = apply_override(raw, f"{k}={v}")
        try:
            cfg = validate(raw)
            p = plan(cfg, gpu=hardware.replan_as(self.card), margin=self.margin)
        except ConfigError:
            if not ovs:
                raise  # the user's own config: its error (a model that cannot be found...) is the answer
            return None
        self.calls += 1
        progress.step(f"fit: {self.calls} plans searched on {self.card.name}")
        if p.fits and self.cpu_ram is not None and p.cpu_ram > self.cpu_ram:
            p.fits = False
            p.problems.append(f"needs {p.cpu_ram / GiB:.0f} GiB of CPU RAM per node, over --cpu-ram-gb "
                              f"{self.cpu_ram / GiB:.0f}.")
        d, dense = cfg.distributed, None
        if d.zero_stage or d.offload_optimizer or d.offload_params or d.strategy == "fsdp":
            # The same config without ZeRO/offload, planned only for the bytes its step reads (see estimate).
            flat = {"distributed.strategy": "ddp", "distributed.zero_stage": 0,
                    "distributed.offload_optimizer": False, "distributed.offload_params": False}
            dc = self.get({**ovs, **flat}, tier, track=False)
            dense = dc.plan if dc is not None else None
        return Candidate(cfg, p, estimate(p, cfg, self.card, dense), tier, ovs)


def _last(values: list, ok) -> int:
    """Index of the last value for which `ok` holds (true up to some point, then false); -1 if none.
    bisect calls `ok` only on the values it probes."""
    return bisect_left(values, True, key=lambda v: not ok(v)) - 1


def _search_combo(s: _Search, combo: dict, tier: int, micros: list[int], rkey, rvals, ruser):
    """(fitting candidates of one combination of the other knobs, whether it is saturated: fits at the
    largest micro-batch and rollout setting, whether no rollout setting both fits and runs)."""
    mine = s.base.train.micro_batch_size
    at = lambda m, r: s.get({**combo, "train.micro_batch_size": m, **({rkey: r} if rkey else {})}, tier)  # noqa: E731
    r_best = None
    if rkey:
        # The rollout phase does not depend on the micro-batch: search it at the smallest one.
        i = _last(rvals, lambda r: (c := at(micros[0], r)) is not None and c.plan.phases["rollout"].total <= c.plan.budget)
        if i < 0 or _has_problems(at(micros[0], rvals[i])):
            _runnable_miss(at, micros[0], rvals[max(i, 0):])
            return [], False, True
        r_best = rvals[i]
    # Memory grows with the micro-batch while accumulating; at accumulation 1 gradients no longer
    # accumulate in a separate buffer, so the whole per-device batch is checked on its own.
    trains = lambda m: (c := at(m, r_best)) is not None and c.plan.phases["train"].total <= c.plan.budget  # noqa: E731
    j = _last(micros[:-1], trains)
    m_best = micros[-1] if trains(micros[-1]) else (micros[j] if j >= 0 else None)
    if m_best is None:
        return [], False, False
    found = []
    for m in {m_best, mine}:
        for r in ({r_best, ruser} if rkey else {None}):
            c = at(m, r)
            if c is not None and c.fits:
                found.append(c)
    return found, bool(found) and m_best == micros[-1] and (not rkey or r_best == rvals[-1]), False


def _plainest_miss(s: _Search) -> Optional[Candidate]:
    """The closest miss with the knobs that do not change its rollout phase set back to the user's, when
    that misses by no more (pruned searches reach a rollout that fits nowhere with the fewest savers on)."""
    c = s.closest
    if c is None:
        return None
    plain = s.get({k: v for k, v in c.overrides.items() if k not in _rollout_neutral(s.base)}, c.tier, track=False)
    better = plain is not None and (bool(plain.plan.problems), plain.over) <= (bool(c.plan.problems), c.over)
    return plain if better else c


def _has_problems(c: Optional[Candidate]) -> bool:
    return c is None or bool(c.plan.problems)


def _runnable_miss(at, micro: int, rvals: list) -> None:
    """No rollout setting both fits and runs (a vLLM share too small for a KV cache is a problem, a larger
    one over budget): plan the smallest one without a problem, so the closest miss `fit` reports is one
    that runs, with its real overshoot (problems vanish as the share grows: binary searched)."""
    i = _last(rvals, lambda r: _has_problems(at(micro, r)))
    if i + 1 < len(rvals):
        at(micro, rvals[i + 1])


def _pick(found: list[Candidate]) -> Candidate:
    """Fastest by the estimate; among plans within TIE of it, the fewest knobs changed (then faster)."""
    fastest = min(c.step.total for c in found)
    tied = [c for c in found if c.step.total <= fastest * (1 + TIE)]
    return min(tied, key=lambda c: (knob_count(c.overrides), c.step.total, -c.plan.micro_batch))


def search(s: _Search, allow: Allow) -> tuple[Optional[Candidate], list[Candidate], int]:
    """The best fitting candidate of the first tier that has one; the best of each later allowed tier
    when faster than it; and how many combinations were pruned."""
    base = s.base
    best, faster, pruned = None, [], 0
    for tier, tier_ovs in _tiers(base, allow):
        found, n = _tier_found(s, allow, tier, tier_ovs)
        pruned += n
        if found and best is None:
            best = _pick(found)
        elif found and _pick(found).step.total * (1 + TIE) < min(c.step.total for c in [best, *faster]):
            faster.append(_pick(found))
    if best is None and allow.screens:
        best = search_screens(s, allow)
    return best, faster, pruned


def _tier_found(s: _Search, allow: Allow, tier: int, tier_ovs: dict) -> tuple[list[Candidate], int]:
    """The fitting candidates of one tier (its overrides on every combination of the free knobs), and
    how many combinations were pruned."""
    micros = divisors(s.base.batch_plan().per_device_batch)
    rkey, rvals, ruser = _rollout_knob(s.base)
    found: list[Candidate] = []
    saturated: list[dict] = []
    no_rollout: list[dict] = []   # combinations whose rollout phase fits and runs at no setting
    neutral = _rollout_neutral(s.base)
    pruned = 0
    for combo in _combos(s.base, allow, tier_ovs):
        if any(_adds_only_savers(sat, combo, s.base.model) for sat in saturated) or any(
                all(v == combo.get(k) for k, v in dead.items() if k not in neutral) for dead in no_rollout):
            pruned += 1
            continue
        cands, full, dead = _search_combo(s, combo, tier, micros, rkey, rvals, ruser)
        found += cands
        if full:
            saturated.append(combo)
        if dead:
            no_rollout.append(combo)
    return found, pruned


def search_screens(s: _Search, allow: Allow) -> Optional[Candidate]:
    """The screens tier: per pixel rung (screen_ladder), the most kept screenshots that fit, binary
    searched (memory and the episode's token budget grow with both); of these, the setting with the
    most image tokens an episode, then the most pixels a screenshot; then the first allowed tier that
    fits at that setting, fastest as in `search`. A setting is probed with the combinations that save
    the most memory (every saver on), so a probe costs a few plans, not the tier's search."""
    base = s.base
    kepts, rungs = screen_ladder(base)
    if len(kepts) == 1 and len(rungs) == 1:
        return None
    micros = divisors(base.batch_plan().per_device_batch)
    rkey, rvals, ruser = _rollout_knob(base)
    tiers = _tiers(base, allow)
    probes = [c for _, ovs in tiers for c in _most_saving(_combos(base, allow, ovs), base.model)]

    def fits(kept: int, px: Optional[int]) -> bool:
        so = screen_overrides(base.rollout, kept, px)
        return bool(so) and any(_search_combo(s, {**c, **so}, SCREENS_TIER, micros, rkey, rvals, ruser)[0]
                                for c in probes)
    ascending = kepts[::-1]
    choice, seen = None, (0, 0)
    for px, tokens in rungs:
        if (kepts[0] * tokens, tokens) <= seen:
            break  # no setting at these pixels or fewer can show more
        i = _last(ascending, lambda k: fits(k, px))
        if i >= 0 and (ascending[i] * tokens, tokens) > seen:
            choice, seen = (ascending[i], px), (ascending[i] * tokens, tokens)
    if choice is None:
        return None
    so = screen_overrides(base.rollout, *choice)
    for tier, tier_ovs in tiers:
        found, _ = _tier_found(s, allow, SCREENS_TIER, {**tier_ovs, **so})
        if found:
            return _pick(found)
    return None


def target_config(cfg: Config, card: hardware.GPU, num_gpus: Optional[int], margin: Optional[float]) -> Config:
    """The user's config on the target: GPU count applied (micro-batch clamped to a divisor of the new
    per-GPU batch, which the search frees anyway) and the card and margin recorded, so that planning
    the fitted file again needs no flags."""
    if cfg.stages:
        raise ConfigError("`trainfit fit` fits one stage at a time: this config is a pipeline (`stages:`); "
                          "write each stage as its own config and fit it.")
    raw = cfg.model_dump()
    d, t = raw["distributed"], raw["train"]
    if num_gpus is not None:
        d["num_gpus"] = num_gpus
    world = d["num_gpus"] * d["num_nodes"]
    if t["global_batch_size"] % world == 0:
        t["micro_batch_size"] = max(x for x in divisors(t["global_batch_size"] // world) if x <= t["micro_batch_size"])
    if not card.detected or card.key in hardware.CATALOG:  # an unknown detected card has no name to write
        raw["hardware"]["gpu"] = card.key
    if margin is not None:
        raw["hardware"]["memory_margin"] = margin
    try:
        return validate(raw)
    except ConfigError as e:
        raise ConfigError(f"With {world} GPU(s): {e}" if num_gpus is not None else str(e)) from None


def fit(cfg: Config, gpu: Optional[str] = None, num_gpus: Optional[int] = None, allow: Allow = Allow(),
        margin: Optional[float] = None, cpu_ram_gb: Optional[float] = None) -> FitResult:
    """Search the free knobs of `cfg` for the fastest plan (step-time estimate) that fits `gpu`.
    Raises ConfigError for a config that cannot be fitted (unknown GPU, batch that does not divide)."""
    t0 = time.perf_counter()
    try:
        card, how = hardware.resolve_gpu(gpu, cfg.hardware)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if card is None:
        card, how = hardware.find_gpu(DEFAULT_GPU), "assumed"
    reason = stage_not_trainable(cfg.stage, cfg.rl_models)
    if reason:  # no knob fit turns makes the trainer run it: say so instead of writing launch files
        raise ConfigError(f"nothing to fit: {reason}")
    base = target_config(cfg, card, num_gpus, margin)
    s = _Search(base, card, margin, None if cpu_ram_gb is None else int(cpu_ram_gb * GiB))
    user = s.get({}, 0)
    best, faster, pruned = search(s, allow)
    res = FitResult(user, best, None if best else _plainest_miss(s), card, how, faster, pruned=pruned,
                    micro_clamped_from=cfg.train.micro_batch_size if base.train != cfg.train else None)
    kepts, rungs = screen_ladder(base)
    if allow.screens and (len(kepts) > 1 or len(rungs) > 1):
        px = rungs[-1][0] or base.model.max_pixels or "the processor default"
        res.screens_floor = (f"kept screenshots down to {kepts[-1]} (rollout.fit_min_images_per_episode) and "
                             f"model.max_pixels down to {px} (model.fit_min_pixels)")
    shown = best or res.user
    if shown is not None:   # timed on the fitted config: the knobs it chose, sync and split
        res.splits = compare_splits(shown.cfg, card, margin)
        d = shown.cfg.distributed
        res.split_pick = suggest_split(res.splits, d.rollout_gpus if shown.cfg.rollout.mode == "async" else 0)
    if best is None and user is not None and not user.fits:
        res.planner_fix = next((x for x in suggestions(base, user.plan, card) if x.fits), None)
    everything = Allow(True, True, True, True)
    if best is None and allow != everything:
        # Which opt-ins would make it fit: search again with all of them (the memo keeps it cheap).
        other, _, _ = search(s, everything)
        if other is not None:
            res.would_fit_with = _flags_for(other.overrides, allow)
    res.plan_calls, res.seconds = s.calls, time.perf_counter() - t0
    return res
