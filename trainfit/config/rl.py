"""Config sections of the RL stages: GRPO, PPO and the frozen models they read (`rl_models`)."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field

from trainfit.config.base import _Section, round_up


class GRPOConfig(_Section):
    num_generations: int = Field(8, ge=2, description="Completions per prompt (the group size G).")
    loss_type: Literal["grpo", "dr_grpo", "dapo"] = Field("dapo", description=(
        "Loss aggregation: `grpo` = mean over sequences of per-sequence token means; `dr_grpo` = token sum "
        "/ (sequences x max_new_tokens); `dapo` = token mean over the whole batch."))
    scale_rewards: bool = Field(True, description="Divide group-centred rewards by the group std (off for Dr. GRPO).")
    beta: float = Field(0.0, ge=0.0, description="KL penalty weight to the reference policy (0 = no reference pass).")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="KL estimator (Schulman's k1/k2/k3).")
    epsilon: float = Field(0.2, gt=0.0, description="Lower clip range of the ratio (1 - epsilon).")
    epsilon_high: Optional[float] = Field(None, gt=0.0, description="Upper clip range (1 + epsilon_high); default = epsilon.")
    num_iterations: int = Field(1, ge=1, description="Optimizer steps per rollout batch (>1 reuses samples with ratios).")
    advantage: Literal["group_norm", "rloo", "reinforce_pp", "reinforce_pp_batch"] = Field("group_norm", description=(
        "How rewards become advantages: `group_norm` (GRPO, Shao et al. 2024: reward minus its group's mean, "
        "over the group std when scale_rewards); `rloo` (Ahmadian et al. 2024: reward minus the mean of the "
        "other G-1 rewards of its group); `reinforce_pp` (REINFORCE++-baseline, Hu 2025: group mean "
        "subtracted, divided by the std over the whole step); `reinforce_pp_batch` (REINFORCE++: the step's "
        "mean and std). scale_rewards applies to group_norm only."))
    importance: Literal["token", "sequence"] = Field("token", description=(
        "Level of the importance ratio: `token` (PPO/GRPO) or `sequence` (GSPO, Zheng et al. 2025: one "
        "length-normalised ratio per completion, clipped as a whole; GSPO uses small clip ranges such as "
        "epsilon 3e-4, epsilon_high 4e-4). Only matters when num_iterations > 1 or samples are off-policy."))


class PPOConfig(_Section):
    """PPO with a learned critic (stage ppo). The clipped surrogate's ranges (grpo.epsilon,
    grpo.epsilon_high), the loss aggregation (grpo.loss_type) and the KL estimator (grpo.kl_estimator)
    are GRPO's fields, defined once there; they apply to PPO's policy and value losses alike."""

    gamma: float = Field(1.0, ge=0.0, le=1.0, description="Discount of future token rewards in GAE.")
    lam: float = Field(0.95, ge=0.0, le=1.0, description="GAE lambda (1 = Monte-Carlo returns, 0 = one-step TD).")
    vf_clip: float = Field(0.2, ge=0.0, description=(
        "Clip range of the value update around the rollout's values (PPO's clipped value loss); 0 = no clip."))
    vf_coef: float = Field(0.1, ge=0.0, description=(
        "Weight of the value loss in the summed loss (the critic has its own lr; this scales its gradient "
        "against the policy's under the global train.grad_clip)."))
    value_lr: Optional[float] = Field(None, gt=0.0, description="Critic learning rate (None = train.lr); same schedule.")
    kl_coef: float = Field(0.05, ge=0.0, description="Weight of the KL penalty to the reference policy (0 = no reference pass).")
    kl_mode: Literal["reward", "loss"] = Field("reward", description=(
        "`reward`: -kl_coef x per-token KL folded into the token rewards before GAE (InstructGPT, OpenRLHF); "
        "`loss`: kl_coef x KL added to the policy loss per token, like GRPO's beta."))
    adaptive_kl_target: Optional[float] = Field(None, gt=0.0, description=(
        "Target KL per sequence for the adaptive controller of Ziegler et al. 2019 (None = fixed kl_coef)."))
    adaptive_kl_horizon: int = Field(10000, ge=1, description="Adaptive KL horizon in samples.")
    epochs: int = Field(1, ge=1, description="PPO epochs over each rollout batch.")
    num_mini_batches: int = Field(1, ge=1, description=(
        "Optimizer steps per epoch: a rollout is train.global_batch_size x num_mini_batches prompts (one "
        "completion each), split into this many minibatches of train.global_batch_size samples."))
    whiten_advantages: bool = Field(True, description="Normalise advantages to mean 0, std 1 over each rollout batch.")
    entropy_coef: float = Field(0.0, ge=0.0, description="Entropy bonus weight (0 = none).")
    reward_model_weight: float = Field(1.0, description=(
        "Weight of rl_models.reward_model's score, added to the weighted task.rewards sum."))
    shared_base: Optional[bool] = Field(None, description=(
        "With peft: the critic's adapters and value head sit on the policy's own frozen base weights (one "
        "copy in memory for policy, critic and reference; 7B bf16 saves ~14 GiB) instead of a second copy "
        "of the base. None = true with peft and no rl_models.value_model (false under distributed.strategy=fsdp); "
        "false = a separate critic base."))


class RLModelsConfig(_Section):
    reward_model: Optional[str] = Field(None, description=(
        "Reward model (sequence classifier) id or dir; none = reward functions. In a pipeline, `stage:rm` = "
        "the final dir of the rm stage before this one."))
    reward_dtype: Literal["fp32", "bf16", "fp16"] = Field("bf16", description="Reward model dtype (frozen).")
    value_model: Optional[str] = Field(None, description="PPO critic; default = initialised from the policy.")
    offload_frozen: bool = Field(False, description=(
        "Keep the frozen models' shards (PPO's / GRPO's reference copy of a full fine-tune, the reward model) in "
        "CPU RAM and copy each layer to the GPU for its forward, as verl's param offload of ref and reward "
        "does: less GPU memory, slower scoring. They are sharded only with the trained model, so this needs "
        "distributed.strategy=fsdp or deepspeed zero_stage=3 over several GPUs (ZeRO-3's offload_params "
        "offloads them already)."))


def grpo_errors(cfg: Any) -> list[tuple[str, str]]:
    """Rules of stage grpo: whole groups per step and per device, and a task to sample prompts from."""
    out: list[tuple[str, str]] = []
    gb, world, g = cfg.train.global_batch_size, cfg.world_size, cfg.grpo.num_generations
    if gb % g:
        out.append(("tf.grpo_groups", f"train.global_batch_size={gb} is not a multiple of grpo.num_generations={g}: a "
                    f"GRPO group would be split across optimizer steps; use {round_up(gb, g)} "
                    f"({round_up(gb, g) // g} prompts x {g})."))
    elif (gb // world) % g and gb % world == 0:
        out.append(("tf.grpo_groups_per_device", f"train.global_batch_size={gb} gives {gb // world} completions per "
                    f"device, not whole groups of grpo.num_generations={g}; make global_batch_size a multiple of "
                    f"{g * world}."))
    if cfg.task.name is None:
        out.append(("tf.grpo_task", "stage grpo needs prompts and rewards: set task.name (arithmetic, arithmetic_tagged, "
                    "or jsonl with task.path)."))
    return out


def ppo_errors(cfg: Any) -> list[tuple[str, str]]:
    """Rules of stage ppo: prompts, a reward, and a critic base that can hold its adapters."""
    out: list[tuple[str, str]] = []
    if cfg.task.name is None:
        out.append(("tf.ppo_task", "stage ppo needs prompts: set task.name (arithmetic, arithmetic_tagged, or jsonl with "
                    "task.path)."))
    if not cfg.task.rewards and not cfg.rl_models.reward_model:
        out.append(("tf.ppo_rewards", "stage ppo needs a reward: list reward functions in task.rewards, or set "
                    "rl_models.reward_model to a sequence-classifier directory (e.g. a stage rm final dir)."))
    if cfg.ppo.shared_base and cfg.peft.method == "none":
        out.append(("tf.ppo_shared_base_peft", "ppo.shared_base=true puts the critic's adapters on the policy's frozen "
                    "base, which needs adapters: set peft.method=lora or dora, or ppo.shared_base=false."))
    if cfg.ppo.shared_base and cfg.rl_models.value_model:
        out.append(("tf.ppo_shared_base_value", f"ppo.shared_base=true with rl_models.value_model="
                    f"{cfg.rl_models.value_model!r}: a critic loaded from its own directory has its own base. "
                    "Remove rl_models.value_model (the critic starts from the policy), or set ppo.shared_base=false."))
    return out
