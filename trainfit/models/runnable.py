"""What `trainfit train` runs, decided in one place.

The planner can plan more than the trainer runs (offload without ZeRO or with a bitsandbytes
optimizer). DeepSpeed ZeRO 1-3 runs, with the optimizer offloaded to CPU (DeepSpeed's CPU Adam) and,
under ZeRO-3, the parameters too; FSDP2 offloads parameters, gradients and optimizer together
(config/rules.py fsdp_offload_errors says which settings).
`train` refuses the rest with the reason, and `fit`, `export` and the planner's suggestions offer only
what passes here, so nothing trainfit writes or suggests fails at launch.
"""

from __future__ import annotations

from typing import Optional, Sequence

from trainfit.config.stages import stage_spec
from trainfit.config import Config, ConfigError, ModelConfig, RLModelsConfig, apply_override, expand_stages, validate
from trainfit.core import extras
from trainfit.models.lora_rules import MAMBA_TYPES
from trainfit.models.shapes import locate


def parallel_not_trainable(engine: str, zero_stage: int, offload_optimizer: bool, offload_params: bool,
                           strategy: str = "", stage: str = "") -> Optional[str]:
    """Why the trainer does not run this engine (single | ddp | fsdp | deepspeed, as Config.engine())
    with these ZeRO / offload settings for this stage, or None when it does."""
    if stage and engine == "fsdp" and stage_spec(stage).not_fsdp:
        return (f"stage={stage} with distributed.strategy={strategy or engine} (engine fsdp) is planned but not run yet: "
                f"{stage_spec(stage).not_fsdp}. Set distributed.strategy=deepspeed (with zero_stage) or ddp, or use "
                "stage=grpo for FSDP.")
    if engine == "deepspeed" and offload_params and zero_stage != 3:
        return (f"distributed.offload_params=true needs zero_stage=3 (got zero_stage={zero_stage}): only ZeRO-3 "
                "partitions the parameters, so only it can keep them in CPU RAM. Set distributed.zero_stage=3, or "
                "offload_params=false (offload_optimizer runs with ZeRO 1-3).")
    if engine == "deepspeed" and offload_optimizer and zero_stage == 0:
        return ("distributed.offload_optimizer=true needs a ZeRO stage (got zero_stage=0): DeepSpeed offloads the "
                "optimizer partition ZeRO makes. Set distributed.zero_stage=2 (or 1 or 3).")
    if engine in ("single", "ddp") and (offload_optimizer or offload_params):
        return (f"distributed.offload_optimizer/offload_params need DeepSpeed, but distributed.strategy="
                f"{strategy or engine} runs {engine}; remove the offload settings.")
    return None


def method_not_trainable(model_type: str, quantization: str, stage: str = "") -> Optional[str]:
    """Why the trainer does not run this quantization on this architecture and stage, or None."""
    if quantization != "none" and stage and stage_spec(stage).quantized_base:
        return (f"stage={stage} with model.quantization={quantization} is not run yet "
                f"({stage_spec(stage).quantized_base}); set model.quantization=none.")

    if quantization != "none" and model_type in MAMBA_TYPES:
        return (f"model.quantization={quantization} on a Mamba-family model ({model_type}) is not run: bitsandbytes' "
                "layers break its selective scan; use LoRA on the bf16 base (model.quantization=none).")
    return None


def model_type_of(model: ModelConfig) -> str:
    """The architecture's model_type, or "" when its config cannot be found without a download."""
    try:
        return locate(model.name, model.revision, model.trust_remote_code).config.get("model_type", "")
    except (ConfigError, OSError, ValueError):
        return ""


def stage_not_trainable(stage: str, rl_models: RLModelsConfig) -> Optional[str]:
    """Why the trainer does not run a config's stage at all (no setting of fit's changes that)."""
    spec = stage_spec(stage)
    if spec.rollout and not spec.scores_reward_model and rl_models.reward_model:
        return ("rl_models.reward_model is scored by stage ppo; GRPO scores completions with task.rewards. "
                "Remove rl_models.reward_model (or use stage=ppo), or write a reward function that calls your model.")
    return None


def optimizer_not_trainable(cfg: Config) -> Optional[str]:
    """Why the trainer does not run this optimizer / quantized base with these ZeRO settings, or None."""
    d = cfg.distributed
    if cfg.engine() == "deepspeed" and d.offload_optimizer and cfg.train.optimizer != "adamw":
        return (f"train.optimizer={cfg.train.optimizer} with distributed.offload_optimizer=true is not run: the "
                "offloaded optimizer is DeepSpeed's CPU Adam, which cannot step bitsandbytes' 8-bit states. Set "
                "train.optimizer=adamw, or offload_optimizer=false.")
    if cfg.engine() == "deepspeed" and d.zero_stage == 3 and cfg.model.quantization != "none":
        return (f"model.quantization={cfg.model.quantization} with distributed.zero_stage=3 is not run: ZeRO-3 "
                "partitions every parameter, and bitsandbytes' quantized weights cannot be split that way. Use "
                "zero_stage=2 (adapters are small), or model.quantization=none.")
    return None


def not_trainable(cfg: Config) -> Optional[str]:
    """Why `trainfit train` would refuse this single-stage config, or None when it runs it."""
    d = cfg.distributed
    return (stage_not_trainable(cfg.stage, cfg.rl_models)
            or parallel_not_trainable(cfg.engine(), d.zero_stage, d.offload_optimizer, d.offload_params, d.strategy,
                                      cfg.stage)
            or optimizer_not_trainable(cfg)
            or (method_not_trainable(model_type_of(cfg.model), cfg.model.quantization, cfg.stage)
                if cfg.model.quantization != "none" else None))


def refusal(cfg: Config, overrides: Sequence[str] = ()) -> Optional[str]:
    """Why `trainfit train` would refuse `cfg` with `overrides` (key=value) applied, or None: the schema
    and cross-field rules, then what the trainer runs, for every stage. What the planner suggests and
    the advice in messages pass here before they are offered."""
    try:
        raw = cfg.model_dump()
        for ov in overrides:
            raw = apply_override(raw, ov)
        stages = expand_stages(validate(raw))
    except ConfigError as e:
        return str(e)
    return next((r for r in map(not_trainable, stages) if r), None)


def require_trainable(cfg: Config) -> None:
    """Raise ConfigError (exit 2) with the reason when `trainfit train` does not run a stage of `cfg`."""
    for stage_cfg in expand_stages(cfg):
        reason = not_trainable(stage_cfg)
        if reason:
            raise ConfigError(reason)


def require_extras(cfg: Config, planning: bool = False) -> None:
    """ConfigError (exit 2) for the first package `cfg` needs that is not installed; `planning`: only
    those the planner reads here (the rest are the training machine's). Without DeepSpeed, the
    alternative offered is one `trainfit train` runs for this config (FSDP shards like ZeRO, offloads only
    parameters, gradients and optimizer together, and does not shard a quantized base; DDP on one process is
    plain single-process training)."""
    gone = [n for n in extras.missing(cfg) if n.to_plan or not planning]
    if not gone:
        return
    other = None
    if gone[0].module == "deepspeed":
        order = ("fsdp", "ddp") if cfg.world_size > 1 else ("ddp",)
        other = next((s for s in order if not refusal(cfg, [f"distributed.strategy={s}"])), None)
    raise ConfigError(extras.message(gone[0], other))
