"""The work of a training step, per GPU: FLOPs, bytes, decode steps, passes and the decode engine, for the
roofline (hardware.roofline_step) and the calibrated estimate (steptime.py)."""

from __future__ import annotations

import math

from trainfit.config.stages import stage_spec
from trainfit.models.shapes import match_targets
from trainfit.plan.head import planned_fused_head
from trainfit.plan.rollout import static_cache, uses_decode_loop
from trainfit.plan.screens import rows_per_episode
from trainfit.plan.states import DTYPE_BYTES
from trainfit.plan.steptime import fsdp_offload_work

# One small all-reduce inside a node (NCCL over NVLink, a few KiB): ~10 us, the order of NCCL's published
# intra-node latency; an assumption, not measured here.
TP_ALLREDUCE_S = 10e-6


def work_summary(cfg, facts, pol, bp, prompt: int, seq: int, par, has_value: bool, train_seq: float = 0) -> dict:
    """FLOPs and bytes per GPU per optimizer step, for hardware.roofline_step.

    Forward = 2 x active params x tokens; backward = 4x (2x with frozen weights: only input grads);
    checkpointing recomputes the forward of the checkpointed layers; causal attention adds
    2 x layers x heads x head_dim x T^2 per sequence forward. `train_seq`: the tokens a trained
    sequence costs when it is not `seq` (packed micro-batches, train.padding_free: its real tokens).
    """
    ts = train_seq or seq
    n = facts.n_active_params
    # A screenshot episode trains as up to rows_per_episode rows of up to `seq` tokens each (one per context
    # its turns acted in), so its training and scoring forwards run that many sequences.
    rows = bp.per_device_batch * rows_per_episode(cfg, facts)
    tokens = rows * ts
    full = cfg.peft.method == "none"
    # Checkpointing recomputes the forward of the checkpointed layers only (k of L, models.enable_checkpointing).
    fb = (6 if full else 4) + 2 * cfg.model.checkpointed_layers(facts.n_layers) / max(facts.n_layers, 1)
    attn = 2 * facts.n_layers * facts.heads * facts.head_dim * ts * ts * rows
    spec = stage_spec(cfg.stage)
    rl, iters = spec.rollout, spec.iterations(cfg)
    flops = iters * (fb * n * tokens + 3 * attn)
    if rl:
        flops += (2 * n * tokens + attn) * (_scoring_pass(spec, cfg) + (iters > 1))
        if has_value:
            flops += fb * n * tokens + 3 * attn

    if planned_fused_head(cfg) != "off":  # the fused head recomputes its logits in backward: one more head matmul
        scored = bp.per_device_batch * (cfg.rollout.max_new_tokens if rl else ts)   # scored rows (SFT: at most all)
        flops += iters * 2 * facts.vocab * facts.hidden * scored
    b = DTYPE_BYTES[cfg.model.dtype]
    w = {"train_flops": float(flops), "train_bytes": float(3 * pol.weights * bp.accumulation),
         "grad_bytes": pol.trainable_params * b, "comm_factor": 1.5 if par.zero_stage == 3 else 1.0}
    if par.fsdp_offload:
        w.update(fsdp_offload_work(pol, bp.accumulation))
    elif par.offload_optimizer:
        w["offload_bytes"] = 2 * pol.trainable_params * b
    if rl and cfg.rollout.engine != "openai":
        gen = bp.per_device_batch if cfg.rollout.engine == "vllm" else min(
            cfg.rollout.batch_size or bp.per_device_batch, bp.per_device_batch)
        w["prefill_flops"] = float(2 * n * bp.per_device_batch * prompt)
        w["decode_steps"] = math.ceil(bp.per_device_batch / gen) * cfg.rollout.max_new_tokens * cfg.rollout.max_turns
        w["decode_flops_per_step"] = float(2 * n * gen)
        w["decode_bytes_per_step"] = float(pol.weights + facts.kv_elems(seq, gen) * b / 2)
        tp = cfg.rollout.tensor_parallel_size if cfg.rollout.engine == "vllm" else 1
        if tp > 1:
            # A group of tp GPUs decodes its ranks' tp x gen sequences together, each GPU reading 1/tp of the
            # weights and of the group's KV cache a step (so the KV term above stands), and joining two
            # all-reduces a layer, bound by their latency at decode's few rows.
            w["decode_bytes_per_step"] = float(pol.weights / tp + facts.kv_elems(seq, gen) * b / 2)
            w["decode_sync_s"] = 2 * facts.n_layers * TP_ALLREDUCE_S
        # The worker's own scoring forward (the KL reference, with rollout GPUs) is rollout work.
        w["prefill_flops"] += float((2 * n * tokens + attn) * _worker_scoring(spec, cfg))
    w.update(work_terms(cfg, facts, pol, bp, prompt, ts, has_value))
    if rl and _on_worker(cfg):
        # The worker samples on its own GPU (distributed.rollout_gpus): with max_staleness >= 1 the next
        # rollout is sampled while this step trains (k = 0 waits for the push: in turn, as sync); after
        # every step the trainable tensors cross to it over the GPU link (train/async_rollout.py).
        w["rollout_overlaps"] = cfg.rollout.max_staleness >= 1
        w["push_bytes"] = float(pol.adapters or pol.trainable_params * b)
    return w


