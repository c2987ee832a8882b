"""The stage table: what each stage reads, holds, runs, saves and supports, one registered description each.

Shared code (config rules, the planner, fit, doctor, runnable, dry-run, train/run.py) reads a stage's
description here instead of comparing its name, so adding a stage is its module in train/ plus one
`register` call. In the config layer (imports nothing from trainfit), so every layer may read it; the
training code is bound by name (`stage_class`), so config never imports the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from trainfit.config.dpo import DPO_REFERENCE_FREE, dpo_errors, dpo_reference
from trainfit.config.rl import grpo_errors, ppo_errors

__all__ = ["DPO_REFERENCE_FREE", "STAGES", "StageSpec", "dpo_reference", "register", "stage_names", "stage_spec"]


@dataclass(frozen=True)
class StageSpec:
    """What one stage is: what it reads, which models it holds, which phases it runs, what it saves and what
    it supports. Every door (config rules, the planner, fit, doctor, runnable, dry-run, the trainer) reads
    these fields instead of the stage's name."""

    name: str
    stage_class: str                 # "module:Class" of its train/ stage (bound by name: config never imports train)
    data: str = "sft"                # what data.path rows are: "text" (raw text) | "sft" | "pairs" | "none" (prompts from task.name)
    reads_pairs: bool = False        # trains on preference pairs (data.path rows or pairs made from task.name)
    unpaired_rows: bool = False      # also reads unpaired rows {prompt, completion, label} (dpo.loss_type=kto)
    rollout: bool = False            # samples completions from the policy with a rollout engine every step
    group_key: str = ""              # config key of the completions sampled per prompt (a group), e.g. grpo.num_generations
    iterations_key: str = ""         # config key of the optimizer steps per rollout (old log-probs when > 1)
    kl_key: str = ""                 # config key of the KL coefficient to a frozen reference (a reference when > 0)
    kl_in_loss: bool = False         # the KL term sits in the policy loss (GRPO), not in the rewards (PPO)
    critic: bool = False             # holds a learned value model trained with the policy (old log-probs every step)
    scores_reward_model: bool = False  # scores completions with rl_models.reward_model
    envs: bool = False               # runs multi-turn environments (env.type)
    async_rollout: bool = False      # rollout.mode=async applies: a worker samples the next rollouts while it trains
    env_eval: bool = False           # with env.type, evaluates greedy held-out episodes (task.name's eval rows) against
                                     # the environment while training on data.path (SFT on expert trajectories)
    packs: bool = False              # data.packing applies
    padding_free: bool = False       # train.padding_free applies (micro-batches of scored sequences packed)
    streams: bool = False            # data.streaming applies
    plain_head: str = ""             # why the fused LM head does not apply (its loss reads no LM head logits), "" when it does
    not_fsdp: str = ""               # why the trainer does not run it under distributed.strategy=fsdp, "" when it does
    not_fsdp_adapters: str = ""      # why it does not run with peft adapters under distributed.strategy=fsdp, "" when it does
    quantized_base: str = ""         # why model.quantization is not run for it, "" when it is
    outputs_policy: bool = True      # its final dir is a policy the next pipeline stage continues from
    saves: str = "policy"            # final dir: "policy" (a causal LM) | "reward_model" (a sequence classifier)
    reference: str = "never"         # "never" | "kl" (kl_key > 0) | "preference" (decided by dpo.reference: adapters_off | copy | none)
    trained_label: str = ""          # what the trainer's parameter count covers, e.g. "reward model "
    pairs_per_forward: int = 1       # sequences a sample puts through the training forward
    rules: Callable[[Any], list] = lambda cfg: []   # its own cross-field rules: [(code, message)]

    def group_size(self, cfg: Any) -> int:
        """Completions sampled per prompt (1 for stages without groups)."""
        return _read(cfg, self.group_key) if self.group_key else 1

    def iterations(self, cfg: Any) -> int:
        """Optimizer steps per rollout (1 for stages without reuse)."""
        return _read(cfg, self.iterations_key) if self.iterations_key else 1

    def kl_reference(self, cfg: Any) -> bool:
        """Whether a frozen reference model scores the rollouts (a KL penalty above 0)."""
        return bool(self.kl_key) and _read(cfg, self.kl_key) > 0

    def loss_kl_coef(self, cfg: Any) -> float:
        """The KL coefficient of the policy loss (0 when the stage has none there)."""
        return _read(cfg, self.kl_key) if self.kl_in_loss else 0.0

    def eval_episodes(self, cfg: Any) -> bool:
        """Whether the stage trains on data.path and evaluates held-out episodes of task.name against env.type."""
        return self.env_eval and not self.envs and cfg.env.type != "none"

    def old_logprobs(self, cfg: Any) -> bool:
        """Whether the rollout's log-probs under the sampling policy are computed in a forward of their own."""
        return self.critic or self.iterations(cfg) > 1


def _read(cfg: Any, dotted: str) -> Any:
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


STAGES: dict[str, StageSpec] = {}


def register(spec: StageSpec) -> StageSpec:
    STAGES[spec.name] = spec
    return spec


register(StageSpec("pretrain", "trainfit.train.sft:LMStage", data="text", streams=True))
register(StageSpec("sft", "trainfit.train.sft:LMStage", packs=True, env_eval=True))
register(StageSpec("rm", "trainfit.train.rm:RMStage", data="pairs", reads_pairs=True, outputs_policy=False,
                   saves="reward_model", trained_label="reward model ", pairs_per_forward=2,
                   plain_head="a reward model has no LM head",
                   not_fsdp_adapters="its final model is saved with the adapters merged into the weights, which "
                                     "one rank cannot do on FSDP2 shards",
                   quantized_base="the reward model's head trains in full beside adapters on a bf16/fp32 base"))
register(StageSpec("dpo", "trainfit.train.dpo:DPOStage", data="pairs", reads_pairs=True, unpaired_rows=True,
                   padding_free=True, reference="preference", pairs_per_forward=2, rules=dpo_errors))
register(StageSpec("grpo", "trainfit.train.grpo:GRPOStage", data="none", rollout=True, padding_free=True,
                   group_key="grpo.num_generations",
                   iterations_key="grpo.num_iterations", kl_key="grpo.beta", kl_in_loss=True, reference="kl", envs=True,
                   async_rollout=True, rules=grpo_errors))
register(StageSpec("ppo", "trainfit.train.ppo:PPOStage", data="none", rollout=True, kl_key="ppo.kl_coef",
                   padding_free=True, reference="kl", critic=True, scores_reward_model=True, trained_label="policy + critic ",
                   plain_head="PPO's policy-critic forward keeps the plain head",
                   quantized_base="the critic is built on an unquantized copy of the base", rules=ppo_errors))


def stage_spec(name: str) -> StageSpec:
    return STAGES[name]


def stage_names() -> tuple[str, ...]:
    return tuple(STAGES)
