"""The one typed config of trainfit: the schema, its cross-field rules, and derived batch arithmetic.

Every field is documented once, here. Cross-field rules live in rules.py (`cross_field_errors`); derived
numbers (accumulation, prompts per step) live in `BatchPlan`, computed and never asked for twice.
Reading YAML and overrides is io.py; trainfit/config/__init__.py re-exports the public names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, ValidationError, model_validator

from trainfit.config.base import ConfigError, _Section, deep_merge
from trainfit.config.data import DataConfig, TaskConfig
from trainfit.config.devices import DeviceSplit, device_split
from trainfit.config.dpo import DPOConfig
from trainfit.config.errors import format_validation_error
from trainfit.config.model import ModelConfig, PeftConfig
from trainfit.config.rl import GRPOConfig, PPOConfig, RLModelsConfig
from trainfit.config.rollout import EnvConfig, RolloutConfig
from trainfit.config.rules import cross_field_errors
from trainfit.config.stages import stage_names, stage_spec
from trainfit.config.train import DistributedConfig, HardwareConfig, LoggingConfig, TrainConfig



StageName = Literal[stage_names()]  # the stage table (stages.py), in registration order


class Config(_Section):
    stage: StageName = Field("sft", description=(
        "What to train: pretrain, sft, rm (a reward model on preference pairs in data.path: `prompt` or "
        "`messages`, `chosen`, `rejected`; a sample is one pair; or, without data.path, pairs made from task.name: "
        "its answer chosen, a wrong one rejected), dpo (the policy on the same preference pairs, see dpo.loss_type), grpo, or ppo (a policy with a learned critic, "
        "on one process, DDP ranks or DeepSpeed ZeRO 0-3; not FSDP in this version)."))
    run_dir: str = Field("runs/default", description="Where metrics, checkpoints and the final model go.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    peft: PeftConfig = Field(default_factory=PeftConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    dpo: DPOConfig = Field(default_factory=DPOConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    hardware: HardwareConfig = Field(default_factory=HardwareConfig)
    rl_models: RLModelsConfig = Field(default_factory=RLModelsConfig)
    stages: list[dict[str, Any]] = Field(default_factory=list, description=(
        "A pipeline: each entry is overrides applied to this config for one stage, run in order, each "
        "starting from the previous stage's final model (e.g. SFT then GRPO)."))

    @model_validator(mode="after")
    def _cross_checks(self) -> "Config":
        if self.stages:
            # A pipeline's base is no stage: the rules hold for each stage merged with it (a stage may
            # bring its own data or task), so each merged stage is validated, its errors naming it.
            expand_stages(self)
            return self
        errs = cross_field_errors(self)
        if errs:
            raise ValueError(" ".join(errs))
        return self

    @property
    def world_size(self) -> int:
        """Training processes: the node's GPUs less its rollout GPUs, times the nodes."""
        d = self.distributed
        return max(1, d.num_gpus - d.rollout_gpus) * d.num_nodes

    def device_split(self) -> DeviceSplit:
        """Which GPUs of a node train and which roll out (config/devices.py)."""
        d = self.distributed
        return device_split(d.num_gpus, min(d.rollout_gpus, d.num_gpus - 1))

    def engine(self) -> str:
        """single | ddp | fsdp | deepspeed: what distributed.strategy means for this config.
        `auto`: ZeRO or offload settings imply DeepSpeed, several ranks DDP, else a single process."""
        d = self.distributed
        engine = d.strategy
        if engine == "auto":
            if d.zero_stage > 0 or d.offload_optimizer or d.offload_params:
                engine = "deepspeed"
            else:
                engine = "ddp" if self.world_size > 1 else "single"
        return "single" if engine == "ddp" and self.world_size == 1 else engine

    def frozen_sharding(self) -> str:
        """How RL's frozen models (a reference copy of the policy, the reward model) are spread over the
        ranks, for the trainer (train/frozen.py) and the planner alike: "fsdp" or "zero3" when the trained
        module is sharded over several ranks (they are sharded the same way), else "" (whole on every rank)."""
        if self.world_size < 2:
            return ""
        engine = self.engine()
        if engine == "fsdp":
            return "fsdp"
        return "zero3" if engine == "deepspeed" and self.distributed.zero_stage == 3 else ""

    def frozen_offload(self) -> bool:
        """Whether the sharded frozen models keep their shards in CPU RAM: rl_models.offload_frozen, or ZeRO-3's
        offload_params (their engines take the run's ZeRO-3 config)."""
        how = self.frozen_sharding()
        return bool(how) and (self.rl_models.offload_frozen or (how == "zero3" and self.distributed.offload_params))

    def rollout_gathers_whole(self) -> bool:
        """Whether ZeRO-3 gathers the trained models whole (every parameter, hooks off) for the rollout: only
        where the engine generates with the trainer's own module (rollout.engine=hf; under the partition
        hooks each generated token would be a collective). An engine with its own copy (vllm, openai) gets
        the weights a tensor at a time and the scoring forwards gather a layer at a time, as training's.
        The trainer (train/grpo.py, ppo.py `prepare`) and the planner (plan/states.py) both ask this."""
        return self.engine() == "deepspeed" and self.distributed.zero_stage == 3 and self.rollout.engine == "hf"

    def ppo_shared_base(self) -> bool:
        """Whether PPO's critic shares the policy's frozen base (ppo.shared_base resolved)."""
        if self.ppo.shared_base is not None:
            return self.ppo.shared_base
        # FSDP2 shards each model it trains on its own: a critic over the policy's base would shard it twice.
        return self.peft.method != "none" and not self.rl_models.value_model and self.engine() != "fsdp"

    def effective_lr(self) -> float:
        """train.lr after distributed.lr_scaling (the lr the optimizer uses)."""
        d, lr = self.distributed, self.train.lr
        if d.lr_scaling == "none" or not d.base_global_batch_size:
            return lr
        ratio = self.train.global_batch_size / d.base_global_batch_size
        return lr * (ratio if d.lr_scaling == "linear" else ratio ** 0.5)

    def episode_tokens(self) -> int:
        """Tokens of one GRPO training sequence at most: a prompt and completion, or a whole multi-turn
        episode (rollout.max_episode_tokens, else prompt + max_turns x (turn + observation))."""
        r = self.rollout
        if self.env.type == "none":
            return r.max_prompt_length + r.max_new_tokens
        return r.max_episode_tokens or (r.max_prompt_length
                                        + r.max_turns * (r.max_new_tokens + self.env.max_observation_tokens))

    def padding_free(self, vision: bool = False) -> bool:
        """Whether this stage's micro-batches train as packed padding-free rows (train.padding_free
        resolved; the trainer and the planner both read it). `auto` packs where the attention runs
        varlen kernels (flash-attention): with sdpa / eager a packed row attends through a dense
        block-diagonal mask over its N tokens, N^2 work that can cost more than the padding saves.
        A vision-language policy (`vision`) trains padded: its rope positions are per row (3-D)."""
        if not stage_spec(self.stage).padding_free or self.train.padding_free == "off" or vision:
            return False
        return self.train.padding_free == "on" or self.model.attn_implementation.startswith("flash_attention")

    def batch_plan(self) -> "BatchPlan":
        return BatchPlan.from_config(self)


