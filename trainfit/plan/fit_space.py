"""What `trainfit fit` searches: the opt-ins (Allow), the tiers of changes, and the settings tried per knob
(parallelism, checkpointing, log-prob chunks, the fused head, sleep, the rollout's memory knob, vLLM's tensor
parallel size, and the environment's screenshots: how many an episode keeps and their pixels)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import product
from math import gcd
from typing import Any, Optional

from trainfit.config import Config, ModelConfig, RolloutConfig
from trainfit.config.stages import stage_spec
from trainfit.models.runnable import method_not_trainable, model_type_of, parallel_not_trainable
from trainfit.models.shapes import arch_facts, model_source
from trainfit.plan.head import fused_head_runs
from trainfit.plan.screens import fitting_pixels, kept_screens, plans_screens, screen_tokens
from trainfit.plan.vision import image_settings

CHUNK_ROWS = 1024   # the chunk size the planner's suggestions use
VLLM_SHARES = tuple(round(0.05 * i, 2) for i in range(2, 20))  # 0.10 .. 0.95
TIER_FLAGS = {1: "--allow-optimizer", 2: "--allow-method", 3: "--allow-method", 4: "--allow-screens"}
SCREENS_TIER = 4    # fewer kept screenshots / fewer pixels, on top of the first method tier that then fits
SCREEN_KEYS = ("rollout.max_images_per_episode", "model.max_pixels")
TP_KEY = "rollout.tensor_parallel_size"
# Knobs that only save memory: switching one on costs time or nothing, never saves time.
SAVERS = ("model.gradient_checkpointing", "train.logits_chunk_rows", "train.fused_head",
          "distributed.offload_optimizer", "distributed.offload_params", "rollout.sleep_level")


@dataclass(frozen=True)
class Allow:
    """Opt-ins for changes beyond the free knobs."""

    method: bool = False      # full -> LoRA -> QLoRA (LoRA/DoRA -> 4-bit base)
    offload: bool = False     # ZeRO optimizer / parameter offload, FSDP2 offload of all three, to CPU RAM
    optimizer: bool = False   # AdamW -> 8-bit AdamW (full fine-tuning)
    screens: bool = False     # fewer kept screenshots / lower max_pixels, down to the fit_min_* floors


_PAR = ("distributed.strategy", "distributed.zero_stage", "distributed.offload_optimizer", "distributed.offload_params")


def _parallel_options(cfg: Config, allow: Allow, quantized: bool, eight_bit: bool) -> list[dict]:
    """(strategy, ZeRO stage, offloads) settings to try: the user's with and without offload, DeepSpeed
    ZeRO ones unless the user chose FSDP, and FSDP from DDP (offloaded too, with offload allowed). Each passes
    runnable.parallel_not_trainable (the stage table's not_fsdp...), so fit offers what `train` runs and follows
    when that changes; what the config rules refuse (config/rules.py) is skipped when planned."""
    d, world, eng = cfg.distributed, cfg.world_size, cfg.engine()
    mine = (d.strategy, d.zero_stage, d.offload_optimizer, d.offload_params)
    opts = [mine, mine[:2] + (False, False)]
    offload = (allow.offload or d.offload_optimizer or d.offload_params) and not eight_bit
    if eng == "deepspeed":  # plain data parallelism too: the fastest when it fits, and what PPO runs on
        opts.append(("ddp" if world > 1 else "auto", 0, False, False))
    if eng == "ddp":  # FSDP2 shards what DDP replicates with the same bf16 AdamW math (DeepSpeed adds fp32 masters)
        opts.append(("fsdp", 0, False, False))
    if eng in ("ddp", "fsdp") and world > 1 and offload:
        # FSDP2's offload: parameters, gradients and optimizer in CPU RAM together, the optimizer stepping there
        # (the same AdamW math, slower); both keys written, as it offloads both.
        opts.append(("fsdp", 0, True, True))
    if eng != "fsdp":
        if world > 1:
            opts += [("deepspeed", s, False, False) for s in range(0 if eng == "deepspeed" else 1, 4)]
        if offload:
            # DeepSpeed offloads only under ZeRO, and its CPU Adam cannot step bitsandbytes states.
            opts += [("deepspeed", 2, True, False), ("deepspeed", 3, True, True)]
            opts += [("deepspeed", 3, True, False)] if world > 1 else []
    out: dict[tuple, dict] = {}
    for o in opts:
        if quantized and o[1] == 3 and o != mine:
            continue  # bitsandbytes 4-bit weights are not partitioned by ZeRO-3 without a storage dtype
        e = o[0] if o[0] != "auto" else ("deepspeed" if any(o[1:]) else "ddp" if world > 1 else "single")
        if quantized and e == "fsdp":
            continue  # FSDP2's all-gather drops bitsandbytes' quantization state (config/rules.py refuses it too)
        if parallel_not_trainable("single" if e == "ddp" and world == 1 else e, *o[1:], stage=cfg.stage):
            continue  # fit offers only what `trainfit train` runs (trainfit/models/runnable.py)
        # FSDP offloads its optimizer whenever its parameters (offload_params is the switch): one setting.
        off_opt = o[2] or (e == "fsdp" and o[3])
        out.setdefault((e, o[1] if e == "deepspeed" else 0, off_opt, o[3]), dict(zip(_PAR, o)))
    return list(out.values())


def _rollout_knob(cfg: Config) -> tuple[Optional[str], list, Any]:
    """(key, ascending values, the user's value) of the rollout knob searched, if any."""
    if not stage_spec(cfg.stage).rollout:
        return None, [], None
    r, per_dev = cfg.rollout, cfg.batch_plan().per_device_batch
    if r.engine == "vllm":
        u = r.gpu_memory_utilization
        return "rollout.gpu_memory_utilization", sorted(set(VLLM_SHARES) | {u}), u
    if r.engine == "hf":
        mine = min(r.batch_size or per_dev, per_dev)
        # Divisors of the per-GPU completions, plus the halves the planner's suggestions try; the
        # largest is written as the user's own value when that means the same (0 = all at once).
        vals = sorted(set(divisors(per_dev)) | {v for v in (mine, mine // 2, mine // 4) if v > 0})
        if mine == per_dev:
            vals[-1] = r.batch_size
        return "rollout.batch_size", vals, r.batch_size
    return None, [], None


def tp_sizes(cfg: Config) -> list[int]:
    """vLLM tensor-parallel sizes to try, ascending (the user's alone when not a vLLM rollout): divisors of the
    model's KV heads (the planner splits the KV cache by heads; vLLM also needs the attention heads to divide)
    and of a node's GPUs (a group of consecutive ranks, rollout/vllm_engine.py, stays inside a node), that
    divide the training ranks as the engine requires."""
    r = cfg.rollout
    if not (stage_spec(cfg.stage).rollout and r.engine == "vllm"):
        return [r.tensor_parallel_size]
    f = arch_facts(model_source(cfg.model))
    g = gcd(gcd(f.kv_heads or 1, f.heads or 1), max(1, cfg.distributed.num_gpus - cfg.distributed.rollout_gpus))
    return sorted({t for t in divisors(g) if cfg.world_size % t == 0} | {r.tensor_parallel_size})


def _combos(cfg: Config, allow: Allow, tier_ovs: dict) -> list[dict]:
    m, t, r = cfg.model, cfg.train, cfg.rollout
    quantized = tier_ovs.get("model.quantization", m.quantization) != "none"
    eight_bit = tier_ovs.get("train.optimizer", t.optimizer) != "adamw"
    ckpts = _ckpt_options(m)
    # The logits' memory: as set, log-probs in row chunks, or the fused head (which bounds the logits
    # to one chunk itself, so it is not also tried with the other chunk setting).
    heads = [(t.logits_chunk_rows, t.fused_head)] + ([(CHUNK_ROWS, t.fused_head)] if not t.logits_chunk_rows else [])
    heads += [(t.logits_chunk_rows, "chunked")] if fused_head_runs(cfg) else []
    # vLLM's sleep between rollouts (sync only: under async its worker samples while the step trains).
    sleeps = [r.sleep_level] + ([1] if stage_spec(cfg.stage).rollout and r.engine == "vllm" and r.sleep_level == 0
                                and r.mode == "sync" else [])
    out = [{**tier_ovs, **par, "model.gradient_checkpointing": ck, "train.logits_chunk_rows": ch, "rollout.sleep_level": sl,
            "train.fused_head": fh}
           for par, ck, (ch, fh), sl in product(_parallel_options(cfg, allow, quantized, eight_bit), ckpts, heads, sleeps)
           if fh == t.fused_head or not _shards_the_head(par)]
    return sorted(out, key=lambda c: sum(_saver_on(c, k) for k in SAVERS))  # fewest savers first: they prune


def _shards_the_head(par: dict) -> bool:
    """Whether a parallel setting keeps the LM head's weight sharded outside the forward (FSDP,
    ZeRO-3), where the fused head is refused."""
    return par.get("distributed.strategy") == "fsdp" or (par.get("distributed.strategy") == "deepspeed"
                                                         and par.get("distributed.zero_stage") == 3)


def _ckpt_options(m: ModelConfig) -> list:
    """Checkpointing settings to try: the user's, none, all, and the first L/4, L/2, 3L/4 layers.
    Fewer checkpointed layers recompute less (the estimate counts k/L of a forward) but keep more
    activations, so a partial setting is often the fastest that fits."""
    n = _n_layers(m)
    out = {m.checkpointed_layers(n): m.gradient_checkpointing}  # the user's value, as written
    for k in (0, n // 4, n // 2, 3 * n // 4, n):
        out.setdefault(k, False if k == 0 else True if k == n else k)
    return [out[k] for k in sorted(out)]


def _n_layers(m: ModelConfig) -> int:
    return arch_facts(model_source(m)).n_layers


def _ckpt_level(m: ModelConfig, value) -> int:
    """Checkpointed layers of a `model.gradient_checkpointing` value (ModelConfig's rule)."""
    return m.model_copy(update={"gradient_checkpointing": value}).checkpointed_layers(_n_layers(m))


def _saver_on(combo: dict, key: str) -> bool:
    v = combo.get(key)
    if key == "train.fused_head":
        return v in ("chunked", "liger")
    return bool(v) if key != "rollout.sleep_level" else v != 0


def _tiers(cfg: Config, allow: Allow) -> list[tuple[int, dict]]:
    pe, m, t = cfg.peft, cfg.model, cfg.train
    tiers: list[tuple[int, dict]] = [(0, {})]
    if allow.optimizer and pe.method == "none" and t.optimizer == "adamw":
        tiers.append((1, {"train.optimizer": "adamw_8bit"}))
    if allow.method and pe.method == "none":
        tiers.append((2, {"peft.method": "lora"}))
    if allow.method and m.quantization == "none" and not method_not_trainable(model_type_of(m), "4bit", cfg.stage):
        tiers.append((3, {"peft.method": "lora" if pe.method == "none" else pe.method, "model.quantization": "4bit"}))
    return tiers


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def screen_ladder(cfg: Config) -> tuple[list[int], list[tuple[Optional[int], int]]]:
    """The screenshot settings the screens tier may choose, for a plan with screenshots
    (plan/screens.py), else the user's alone: (kept screenshots, descending from the user's to
    rollout.fit_min_images_per_episode; pixel rungs [(model.max_pixels, or None for the user's own;
    image tokens of the heaviest screenshot)], descending from the user's in halved image tokens (the
    steps of the planner's "lower max_pixels" suggestion), then the floor model.fit_min_pixels itself).
    Nothing below a floor, nor below the processor's min_pixels, is offered."""
    src = model_source(cfg.model)
    s = image_settings(cfg.model, src)
    kept = kept_screens(cfg.rollout)
    tokens = screen_tokens(s)[1]
    if not plans_screens(cfg, arch_facts(src)):
        return [kept], [(None, tokens)]
    kepts = list(range(kept, min(cfg.rollout.fit_min_images_per_episode, kept) - 1, -1))
    floor = max(cfg.model.fit_min_pixels or s.min_pixels, s.min_pixels)
    rungs: list[tuple[Optional[int], int]] = [(None, tokens)]
    while (px := fitting_pixels(s, rungs[-1][1] // 2)) and px >= floor:
        rungs.append((px, screen_tokens(replace(s, max_pixels=px))[1]))
    if floor < (rungs[-1][0] or s.max_pixels):
        t = screen_tokens(replace(s, max_pixels=floor))[1]
        if t < rungs[-1][1]:
            rungs.append((floor, t))
    return kepts, rungs


def screen_overrides(r: RolloutConfig, kept: int, px: Optional[int]) -> dict[str, Any]:
    """The overrides of one screen setting (the user's own values are left out)."""
    out: dict[str, Any] = {} if kept == kept_screens(r) else {SCREEN_KEYS[0]: kept}
    return {**out, SCREEN_KEYS[1]: px} if px is not None else out


def _rollout_neutral(base: Config) -> set:
    """Knobs that leave the rollout phase as it is (they act on the training step or on the engine while it
    sleeps), so a combination differing from one whose rollout fits nowhere only in these fits nowhere too.
    With rollout GPUs of their own, the scoring forwards (log-prob chunks, the head) run on the rollout GPU."""
    keys = {"model.gradient_checkpointing", "rollout.sleep_level", "train.micro_batch_size"}
    if not (base.rollout.mode == "async" and base.distributed.rollout_gpus):
        keys |= {"train.logits_chunk_rows", "train.fused_head"}
    return keys


def _most_saving(combos: list[dict], model: ModelConfig) -> list[dict]:
    """The combinations to which no other adds memory savers (see _adds_only_savers)."""
    return [a for a in combos if not any(b != a and _adds_only_savers(a, b, model) for b in combos)]


def _flags_for(ovs: dict, allow: Allow) -> list[str]:
    """The opt-ins a candidate's changes (`ovs`, dotted key -> value) need that `allow` does not give."""
    flags = {TIER_FLAGS[t] for t, keys in ((1, ("train.optimizer",)), (2, ("peft.method", "model.quantization")),
                                           (SCREENS_TIER, SCREEN_KEYS)) if set(keys) & set(ovs)}
    if ovs.get("distributed.offload_optimizer") or ovs.get("distributed.offload_params"):
        flags.add("--allow-offload")
    return sorted(f for f in flags if not getattr(allow, f.removeprefix("--allow-")))


def _adds_only_savers(a: dict, b: dict, model: Optional[ModelConfig] = None) -> bool:
    """b equals a except for memory savers switched on (or, with `model`, more layers checkpointed)."""
    ck = "model.gradient_checkpointing"

    def more(k):
        if k == ck and model is not None and k in a and k in b:
            return _ckpt_level(model, b[k]) >= _ckpt_level(model, a[k])
        return k in SAVERS and not _saver_on(a, k) and _saver_on(b, k)
    return all(a.get(k) == b.get(k) or more(k) for k in set(a) | set(b))
