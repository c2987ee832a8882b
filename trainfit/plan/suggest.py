"""The cheapest changes that make a plan fit, each with the memory it saves (by planning it again).

Candidates, in order of what they cost the user (compute first, then method, then the task):
log-probs in row chunks (free), the fused LM head (one more head matmul in backward), gradient checkpointing (~30% more compute), a smaller micro-batch
with more accumulation (same math, slower), a lower vLLM memory share or deeper sleep (or a larger share
when the engine has no room for a KV cache), generating with the trainer's model instead of vLLM, smaller
generation batches, vLLM tensor parallel, FSDP from DDP, ZeRO-3 / optimizer offload (same math, slower),
an 8-bit optimizer, LoRA
instead of full fine-tuning, a 4-bit base, and last shorter sequences (which change the task);
`trainfit fit` (plan/fit.py) prefers the same order. Each is a list of `key=value` overrides that
`trainfit train` accepts (`accepted`: validation and trainfit/models/runnable.py); one that needs a package
not installed here says so.

Every piece of advice `plan`, `fit` and `hardware` print is planned by `check` before it is shown, and
only what fits is offered: per kind of change (the keys it sets) the cheapest setting that fits; when no
single change fits, the cheapest combination that does; when nothing fits, one row per kind saying why
none of it fits (its lowest peak against the budget, or the problem left).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from trainfit.config.stages import stage_spec
from trainfit.config import Config, ConfigError, apply_override, validate
from trainfit.core.extras import needs_note
from trainfit.models.runnable import method_not_trainable, model_type_of, not_trainable, parallel_not_trainable
from trainfit.models.shapes import arch_facts, model_source
from trainfit.plan.hardware import replan_as
from trainfit.plan.head import fused_head_runs
from trainfit.plan.fit_space import VLLM_SHARES, tp_sizes
from trainfit.plan.memory import Plan, plan
from trainfit.plan.screens import fitting_pixels, kept_screens, plans_screens, screen_tokens
from trainfit.plan.vision import image_settings


@dataclass
class Suggestion:
    change: str
    overrides: list[str]
    saving: int       # bytes off the peak
    fits: bool
    peak: int
    why: str = ""     # a change that does not fit: why none of its kind does


def check(cfg: Config, overrides: list[str], card, margin: Optional[float]) -> "tuple[Config, Plan] | None":
    """The config a piece of advice proposes and its bare plan on `card`, or None when `trainfit train`
    would refuse it (`accepted`) or it cannot be planned: nothing is advised before this has planned it."""
    trial = accepted(cfg, overrides)
    if trial is None:
        return None
    try:
        return trial, plan(trial, gpu=replan_as(card), margin=margin)
    except ConfigError:
        return None


def why_not(p: Plan) -> str:
    """Why a planned change does not fit, in one clause."""
    if p.problems:
        return p.problems[0].rstrip(".")
    return f"peak {p.peak / 2**30:.2f} GiB over the {(p.budget or 0) / 2**30:.2f} GiB budget"


def _candidates(cfg: Config) -> list[tuple[str, list[str]]]:
    """Every change tried, cheapest first: (what it is, its overrides)."""
    m, t, r, d = cfg.model, cfg.train, cfg.rollout, cfg.distributed
    out: list[tuple[str, list[str]]] = []
    if hasattr(t, "logits_chunk_rows") and not t.logits_chunk_rows:
        out.append(("log-probs in chunks of 1024 rows", ["train.logits_chunk_rows=1024"]))
    if fused_head_runs(cfg):
        out.append(("fused LM head (no [tokens, vocab] logits)", ["train.fused_head=chunked"]))
    if not m.gradient_checkpointing:
        out.append(("gradient checkpointing", ["model.gradient_checkpointing=true"]))
    per_dev = cfg.batch_plan().per_device_batch
    for mb in sorted((x for x in range(1, t.micro_batch_size) if per_dev % x == 0), reverse=True):
        out.append((f"micro-batch {mb} (accumulation {per_dev // mb})", [f"train.micro_batch_size={mb}"]))
    if stage_spec(cfg.stage).rollout:
        if r.engine == "vllm":
            if r.sleep_level == 0 and r.mode == "sync":   # async: its worker samples while the step trains
                out.append(("vLLM sleeps while training", ["rollout.sleep_level=1"]))
            for u in (0.4, 0.3, 0.25, 0.2, 0.15):
                if u < r.gpu_memory_utilization:
                    out.append((f"vLLM memory share {u:.0%}", [f"rollout.gpu_memory_utilization={u}"]))
            # A share too small for any KV cache is a problem, not a saving: a larger one may fit (kept
            # only when planning it shows so; smallest first, so the first that fits takes least).
            for u in VLLM_SHARES:
                if u > r.gpu_memory_utilization:
                    out.append((f"vLLM memory share {u:.0%} (room for a KV cache)",
                                [f"rollout.gpu_memory_utilization={u}"]))
            # Tensor parallelism splits the engine's weights and KV cache over t GPUs of a node (fit_space.tp_sizes).
            for tp in tp_sizes(cfg):
                if tp > r.tensor_parallel_size:
                    out.append((f"vLLM tensor parallel over {tp} GPUs (weights and KV cache split)",
                                [f"rollout.tensor_parallel_size={tp}"]))
            # Generating with the trainer's own model holds no second copy of the weights (slower decoding).
            out.append(("generate with the trainer's model (HF generate, no vLLM copy of the weights)",
                        ["rollout.engine=hf"]))
        elif r.engine == "hf":
            gen = r.batch_size or per_dev
            for g in (gen // 2, gen // 4, t.micro_batch_size):
                if 0 < g < gen:
                    out.append((f"generate {g} sequences at a time", [f"rollout.batch_size={g}"]))
    # ZeRO and offload keep the training math (compute cost only), so they come before the changes of
    # optimizer and method: the same order as the tiers of `trainfit fit` (plan/fit.py).
    # Only settings `trainfit train` runs are suggested (trainfit/models/runnable.py).
    if cfg.engine() == "ddp" and not parallel_not_trainable("fsdp", 0, False, False, stage=cfg.stage):
        # DDP's own math (bf16 AdamW), every state sharded; fit offers it from DDP too (fit_space).
        out.append(("FSDP over all GPUs", ["distributed.strategy=fsdp"]))
    if cfg.world_size > 1 and d.zero_stage < 3 and not parallel_not_trainable("deepspeed", 3, d.offload_optimizer,
                                                                             d.offload_params, stage=cfg.stage):
        out.append(("ZeRO-3 over all GPUs", ["distributed.strategy=deepspeed", "distributed.zero_stage=3"]))
    stage = max(d.zero_stage, 2)
    if not d.offload_optimizer and not parallel_not_trainable("deepspeed", stage, True, d.offload_params,
                                                                     stage=cfg.stage):
        out.append((f"ZeRO-{stage} with the optimizer offloaded to CPU",
                    ["distributed.strategy=deepspeed", f"distributed.zero_stage={stage}",
                     "distributed.offload_optimizer=true"]))
    if cfg.peft.method == "none" and t.optimizer == "adamw":
        out.append(("8-bit AdamW (bitsandbytes)", ["train.optimizer=adamw_8bit"]))
    four_bit = m.quantization == "none" and not method_not_trainable(model_type_of(m), "4bit", cfg.stage)
    if cfg.peft.method == "none":
        out.append(("LoRA instead of full fine-tuning", ["peft.method=lora"]))
        if four_bit:
            out.append(("QLoRA (LoRA on a 4-bit base)", ["peft.method=lora", "model.quantization=4bit"]))
    elif four_bit:
        out.append(("4-bit base (QLoRA)", ["model.quantization=4bit"]))
    if stage_spec(cfg.stage).rollout:
        out.append(("half the completion length", [f"rollout.max_new_tokens={max(1, r.max_new_tokens // 2)}"]))
        out += _screen_candidates(cfg)
    else:
        out.append(("half the sequence length", [f"data.max_seq_length={max(8, cfg.data.max_seq_length // 2)}"]))
    return out


def _screen_candidates(cfg: Config) -> list[tuple[str, list[str]]]:
    """Environment screenshots (plan/screens.py): keep half as many, or half their pixels. They change
    what the agent sees, so they come last."""
    if not plans_screens(cfg, arch_facts(model_source(cfg.model))):
        return []
    out = []
    kept = kept_screens(cfg.rollout)
    if kept > 1:
        out.append((f"keep {kept // 2} screenshots an episode", [f"rollout.max_images_per_episode={kept // 2}"]))
    s = image_settings(cfg.model, model_source(cfg.model))
    px = fitting_pixels(s, screen_tokens(s)[1] // 2)
    if px and px >= s.min_pixels:
        out.append(("screenshots at half the image tokens", [f"model.max_pixels={px}"]))
    return out


def suggestions(cfg: Config, base: Plan, card, limit: int = 6) -> list[Suggestion]:
    """The changes that make `cfg` fit `card`, each planned (`check`): per kind of change (the keys it
    sets) the first in candidate order that fits, cheapest first; when none fits alone, the combination
    `_combine` finds; when nothing fits, per kind its best (lowest peak, problems last), saying why."""
    tried: list[tuple[str, list[str], Config, Plan]] = []
    for change, overrides in _candidates(cfg):
        got = check(cfg, overrides, card, base.margin)
        if got is not None and _improves(base, got[1]):
            tried.append((change, overrides, *got))
    found, kinds = [], set()
    for change, overrides, trial, p in tried:
        if p.fits and _kind(overrides) not in kinds:
            kinds.add(_kind(overrides))
            found.append(Suggestion(_with_needs(change, trial, cfg), overrides, base.peak - p.peak, True, p.peak))
    if not found:
        combo = _combine(cfg, base, card)
        found = [combo] if combo is not None else _collapsed(_nothing_fits(cfg, base, tried))
    return found[:limit]


def _collapsed(found: list[Suggestion]) -> list[Suggestion]:
    """Changes that do not fit with the same outcome (peak) shown once: the first, the cheapest. (Changes
    that fit stay apart: fewer screenshots or fewer pixels each may be what the user prefers.)"""
    seen: set = set()
    return [s for s in found if s.peak not in seen and not seen.add(s.peak)]


def _improves(base: Plan, p: Plan) -> bool:
    """A change worth showing lowers the peak, or removes every problem of a plan that has them."""
    return p.peak < base.peak or bool(base.problems and not p.problems)


def _kind(overrides: list[str]) -> frozenset:
    return frozenset(o.split("=", 1)[0] for o in overrides)


def _nothing_fits(cfg: Config, base: Plan, tried: list) -> list[Suggestion]:
    """Nothing fits, alone or combined: per kind of change its best plan (the lowest peak), closest first,
    saying why none of that kind fits; kinds that leave a problem are shown only when every kind does (the
    problem is then the reason), since a plan with a problem is no measure of the memory missing."""
    best: dict[frozenset, tuple] = {}
    for t in tried:
        k, p = _kind(t[1]), t[3]
        if k not in best or (bool(p.problems), p.peak) < (bool(best[k][3].problems), best[k][3].peak):
            best[k] = t
    rows = sorted(best.values(), key=lambda t: (bool(t[3].problems), t[3].peak))  # the closest first
    if any(not t[3].problems for t in rows):
        rows = [t for t in rows if not t[3].problems]
    return [Suggestion(_with_needs(change, trial, cfg) + f": none of this kind fits ({why_not(p)})", overrides,
                       base.peak - p.peak, False, p.peak, why_not(p))
            for change, overrides, trial, p in rows]


def _combine(cfg: Config, base: Plan, card) -> "Suggestion | None":
    """No single change fits: take the candidates in order, keep each that makes the plan better (fewer
    problems, then a lower peak), stop when the plan fits."""
    current, chosen = cfg, []  # [(change, overrides)]
    score = (bool(base.problems), base.peak)
    for change, ovs in _candidates(cfg):
        got = check(current, ovs, card, base.margin)
        if got is None:
            continue
        trial, p = got
        if (bool(p.problems), p.peak) < score:
            current, score = trial, (bool(p.problems), p.peak)
            keys = _kind(ovs)  # a later micro-batch (or share) replaces an earlier one
            chosen = [(c, o) for c, o in chosen if not keys & _kind(o)] + [(change, ovs)]
            if p.fits:
                chosen, trial, p = _minimal(cfg, chosen, trial, p, card, base.margin)
                return Suggestion(_with_needs(" + ".join(c for c, _ in chosen), trial, cfg),
                                  [v for _, o in chosen for v in o], base.peak - p.peak, True, p.peak)
    return None


def _minimal(cfg: Config, chosen: list, trial: Config, p: Plan, card, margin) -> tuple[list, Config, Plan]:
    """A fitting combination without the changes it fits without (an early change a later one made
    needless, such as a larger vLLM share before generating with the trainer's model), each drop planned."""
    i = 0
    while i < len(chosen):
        rest = chosen[:i] + chosen[i + 1:]
        got = check(cfg, [v for _, o in rest for v in o], card, margin) if rest else None
        if got is not None and got[1].fits:
            chosen, (trial, p) = rest, got
        else:
            i += 1
    return chosen, trial, p


def accepted(cfg: Config, overrides: list[str]) -> "Config | None":
    """`cfg` with `overrides` applied when `trainfit train` accepts it (validation and runnable.py), else
    None: a suggestion is only offered when the dry run of the changed config passes its config checks."""
    try:
        raw = cfg.model_dump()
        for ov in overrides:
            raw = apply_override(raw, ov)
        trial = validate(raw)
    except ConfigError:
        return None
    return None if not_trainable(trial) else trial


def _with_needs(change: str, cfg: Config, base: Config) -> str:
    """The change, saying which package it adds to what `base` needs, where that is not installed here
    (train refuses the change until it is; the plan lists what `base` needs already)."""
    needs = needs_note(cfg, base)
    return f"{change} ({needs})" if needs else change
