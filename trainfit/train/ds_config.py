"""The DeepSpeed JSON of a trainfit config: what the trainer passes to deepspeed.initialize and what `trainfit
export` writes for the deepspeed launcher (one definition for both)."""

from __future__ import annotations

from trainfit.config import Config


def resolve_strategy(cfg: Config) -> str:
    """single | ddp | fsdp | deepspeed (the config's one rule, shared with the planner and trainer)."""
    return cfg.engine()


def deepspeed_config(cfg: Config) -> dict:
    """A DeepSpeed config whose numbers are the trainfit config's (no "auto")."""
    bp, d, t = cfg.batch_plan(), cfg.distributed, cfg.train
    stage = d.zero_stage
    zero: dict = {"stage": stage}
    if stage > 0:
        # Overlap the gradient reduce with backward and keep gradients in one buffer (less fragmentation).
        zero.update(overlap_comm=True, contiguous_gradients=True)
    if d.offload_optimizer and stage > 0:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if d.offload_params and stage == 3:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if stage == 3:
        # Without it a ZeRO-3 save writes partitions only, not loadable weights.
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    ds: dict = {
        "train_batch_size": bp.global_batch,
        "train_micro_batch_size_per_gpu": bp.micro_batch,
        "gradient_accumulation_steps": bp.accumulation,
        "gradient_clipping": float(t.grad_clip),
        "zero_optimization": zero,
        "bf16": {"enabled": cfg.model.dtype == "bf16"},
        "fp16": {"enabled": cfg.model.dtype == "fp16"},
        "wall_clock_breakdown": False,
    }
    if cfg.model.dtype == "fp16":
        # Dynamic loss scaling (loss_scale 0) starting at 2^16, DeepSpeed's usual settings.
        ds["fp16"].update(loss_scale=0, initial_scale_power=16, loss_scale_window=1000, hysteresis=2, min_loss_scale=1)
    if t.optimizer == "adamw":
        # In the file (not only in the trainer) because ZeRO-Offload needs DeepSpeed's CPU Adam, which it
        # builds only from this block.
        ds["optimizer"] = {"type": "AdamW", "params": {"lr": t.lr, "betas": [t.adam_beta1, t.adam_beta2],
                                                       "eps": t.adam_eps, "weight_decay": t.weight_decay}}
    # bitsandbytes 8-bit optimizers have no DeepSpeed type: the trainer passes them as a client optimizer.
    if t.schedule == "cosine":
        ds["scheduler"] = {"type": "WarmupCosineLR", "params": {
            "total_num_steps": max(t.max_steps, 1), "warmup_num_steps": t.warmup_steps, "warmup_min_ratio": 0.0,
            "cos_min_ratio": t.min_lr_ratio, "warmup_type": "linear"}}
    else:
        ds["scheduler"] = {"type": "WarmupLR", "params": {
            "warmup_min_lr": 0.0, "warmup_max_lr": t.lr, "warmup_num_steps": t.warmup_steps, "warmup_type": "linear"}}
    return ds
