"""`trainfit fit`: the fastest plan that fits the card, searched over the knobs the user left free.

    from trainfit.config import load_config
        r = fit(load_config("examples/sft_7b_zero2_offload.yaml"), gpu="h200")
    r.best.cfg, r.best.plan.peak, r.best.step.total, r.best.overrides, r.missing

Never changed: global batch, model, sequence lengths, stage, task. Searched, in tiers that are tried
in order (the first tier where anything fits wins, so a method is only changed when needed):
  0 same training math: micro-batch (accumulation derived), gradient checkpointing (none, the
    first L/4, L/2, 3L/4 or all L layers), log-probs in chunks, ZeRO stage or FSDP (several GPUs, all
    nodes'), optimizer/parameter offload (--allow-offload, or already on), rollout memory share (vLLM)
    or sequences generated together (HF), vLLM sleep and tensor parallel size (fit_space.tp_sizes);
  1 8-bit AdamW (--allow-optimizer);  2 LoRA (--allow-method);  3 a 4-bit base (--allow-method);
  4 (--allow-screens, when the plan has environment screenshots and no earlier tier fits) fewer kept
    screenshots (rollout.max_images_per_episode) and lower model.max_pixels, never below the floors
    rollout.fit_min_images_per_episode and model.fit_min_pixels: the setting that fits with the most
    image tokens an episode (then the most pixels a screenshot) wins, whatever its speed, since it
    changes what the agent sees; the other knobs and tiers are searched on top of it.
Within a tier plans are ranked by the calibrated step-time estimate (see `estimate`); plans within
TIE of the fastest count as tied and the one changing the fewest knobs wins. Faster plans of later
allowed tiers are reported as alternatives, not chosen. ZeRO is DeepSpeed's mixed precision (fp32
master weights), so no option leaves DeepSpeed for plain torch (bf16 AdamW would change the math);
FSDP is offered from DDP, whose math it keeps. Every candidate passes the checks `train` makes (config
validation, trainfit/models/runnable.py) before it is planned: what train refuses is never offered.

Cost: a warm plan() is a few ms, every combination ~10^4 plans; so the micro-batch and the rollout
knob are binary-searched per combination of the others (memory grows with both, speed never drops),
the rollout search is reused across settings that differ only in training-step knobs, vLLM's tensor
parallel size is tried only at the best share and micro-batch (fit_search._search_combo),
and a combination that only adds memory savers to one that fits at the largest micro-batch and
rollout setting is skipped: it cannot be faster; so is one that differs only in training-step knobs
from one whose rollout phase fits and runs at no setting (fit_space._rollout_neutral): it cannot fit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

from trainfit.config import Config, ConfigError, validate
from trainfit.models.runnable import stage_not_trainable
from trainfit.plan import hardware
from trainfit.plan.fit_candidate import GiB, TIE, Candidate, estimate, knob_count, override_list, vllm_waves
from trainfit.plan.fit_search import _Search, _plainest_miss, search
from trainfit.plan.fit_space import Allow, _combos, _flags_for, divisors, screen_ladder
from trainfit.plan.memory import DEFAULT_GPU
from trainfit.plan.split import compare_splits, suggest_split
from trainfit.plan.suggest import Suggestion, suggestions

__all__ = ["TIE", "Allow", "Candidate", "FitResult", "divisors", "estimate", "fit", "knob_count", "override_list",
           "search", "vllm_waves", "_combos"]


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
    skipped: dict = field(default_factory=dict)  # what the search did not plan, by reason (fit_search.SKIP_REASONS)
    seconds: float = 0.0

    @property
    def missing(self) -> int:
        """Bytes the closest plan is over budget (0 when it fits or only has a non-memory problem)."""
        return max(0, self.closest.over) if self.closest and not self.best else 0


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
    card, how = hardware.resolve_gpu(gpu, cfg.hardware)   # an unknown name: UnknownGPU, a ConfigError
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
    res.plan_calls, res.skipped, res.seconds = s.calls, dict(s.skipped), time.perf_counter() - t0
    return res
