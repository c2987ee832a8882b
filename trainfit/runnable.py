"""What `trainfit train` runs, decided in one place.

The planner can plan more than the trainer runs (PPO, DeepSpeed ZeRO-3 and offload, FSDP offload).
`train` refuses the rest with the reason, and `fit`, `export` and the planner's suggestions offer only
what passes here, so nothing trainfit writes or suggests fails at launch.
"""

from __future__ import annotations

from typing import Optional

from trainfit.config import Config, ConfigError


def parallel_not_trainable(engine: str, zero_stage: int, offload_optimizer: bool, offload_params: bool,
                           strategy: str = "") -> Optional[str]:
    """Why the trainer does not run this engine (single | ddp | fsdp | deepspeed, as Config.engine())
    with these ZeRO / offload settings, or None when it does."""
    if engine == "deepspeed" and (zero_stage == 3 or offload_optimizer or offload_params):
        return (f"DeepSpeed with zero_stage={zero_stage}, offload_optimizer={offload_optimizer}, "
                f"offload_params={offload_params} is planned and exported but not run by the trainer yet "
                "(ZeRO 1-2 without offload is); for sharded parameters use distributed.strategy=fsdp, and "
                "`trainfit fit` finds a setting that fits without offload.")
    if engine == "fsdp" and (offload_optimizer or offload_params):
        return ("distributed.strategy=fsdp with offload_optimizer/offload_params is planned but not run by the "
                "trainer yet (FSDP shards without offload); set both to false.")
    if engine in ("single", "ddp") and (offload_optimizer or offload_params):
        return (f"distributed.offload_optimizer/offload_params need DeepSpeed, but distributed.strategy="
                f"{strategy or engine} runs {engine}; remove the offload settings.")
    return None


def stage_not_trainable(cfg: Config) -> Optional[str]:
    """Why the trainer does not run this config's stage at all (no setting of fit's changes that)."""
    if cfg.stage == "ppo":
        return ("stage=ppo can be planned (`trainfit plan`) but not trained in this version; use stage=grpo, "
                "which needs no value model.")
    if cfg.stage == "grpo" and cfg.rl_models.reward_model:
        return ("rl_models.reward_model is scored by stage ppo (planned, not trained yet); GRPO scores completions "
                "with task.rewards. Remove rl_models.reward_model, or write a reward function that calls your model.")
    if cfg.stage == "rm" and cfg.model.quantization != "none":
        return (f"stage=rm with model.quantization={cfg.model.quantization} is not run yet (the reward model's head "
                "trains in full beside adapters on a bf16/fp32 base); set model.quantization=none.")
    return None


def not_trainable(cfg: Config) -> Optional[str]:
    """Why `trainfit train` would refuse this single-stage config, or None when it runs it."""
    d = cfg.distributed
    return stage_not_trainable(cfg) or parallel_not_trainable(cfg.engine(), d.zero_stage, d.offload_optimizer,
                                                              d.offload_params, d.strategy)


def require_trainable(cfg: Config) -> None:
    """Raise ConfigError (exit 2) with the reason when `trainfit train` does not run a stage of `cfg`."""
    from trainfit.config import expand_stages

    for stage_cfg in expand_stages(cfg):
        reason = not_trainable(stage_cfg)
        if reason:
            raise ConfigError(reason)
