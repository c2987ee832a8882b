"""The cheapest changes that make a plan fit, each with the memory it saves (by planning it again).

Candidates, in order of what they cost the user (compute first, then method, then the task):
log-probs in row chunks (free), the fused LM head (one more head matmul in backward), gradient checkpointing (~30% more compute), a smaller micro-batch
with more accumulation (same math, slower), a lower vLLM memory share or deeper sleep, smaller
generation batches, ZeRO-3 / optimizer offload (same math, slower), an 8-bit optimizer, LoRA
instead of full fine-tuning, a 4-bit base, and last shorter sequences (which change the task);
`trainfit fit` (plan/fit.py) prefers the same order. Each is a list of `key=value` overrides that
`trainfit train` accepts (`accepted`: validation and trainfit/models/runnable.py); one that needs a package
not installed here says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainfit.config.stages import stage_spec
from trainfit.config import Config, ConfigError, apply_override, validate
from trainfit.core.extras import needs_note
from trainfit.models.runnable import method_not_trainable, model_type_of, not_trainable, parallel_not_trainable
from trainfit.models.shapes import arch_facts, model_source
from trainfit.plan.head import fused_head_runs
from trainfit.plan.memory import plan
from trainfit.plan.screens import fitting_pixels, kept_screens, plans_screens, screen_tokens
from trainfit.plan.vision import image_settings


@dataclass
class Suggestion:
    change: str
    overrides: list[str]
    saving: int       # bytes off the peak
    fits: bool
    peak: int


def _candidates(cfg: Config) -> list[tuple[str, list[str]]]:
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
        elif r.engine == "hf":
            gen = r.batch_size or per_dev
            for g in (gen // 2, gen // 4, t.micro_batch_size):
                if 0 < g < gen:
                    out.append((f"generate {g} sequences at a time", [f"rollout.batch_size={g}"]))
    # ZeRO and offload keep the training math (compute cost only), so they come before the changes of
    # optimizer and method: the same order as the tiers of `trainfit fit` (plan/fit.py).
    # Only settings `trainfit train` runs are suggested (trainfit/models/runnable.py).
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


def suggestions(cfg: Config, base, card, limit: int = 6) -> list[Suggestion]:
    """Plan each candidate on the same card; keep those that lower the peak. The ones that fit come
    first in candidate order (cheapest first); only the first micro-batch that fits is kept."""
    found: list[Suggestion] = []
    micro_fit = False
    for change, overrides in _candidates(cfg):
        if micro_fit and change.startswith("micro-batch"):
            continue
        trial = accepted(cfg, overrides)
        if trial is None:
            continue
        try:
            p = plan(trial, gpu=card.key if not card.detected else card.name, margin=base.margin)
        except ConfigError:
            continue
        saving = base.peak - p.peak
        if saving <= 0 and not (base.problems and not p.problems):
            continue
        fits = bool(p.fits)
        micro_fit = micro_fit or (fits and change.startswith("micro-batch"))
        found.append(Suggestion(_with_needs(change, trial, cfg), overrides, saving, fits, p.peak))
    found.sort(key=lambda s: (not s.fits,))
    if found and not any(s.fits for s in found):
        combo = _combine(cfg, base, card)
        if combo is not None:
            found.insert(0, combo)
    return found[:limit]


def _combine(cfg: Config, base, card) -> "Suggestion | None":
    """No single change fits: take the candidates in order, keep each that lowers the peak, stop when
    the plan fits."""
    current, peak, chosen = cfg, base.peak, []  # [(change, overrides)]
    for change, ovs in _candidates(cfg):
        trial = accepted(current, ovs)
        if trial is None:
            continue
        try:
            p = plan(trial, gpu=card.key if not card.detected else card.name, margin=base.margin)
        except ConfigError:
            continue
        if p.peak < peak:
            current, peak = trial, p.peak
            keys = {v.split("=")[0] for v in ovs}  # a later micro-batch replaces an earlier one
            chosen = [(c, o) for c, o in chosen if not keys & {v.split("=")[0] for v in o}] + [(change, ovs)]
            if p.fits:
                return Suggestion(_with_needs(" + ".join(c for c, _ in chosen), trial, cfg),
                                  [v for _, o in chosen for v in o], base.peak - peak, True, peak)
    return None


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
