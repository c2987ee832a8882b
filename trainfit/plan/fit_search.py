"""The search of `trainfit fit` (plan/fit.py): configs planned as overrides of the user's, memoised, each
combination of the free knobs binary-searched over the micro-batch and the rollout knobs, and the
combinations that cannot win skipped (counted by reason)."""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from typing import Any, Optional

from trainfit.config import Config, ConfigError, validate
from trainfit.core import progress
from trainfit.models.runnable import not_trainable
from trainfit.plan import hardware
from trainfit.plan.fit_candidate import GiB, TIE, Candidate, estimate, knob_count
from trainfit.plan.fit_space import (SCREENS_TIER, TP_KEY, Allow, _adds_only_savers, _combos, _most_saving,
                                     _rollout_knob, _rollout_neutral, _tiers, divisors, screen_ladder, screen_overrides,
                                     tp_sizes)
from trainfit.plan.memory import plan

# Why a candidate or a combination of knobs was not planned (fit says how many of each).
SKIP_REASONS = {
    "savers": "combinations only add memory savers to one that fits at the largest micro-batch and rollout "
              "setting (cannot be faster)",
    "rollout": "combinations differ only in training-step knobs from one whose rollout fits at no setting "
               "(cannot fit)",
    "rollout_cached": "rollout searches reused from a combination differing only in training-step knobs (the same "
                      "rollout phase)",
    "refused": "candidates `trainfit train` refuses (config rules, trainfit/models/runnable.py)",
}


class Skipped(Counter):
    """Counts of what the search did not plan, by reason (SKIP_REASONS' keys)."""

    def text(self) -> str:
        return "; ".join(f"{n} {SKIP_REASONS[k]}" for k, n in self.most_common() if n)


class _Search:
    """Plans configs given as overrides of the user's, memoised; keeps the closest miss."""

    def __init__(self, base: Config, card: hardware.GPU, margin: Optional[float], cpu_ram: Optional[int]):
        self.base, self.card, self.margin, self.cpu_ram = base, card, margin, cpu_ram
        self.values = {f"{a}.{b}": v for a, sec in base.model_dump().items() if isinstance(sec, dict)
                       for b, v in sec.items()}
        self.raw = base.model_dump()
        self.memo: dict[tuple, Optional[Candidate]] = {}
        self.calls, self.closest = 0, None  # planner calls made; the closest miss (a Candidate)
        self.skipped = Skipped()
        self.rollouts: dict[tuple, tuple[int, bool]] = {}  # rollout searches by their rollout-relevant knobs

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
        # Every key fit sets is `section.field` with a typed value: set on a copy of the sections it
        # changes (apply_override's YAML parse and deep copy per key were most of a warm search's time).
        raw = dict(self.raw)
        for k, v in ovs.items():
            sec, name = k.split(".")
            raw[sec] = {**raw[sec], name: v}
        try:
            cfg = validate(raw)
            # What `train` refuses is never offered: the same check `train` and dry-run make.
            refused = bool(ovs) and not_trainable(cfg)
            if not refused:
                p = plan(cfg, gpu=hardware.replan_as(self.card), margin=self.margin)
        except ConfigError:
            if not ovs:
                raise  # the user's own config: its error (a model that cannot be found...) is the answer
            refused = True
        if refused:
            self.skipped["refused"] += 1
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
    largest micro-batch and rollout setting, whether no rollout setting both fits and runs).

    vLLM's tensor parallel size t (several `tp_sizes`) is searched inside: the memory of either phase does
    not depend on it (the engine's envelope is its share of the card; t only decides how much of it is KV
    cache), so the share and the micro-batch are searched at the largest t, which leaves the engine the
    most room, and every t is then planned at the best of them, for its speed (fewer waves, weights read
    in t parts) and whether the engine runs."""
    mine, tvals = s.base.train.micro_batch_size, tp_sizes(s.base)
    tuser, tmax = s.base.rollout.tensor_parallel_size, tvals[-1]

    def at(m, r, t=tmax):
        return s.get({**combo, "train.micro_batch_size": m, TP_KEY: t, **({rkey: r} if rkey else {})}, tier)
    r_best = None
    if rkey:
        # The rollout phase does not depend on the micro-batch nor on the training-step knobs: searched at
        # the smallest micro-batch, once per setting of the knobs it depends on.
        key = tuple(sorted((k, v) for k, v in combo.items() if k not in _rollout_neutral(s.base)))
        if key in s.rollouts:
            s.skipped["rollout_cached"] += 1
            i, dead = s.rollouts[key]
        else:
            i = _last(rvals, lambda r: (c := at(micros[0], r)) is not None
                      and c.plan.phases["rollout"].total <= c.plan.budget)
            dead = i < 0 or _has_problems(at(micros[0], rvals[i]))
            s.rollouts[key] = i, dead
        if dead:
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
    tries = {(m_best, r_best, t) for t in tvals} | {
        (m, r, t) for m in {m_best, mine} for r in ({r_best, ruser} if rkey else {None}) for t in {tmax, tuser}}
    found = [c for m, r, t in sorted(tries, key=str) if (c := at(m, r, t)) is not None and c.fits]
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
        why = "savers" if any(_adds_only_savers(sat, combo, s.base.model) for sat in saturated) else "rollout" if any(
            all(v == combo.get(k) for k, v in dead.items() if k not in neutral) for dead in no_rollout) else ""
        if why:
            pruned += 1
            s.skipped[why] += 1
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