def decode_engine(cfg, facts) -> str:
    """The key of the engine generating a GRPO/PPO rollout (ENGINES)."""
    r = cfg.rollout
    if r.engine == "vllm":
        return "vllm"
    if static_cache(r, cfg.model, cfg.train, facts)[1]:
        return "hf-cudagraph"  # the captured decode step (rollout.hf_cache static + hf_cuda_graphs on CUDA)
    return "hf-trainfit" if uses_decode_loop(r, facts) else "hf-generate"


def work_terms(cfg, facts, pol, bp, prompt: int, seq: int, has_value: bool) -> dict:
    """The counts the calibrated estimate adds to the work summary (work_summary), per GPU per step.

    pass_tokens: tokens x passes, passes as the FLOP count has them (forward 1, backward 2, recompute
    1; reference / old-log-prob forwards 1 each); units_*: per token and pass, summed over layers."""
    tokens = bp.per_device_batch * rows_per_episode(cfg, facts) * seq
    ckpt = cfg.model.checkpointed_layers(facts.n_layers) / max(facts.n_layers, 1)  # recompute of k of L layers
    spec = stage_spec(cfg.stage)
    rl, iters = spec.rollout, spec.iterations(cfg)
    passes = iters * (3 + ckpt)
    if rl:
        passes += _scoring_pass(spec, cfg) + (iters > 1) + (3 + ckpt if has_value else 0)
    lora = [] if cfg.peft.method == "none" else match_targets(facts, cfg.peft.target_modules)
    trainable_bytes = pol.trainable_params * DTYPE_BYTES[cfg.model.dtype] if cfg.peft.method == "none" else pol.adapters
    w = {"layers": facts.n_layers, "units_base": facts.n_layers * (facts.hidden + facts.intermediate),
         "units_lora": sum((g.in_features + g.out_features) * g.count for g in lora),
         "lora_modules": sum(g.count for g in lora), "pass_tokens": tokens * passes,
         "quantized": cfg.model.quantization != "none",
         # AdamW reads weights, gradients, moments and master copy, writes all but the gradients.
         "optimizer_bytes": float(2 * (trainable_bytes + pol.optimizer + pol.master) + pol.grads)}
    if rl and cfg.rollout.engine != "openai":
        w["prefill_tokens"] = bp.per_device_batch * prompt + tokens * _worker_scoring(spec, cfg)
        w["decode_engine"] = decode_engine(cfg, facts)
    return w


def _scoring_pass(spec, cfg) -> int:
    """The no-grad forward a rollout adds before training (1 or 0): the reference forward of a stage whose
    loss holds the KL (GRPO, beta > 0); a stage with a critic always scores one (PPO's old log-probs).
    0 on the training GPU when the async worker has GPUs of its own: it scores there (`_worker_scoring`)."""
    return 0 if _on_worker(cfg) else _scores(spec, cfg)


def _worker_scoring(spec, cfg) -> int:
    """The scoring forward the async worker runs on its rollout GPU (distributed.rollout_gpus), 1 or 0."""
    return _scores(spec, cfg) if _on_worker(cfg) else 0


def _scores(spec, cfg) -> int:
    return int(spec.critic or (spec.kl_in_loss and spec.kl_reference(cfg)))


def _on_worker(cfg) -> bool:
    return cfg.rollout.mode == "async" and cfg.device_split().separate