@dataclass(frozen=True)
class BatchPlan:
    """Derived batch arithmetic: the one place these numbers come from."""

    global_batch: int       # samples (GRPO: completions) per optimizer step, all devices
    micro_batch: int        # samples per forward on one device
    world_size: int
    accumulation: int       # micro-steps per optimizer step on one device
    per_device_batch: int   # samples per optimizer step on one device
    group_size: int         # GRPO G (1 for other stages)
    prompts_per_step: int   # GRPO prompts per optimizer step (= global for other stages)

    @classmethod
    def from_config(cls, cfg: Config) -> "BatchPlan":
        t, world = cfg.train, cfg.world_size
        g = stage_spec(cfg.stage).group_size(cfg)
        per_dev = t.global_batch_size // world
        return cls(t.global_batch_size, t.micro_batch_size, world, per_dev // t.micro_batch_size,
                   per_dev, g, t.global_batch_size // g)

    def describe(self) -> str:
        s = (f"global batch {self.global_batch} = micro {self.micro_batch} x accumulation {self.accumulation}"
             f" x devices {self.world_size}")
        if self.group_size > 1:
            s += f"; {self.prompts_per_step} prompts x {self.group_size} generations per step"
        return s


def validate(raw: dict) -> Config:
    """Validate a raw mapping into a Config, turning pydantic errors into one readable paragraph."""
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_validation_error(Config, e, raw)) from None


def expand_stages(cfg: Config) -> list[Config]:
    """A pipeline config becomes one Config per stage (base merged with the stage's overrides)."""
    if not cfg.stages:
        return [cfg]
    base = cfg.model_dump(exclude={"stages"})
    out = []
    for i, entry in enumerate(cfg.stages):
        if not isinstance(entry, dict) or "stage" not in entry:
            raise ConfigError(f"stages[{i}] must be a mapping with a `stage:` key (pretrain, sft, rm, dpo, grpo or ppo) and "
                              "the overrides for that stage.")
        merged = deep_merge(base, entry)
        try:
            out.append(validate(merged))
        except ConfigError as e:
            raise ConfigError(f"In stages[{i}] ({entry['stage']}): {e}") from None
    return out
