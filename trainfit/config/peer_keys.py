"""Keys of the tools users come from (TRL, verl, OpenRLHF, LLaMA-Factory) that mean a trainfit key.

An unknown config key is first looked up here (config/errors.py), so that `rollout.n` is answered with
grpo.num_generations rather than with the nearest spelling ("did you mean 'rollout'"). A row's key is
written as its tool writes it: verl's Hydra path dotted from the root of ppo_trainer.yaml, the others'
argument names (TRL's GRPOConfig / DPOConfig / SFTConfig and the Trainer's arguments, OpenRLHF's command
line flags without `--`, LLaMA-Factory's YAML keys). A key the user writes matches a row when it ends with
the row's key, or when the row's key ends with the user's key after its trainfit section
(`train.per_device_train_batch_size`, `data.ppo_mini_batch_size`); a one- or two-letter last part
(verl's `n`, `lr`) must come with its parent (`rollout.n`, `optim.lr`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class PeerKey:
    peer: str       # who writes it: TRL, verl, OpenRLHF, LLaMA-Factory; "" for a word several tools and papers use
    key: str        # as that tool writes it
    trainfit: str   # the trainfit key that means it
    note: str = ""     # what else to know; the value carries over as is
    convert: str = ""  # when the meaning or the values differ: how to carry the value over (then it does not as is)
    carry: Optional[str] = None  # how `trainfit import` carries the value (config/importers/values.py): a converter's
    # name, "" as it is, "-" when the importer computes it (batch sizes, steps) or cannot; None: as it is unless
    # `convert` says the value differs

    @property
    def carried(self) -> str:
        return self.carry if self.carry is not None else ("-" if self.convert else "")


# What trainfit calls each key a row points to, in words (the answer reads "trainfit calls <what> <key>").
WHAT = {
    "grpo.num_generations": "the group size",
    "train.micro_batch_size": "the samples of one forward pass on one GPU",
    "train.global_batch_size": "the samples of one optimizer step on all GPUs together",
    "train.lr": "the peak learning rate",
    "train.max_steps": "the run's length in optimizer steps",
    "train.warmup_steps": "the warmup in optimizer steps",
    "train.schedule": "the learning-rate schedule",
    "train.grad_clip": "the gradient-norm clip",
    "train.weight_decay": "the weight decay",
    "train.adam_eps": "AdamW's epsilon",
    "train.save_every": "the checkpoint interval in steps",
    "train.eval_every": "the evaluation interval in steps",
    "train.log_every": "the logging interval in steps",
    "rollout.max_new_tokens": "the tokens generated per completion at most",
    "rollout.max_prompt_length": "the prompt tokens at most",
    "rollout.gpu_memory_utilization": "vLLM's share of the card",
    "rollout.tensor_parallel_size": "the rollout engine's tensor parallelism",
    "rollout.engine": "the generation engine",
    "rollout.batch_size": "the sequences generated together",
    "rollout.sleep_level": "vLLM's sleep between phases",
    "grpo.beta": "the weight of the KL term to the reference in GRPO's loss",
    "grpo.epsilon": "the clip range of the policy ratio",
    "grpo.epsilon_high": "the upper clip range of the policy ratio",
    "grpo.num_iterations": "the optimizer steps per rollout batch",
    "grpo.loss_type": "how the policy loss is averaged over tokens",
    "grpo.advantage": "how rewards become advantages",
    "grpo.kl_estimator": "the KL estimator",
    "ppo.kl_coef": "PPO's KL penalty weight",
    "ppo.epochs": "PPO's epochs over each rollout batch",
    "ppo.value_lr": "the critic's learning rate",
    "ppo.entropy_coef": "the entropy bonus weight",
    "ppo.vf_clip": "the clip range of the value update",
    "ppo.lam": "GAE's lambda",
    "ppo.gamma": "the discount",
    "dpo.beta": "the DPO temperature beta",
    "dpo.loss_type": "the preference loss",
    "dpo.sft_weight": "the weight of the chosen answer's NLL added to the preference loss",
    "data.max_seq_length": "the tokens of one training sequence",
    "data.template": "how a prompt and completion become one sequence",
    "data.text_field": "the column that holds raw text",
    "data.path": "the training data",
    "data.subset": "a hub dataset's configuration",
    "data.split": "the split trained on",
    "peft.r": "the adapter rank",
    "peft.alpha": "the adapter alpha",
    "peft.dropout": "the adapter dropout",
    "peft.target_modules": "the modules adapted",
    "peft.method": "full fine-tuning, LoRA or DoRA",
    "model.name": "the model to train",
    "model.dtype": "the training dtype",
    "model.quantization": "the quantized base of QLoRA",
    "model.gradient_checkpointing": "gradient checkpointing",
    "model.attn_implementation": "the attention kernel",
    "distributed.zero_stage": "the DeepSpeed ZeRO stage",
    "distributed.offload_optimizer": "optimizer offload to CPU RAM",
    "distributed.num_gpus": "the GPUs per node",
    "distributed.num_nodes": "the nodes",
    "distributed.strategy": "the data-parallel engine",
    "rl_models.reward_model": "the reward model",
    "rl_models.value_model": "the PPO critic",
    "logging.report_to": "the experiment trackers",
    "logging.project": "the tracker project",
    "logging.run_name": "the run's name",
    "run_dir": "the run's directory",
    "stage": "what to train",
    "grpo.importance": "the level of the importance ratio",
    "rollout.temperature": "the sampling temperature",
    "rollout.top_p": "the nucleus sampling mass",
    "dpo.label_smoothing": "the label-flip probability of conservative DPO",
    "train.seed": "the seed",
    "model.trust_remote_code": "whether the hub's modelling code may run",
    "data.packing": "padding-free packing of SFT rows",
    "data.columns": "which data column feeds each field",
    "task.columns": "which task column feeds each field",
    "task.path": "the prompts (with task.name=dataset)",
    "task.eval_path": "the held-out prompts",
    "task.chat": "prompts through the chat template",
    "train.padding_free": "padding-free micro-batches",
}

_STEPS = "set it to epochs x rows / rows per optimizer step"
_ACCUM = ("accumulation is derived from it: set it to per_device_train_batch_size x gradient_accumulation_steps "
          "x GPUs")
_VERL_PROMPTS = ("verl counts prompts per rollout (each sampled rollout.n times) and updates in mini-batches; trainfit "
                 "samples one rollout per optimizer step of train.global_batch_size completions: set it to "
                 "ppo_mini_batch_size x rollout.n")
_WARMUP = "set it to the ratio x train.max_steps"
_LORA_TARGET = "`all` there is `all-linear` here; names are given as a list"

PEER_KEYS: tuple[PeerKey, ...] = (
    PeerKey("", "group_size", "grpo.num_generations"),
    PeerKey("", "num_samples", "grpo.num_generations"),
    # TRL: GRPOConfig, DPOConfig, SFTConfig, ModelConfig and transformers' TrainingArguments.
    PeerKey("TRL", "num_generations", "grpo.num_generations"),
    PeerKey("TRL", "per_device_train_batch_size", "train.micro_batch_size",
            "the optimizer step's batch is train.global_batch_size = micro x accumulation x GPUs, accumulation derived",
            carry="-"),
    PeerKey("TRL", "gradient_accumulation_steps", "train.global_batch_size", convert=_ACCUM),
    PeerKey("TRL", "learning_rate", "train.lr"),
    PeerKey("TRL", "max_completion_length", "rollout.max_new_tokens"),
    PeerKey("TRL", "max_prompt_length", "rollout.max_prompt_length"),
    PeerKey("TRL", "beta", "grpo.beta", "GRPOConfig's beta"),
    PeerKey("TRL", "beta", "dpo.beta", "DPOConfig's beta"),
    PeerKey("TRL", "loss_type", "grpo.loss_type", "GRPOConfig's: grpo, dr_grpo and dapo keep their names"),
    PeerKey("TRL", "loss_type", "dpo.loss_type", "DPOConfig's: sigmoid, robust, ipo and hinge keep their names",
            carry="choice:sigmoid,robust,ipo,hinge"),
    PeerKey("TRL", "epsilon", "grpo.epsilon"),
    PeerKey("TRL", "epsilon_high", "grpo.epsilon_high"),
    PeerKey("TRL", "importance_sampling_level", "grpo.importance"),
    PeerKey("TRL", "temperature", "rollout.temperature"),
    PeerKey("TRL", "label_smoothing", "dpo.label_smoothing"),
    PeerKey("TRL", "num_train_epochs", "train.max_steps", convert=_STEPS),
    PeerKey("TRL", "max_steps", "train.max_steps"),
    PeerKey("TRL", "lr_scheduler_type", "train.schedule", "trainfit has `cosine` and `constant`", carry="schedule"),
    PeerKey("TRL", "max_grad_norm", "train.grad_clip"),
    PeerKey("TRL", "weight_decay", "train.weight_decay"),
    PeerKey("TRL", "warmup_steps", "train.warmup_steps"),
    PeerKey("TRL", "adam_epsilon", "train.adam_eps"),
    PeerKey("TRL", "seed", "train.seed"),
    PeerKey("TRL", "bf16", "model.dtype", convert="bf16: true is model.dtype=bf16", carry="flag:bf16"),
    PeerKey("TRL", "gradient_checkpointing", "model.gradient_checkpointing"),
    PeerKey("TRL", "use_vllm", "rollout.engine", convert="use_vllm: true is rollout.engine=vllm", carry="flag:vllm"),
    PeerKey("TRL", "vllm_gpu_memory_utilization", "rollout.gpu_memory_utilization"),
    PeerKey("TRL", "vllm_tensor_parallel_size", "rollout.tensor_parallel_size"),
    PeerKey("TRL", "max_length", "data.max_seq_length"),
    PeerKey("TRL", "packing", "data.packing"),
    PeerKey("TRL", "dataset_text_field", "data.text_field"),
    PeerKey("TRL", "dataset_name", "data.path"),
    PeerKey("TRL", "dataset_name", "task.path", "GRPO's prompts: with task.name=dataset"),
    PeerKey("TRL", "dataset_config", "data.subset"),
    PeerKey("TRL", "dataset_train_split", "data.split"),
    PeerKey("TRL", "warmup_ratio", "train.warmup_steps", convert=_WARMUP),
    PeerKey("TRL", "rpo_alpha", "dpo.sft_weight"),
    PeerKey("TRL", "model_name_or_path", "model.name"),
    PeerKey("TRL", "torch_dtype", "model.dtype", convert="bfloat16 is bf16, float16 fp16, float32 fp32", carry="dtype"),
    PeerKey("TRL", "dtype", "model.dtype", convert="bfloat16 is bf16, float16 fp16, float32 fp32", carry="dtype"),
    PeerKey("TRL", "attn_implementation", "model.attn_implementation", carry="attn"),
    PeerKey("TRL", "trust_remote_code", "model.trust_remote_code"),
    PeerKey("TRL", "use_peft", "peft.method", convert="use_peft: true is peft.method=lora", carry="flag:lora"),
    PeerKey("TRL", "lora_r", "peft.r"),
    PeerKey("TRL", "lora_alpha", "peft.alpha"),
    PeerKey("TRL", "lora_dropout", "peft.dropout"),
    PeerKey("TRL", "lora_target_modules", "peft.target_modules", _LORA_TARGET, carry="modules"),
    PeerKey("TRL", "load_in_4bit", "model.quantization", convert="load_in_4bit: true is model.quantization=4bit",
            carry="flag:4bit"),
    PeerKey("TRL", "save_steps", "train.save_every", carry="every"),
    PeerKey("TRL", "eval_steps", "train.eval_every", carry="every"),
    PeerKey("TRL", "logging_steps", "train.log_every", carry="every"),
    PeerKey("TRL", "report_to", "logging.report_to", carry="trackers"),
    PeerKey("TRL", "output_dir", "run_dir"),
    # verl: ppo_trainer.yaml (Hydra overrides).
    PeerKey("verl", "actor_rollout_ref.rollout.n", "grpo.num_generations"),
    PeerKey("verl", "data.train_batch_size", "train.global_batch_size", convert=_VERL_PROMPTS),
    PeerKey("verl", "actor_rollout_ref.actor.ppo_mini_batch_size", "train.global_batch_size", convert=_VERL_PROMPTS),
    PeerKey("verl", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "train.micro_batch_size", carry="-"),
    PeerKey("verl", "actor_rollout_ref.actor.ppo_micro_batch_size", "train.micro_batch_size",
            convert="verl's older key counts the micro-batch over all GPUs: divide it by the GPUs"),
    PeerKey("verl", "data.train_files", "task.path", convert="a parquet file (or a list: the first) of prompts, with "
            "task.name=dataset", carry="first"),
    PeerKey("verl", "data.val_files", "task.eval_path", convert="the held-out parquet file (a list: the first)",
            carry="first"),
    PeerKey("verl", "actor_rollout_ref.rollout.temperature", "rollout.temperature"),
    PeerKey("verl", "actor_rollout_ref.rollout.top_p", "rollout.top_p"),
    PeerKey("verl", "actor_rollout_ref.rollout.gpu_memory_utilization", "rollout.gpu_memory_utilization"),
    PeerKey("verl", "actor_rollout_ref.rollout.tensor_model_parallel_size", "rollout.tensor_parallel_size"),
    PeerKey("verl", "actor_rollout_ref.rollout.name", "rollout.engine", "vllm is vllm; sglang is not offered, hf is",
            carry="engine"),
    PeerKey("verl", "algorithm.kl_ctrl.kl_coef", "ppo.kl_coef",
            "the KL penalty folded into the rewards, ppo.kl_mode=reward; GRPO's KL term in the loss, verl's "
            "actor.kl_loss_coef, is grpo.beta", carry="-"),
    PeerKey("verl", "actor_rollout_ref.actor.kl_loss_coef", "grpo.beta", carry="-"),
    PeerKey("verl", "actor_rollout_ref.actor.kl_loss_type", "grpo.kl_estimator", convert="low_var_kl is k3, mse k2, kl k1",
            carry="kl_type"),
    PeerKey("verl", "actor_rollout_ref.actor.optim.lr", "train.lr"),
    PeerKey("verl", "actor_rollout_ref.actor.optim.weight_decay", "train.weight_decay"),
    PeerKey("verl", "actor_rollout_ref.actor.grad_clip", "train.grad_clip"),
    PeerKey("verl", "critic.optim.lr", "ppo.value_lr"),
    PeerKey("verl", "actor_rollout_ref.actor.clip_ratio", "grpo.epsilon"),
    PeerKey("verl", "actor_rollout_ref.actor.clip_ratio_low", "grpo.epsilon"),
    PeerKey("verl", "actor_rollout_ref.actor.clip_ratio_high", "grpo.epsilon_high"),
    PeerKey("verl", "actor_rollout_ref.actor.entropy_coeff", "ppo.entropy_coef"),
    PeerKey("verl", "actor_rollout_ref.actor.ppo_epochs", "grpo.num_iterations",
            "verl's epochs pass over every mini-batch; grpo.num_iterations counts optimizer steps on one "
            "rollout batch, ppo.epochs for the PPO stage"),
    PeerKey("verl", "actor_rollout_ref.actor.ppo_epochs", "ppo.epochs"),
    PeerKey("verl", "actor_rollout_ref.actor.loss_agg_mode", "grpo.loss_type",
            convert="seq-mean-token-mean is grpo, seq-mean-token-sum-norm dr_grpo, token-mean dapo", carry="loss_agg"),
    PeerKey("verl", "algorithm.adv_estimator", "grpo.advantage",
            convert="grpo is group_norm, rloo rloo, reinforce_plus_plus_baseline reinforce_pp; gae is the ppo stage"),
    PeerKey("verl", "algorithm.gamma", "ppo.gamma"),
    PeerKey("verl", "algorithm.lam", "ppo.lam"),
    PeerKey("verl", "data.max_prompt_length", "rollout.max_prompt_length"),
    PeerKey("verl", "data.max_response_length", "rollout.max_new_tokens"),
    PeerKey("verl", "actor_rollout_ref.model.path", "model.name"),
    PeerKey("verl", "actor_rollout_ref.model.enable_gradient_checkpointing", "model.gradient_checkpointing"),
    PeerKey("verl", "actor_rollout_ref.model.lora_rank", "peft.r", "a rank above 0 also needs peft.method=lora", carry="-"),
    PeerKey("verl", "actor_rollout_ref.model.lora_alpha", "peft.alpha"),
    PeerKey("verl", "actor_rollout_ref.model.target_modules", "peft.target_modules", _LORA_TARGET, carry="modules"),
    PeerKey("verl", "critic.model.path", "rl_models.value_model", carry="-"),
    PeerKey("verl", "reward_model.model.path", "rl_models.reward_model"),
    PeerKey("verl", "trainer.total_training_steps", "train.max_steps"),
    PeerKey("verl", "trainer.total_epochs", "train.max_steps", convert=_STEPS),
    PeerKey("verl", "trainer.n_gpus_per_node", "distributed.num_gpus"),
    PeerKey("verl", "trainer.nnodes", "distributed.num_nodes"),
    PeerKey("verl", "trainer.save_freq", "train.save_every", carry="every"),
    PeerKey("verl", "trainer.test_freq", "train.eval_every", carry="every"),
    PeerKey("verl", "trainer.logger", "logging.report_to", convert="console is always on here; name trackers such as wandb",
            carry="trackers"),
    PeerKey("verl", "trainer.project_name", "logging.project"),
    PeerKey("verl", "trainer.experiment_name", "logging.run_name"),
    PeerKey("verl", "trainer.default_local_dir", "run_dir"),
    # OpenRLHF: openrlhf.cli.train_ppo_ray / train_dpo / train_sft flags.
    PeerKey("OpenRLHF", "n_samples_per_prompt", "grpo.num_generations", carry="-"),
    PeerKey("OpenRLHF", "rollout_batch_size", "train.global_batch_size",
            convert="OpenRLHF counts prompts per rollout, each sampled n_samples_per_prompt times; trainfit samples one "
            "rollout per optimizer step of train.global_batch_size completions, OpenRLHF's train_batch_size"),
    PeerKey("OpenRLHF", "train_batch_size", "train.global_batch_size", carry="-"),
    PeerKey("OpenRLHF", "micro_train_batch_size", "train.micro_batch_size", carry="-"),
    PeerKey("OpenRLHF", "micro_rollout_batch_size", "rollout.batch_size", "per GPU; rollout.batch_size is for "
            "rollout.engine=hf, vLLM batches by itself", carry="-"),
    PeerKey("OpenRLHF", "init_kl_coef", "grpo.beta", "with --use_kl_loss; without it the KL penalty is folded into "
            "the rewards: ppo.kl_coef with ppo.kl_mode=reward", carry="-"),
    PeerKey("OpenRLHF", "init_kl_coef", "ppo.kl_coef", "ppo.kl_mode=reward without --use_kl_loss, ppo.kl_mode=loss "
            "with it", carry="-"),
    PeerKey("OpenRLHF", "kl_estimator", "grpo.kl_estimator"),
    PeerKey("OpenRLHF", "zero_stage", "distributed.zero_stage"),
    PeerKey("OpenRLHF", "adam_offload", "distributed.offload_optimizer"),
    PeerKey("OpenRLHF", "actor_learning_rate", "train.lr"),
    PeerKey("OpenRLHF", "learning_rate", "train.lr"),
    PeerKey("OpenRLHF", "critic_learning_rate", "ppo.value_lr"),
    PeerKey("OpenRLHF", "beta", "dpo.beta"),
    PeerKey("OpenRLHF", "prompt_max_len", "rollout.max_prompt_length"),
    PeerKey("OpenRLHF", "generate_max_len", "rollout.max_new_tokens"),
    PeerKey("OpenRLHF", "max_len", "data.max_seq_length"),
    PeerKey("OpenRLHF", "max_epochs", "ppo.epochs", "GRPO's reuse of a rollout batch is grpo.num_iterations"),
    PeerKey("OpenRLHF", "max_epochs", "grpo.num_iterations", "each sample is trained on this many times"),
    PeerKey("OpenRLHF", "num_episodes", "train.max_steps", convert=_STEPS),
    PeerKey("OpenRLHF", "eps_clip", "grpo.epsilon"),
    PeerKey("OpenRLHF", "eps_clip_low_high", "grpo.epsilon", convert="its two values are grpo.epsilon and "
            "grpo.epsilon_high", carry="pair:grpo.epsilon_high"),
    PeerKey("OpenRLHF", "value_clip", "ppo.vf_clip"),
    PeerKey("OpenRLHF", "gamma", "ppo.gamma"),
    PeerKey("OpenRLHF", "lambd", "ppo.lam"),
    PeerKey("OpenRLHF", "entropy_loss_coef", "ppo.entropy_coef"),
    PeerKey("OpenRLHF", "temperature", "rollout.temperature"),
    PeerKey("OpenRLHF", "advantage_estimator", "grpo.advantage",
            convert="group_norm is group_norm, rloo rloo, reinforce_baseline reinforce_pp, reinforce reinforce_pp_batch; "
            "gae is the ppo stage", carry="advantage"),
    PeerKey("OpenRLHF", "pretrain", "model.name"),
    PeerKey("OpenRLHF", "reward_pretrain", "rl_models.reward_model"),
    PeerKey("OpenRLHF", "critic_pretrain", "rl_models.value_model"),
    PeerKey("OpenRLHF", "lora_rank", "peft.r", "a rank above 0 also needs peft.method=lora", carry="-"),
    PeerKey("OpenRLHF", "lora_alpha", "peft.alpha"),
    PeerKey("OpenRLHF", "bf16", "model.dtype", convert="--bf16 is model.dtype=bf16", carry="flag:bf16"),
    PeerKey("OpenRLHF", "param_dtype", "model.dtype", carry="dtype"),
    PeerKey("OpenRLHF", "gradient_checkpointing", "model.gradient_checkpointing"),
    PeerKey("OpenRLHF", "attn_implementation", "model.attn_implementation", carry="attn"),
    PeerKey("OpenRLHF", "flash_attn", "model.attn_implementation", convert="is model.attn_implementation=flash_attention_2",
            carry="flag:flash_attention_2"),
    PeerKey("OpenRLHF", "dataset", "data.path", carry="first"),
    PeerKey("OpenRLHF", "prompt_data", "task.path", "with task.name=dataset", carry="first"),
    PeerKey("OpenRLHF", "input_key", "task.columns", convert="--input_key K is task.columns={prompt: K}",
            carry="column:prompt"),
    PeerKey("OpenRLHF", "input_key", "data.columns", convert="--input_key K is data.columns={prompt: K}",
            carry="column:prompt"),
    PeerKey("OpenRLHF", "output_key", "data.columns", convert="--output_key K is data.columns={completion: K}",
            carry="column:completion"),
    PeerKey("OpenRLHF", "label_key", "task.columns", convert="--label_key K is task.columns={answer: K}",
            carry="column:answer"),
    PeerKey("OpenRLHF", "chosen_key", "data.columns", convert="--chosen_key K is data.columns={chosen: K}",
            carry="column:chosen"),
    PeerKey("OpenRLHF", "rejected_key", "data.columns", convert="--rejected_key K is data.columns={rejected: K}",
            carry="column:rejected"),
    PeerKey("OpenRLHF", "apply_chat_template", "task.chat"),
    PeerKey("OpenRLHF", "apply_chat_template", "data.template", convert="--apply_chat_template is data.template=chat",
            carry="flag:chat"),
    PeerKey("OpenRLHF", "packing_samples", "data.packing"),
    PeerKey("OpenRLHF", "packing_samples", "train.padding_free", convert="--packing_samples is train.padding_free=on",
            carry="flag:on"),
    PeerKey("OpenRLHF", "vllm_gpu_memory_utilization", "rollout.gpu_memory_utilization"),
    PeerKey("OpenRLHF", "vllm_tensor_parallel_size", "rollout.tensor_parallel_size"),
    PeerKey("OpenRLHF", "vllm_enable_sleep", "rollout.sleep_level", convert="a sleeping engine is rollout.sleep_level=1 or 2",
            carry="flag:1"),
    PeerKey("OpenRLHF", "l2", "train.weight_decay"),
    PeerKey("OpenRLHF", "lr_warmup_ratio", "train.warmup_steps", convert=_WARMUP),
    PeerKey("OpenRLHF", "max_norm", "train.grad_clip"),
    PeerKey("OpenRLHF", "save_steps", "train.save_every", carry="every"),
    PeerKey("OpenRLHF", "eval_steps", "train.eval_every", carry="every"),
    PeerKey("OpenRLHF", "logging_steps", "train.log_every", carry="every"),
    PeerKey("OpenRLHF", "use_tensorboard", "logging.report_to", convert="--use_tensorboard DIR is "
            "logging.report_to=[tensorboard] (its files go to the stage dir)", carry="flag:[tensorboard]"),
    PeerKey("OpenRLHF", "save_path", "run_dir", "the final model goes to run_dir"),
    # LLaMA-Factory: its YAML (model, method, dataset, output and train arguments).
    PeerKey("LLaMA-Factory", "stage", "stage", convert="pt is pretrain; sft, rm, dpo and ppo keep their names; kto is "
            "dpo with dpo.loss_type=kto", carry="-"),
    PeerKey("LLaMA-Factory", "cutoff_len", "data.max_seq_length"),
    PeerKey("LLaMA-Factory", "lora_rank", "peft.r"),
    PeerKey("LLaMA-Factory", "lora_alpha", "peft.alpha"),
    PeerKey("LLaMA-Factory", "lora_dropout", "peft.dropout"),
    PeerKey("LLaMA-Factory", "lora_target", "peft.target_modules", _LORA_TARGET, carry="modules"),
    PeerKey("LLaMA-Factory", "finetuning_type", "peft.method",
            convert="full is peft.method=none, lora is lora; freeze is not offered", carry="map:full=none,lora=lora"),
    PeerKey("LLaMA-Factory", "pref_beta", "dpo.beta"),
    PeerKey("LLaMA-Factory", "pref_loss", "dpo.loss_type", "sigmoid, hinge, ipo, orpo and simpo keep their names",
            carry="choice:sigmoid,hinge,ipo,orpo,simpo"),
    PeerKey("LLaMA-Factory", "pref_ftx", "dpo.sft_weight"),
    PeerKey("LLaMA-Factory", "quantization_bit", "model.quantization", convert="4 is 4bit, 8 is 8bit, with bitsandbytes",
            carry="map:4=4bit,8=8bit"),
    PeerKey("LLaMA-Factory", "model_name_or_path", "model.name"),
    PeerKey("LLaMA-Factory", "trust_remote_code", "model.trust_remote_code"),
    PeerKey("LLaMA-Factory", "gradient_checkpointing", "model.gradient_checkpointing"),
    PeerKey("LLaMA-Factory", "template", "data.template",
            convert="LLaMA-Factory names a chat format; here `chat` uses the tokenizer's own chat template",
            carry="always:chat"),
    PeerKey("LLaMA-Factory", "dataset", "data.path",
            convert="a dataset_info.json name there; here a file, folder or hub dataset id", carry="lf_dataset"),
    PeerKey("LLaMA-Factory", "per_device_train_batch_size", "train.micro_batch_size",
            "the optimizer step's batch is train.global_batch_size = micro x accumulation x GPUs, accumulation derived",
            carry="-"),
    PeerKey("LLaMA-Factory", "gradient_accumulation_steps", "train.global_batch_size", convert=_ACCUM),
    PeerKey("LLaMA-Factory", "learning_rate", "train.lr"),
    PeerKey("LLaMA-Factory", "num_train_epochs", "train.max_steps", convert=_STEPS),
    PeerKey("LLaMA-Factory", "max_steps", "train.max_steps"),
    PeerKey("LLaMA-Factory", "warmup_ratio", "train.warmup_steps", convert=_WARMUP),
    PeerKey("LLaMA-Factory", "warmup_steps", "train.warmup_steps"),
    PeerKey("LLaMA-Factory", "lr_scheduler_type", "train.schedule", "trainfit has `cosine` and `constant`",
            carry="schedule"),
    PeerKey("LLaMA-Factory", "weight_decay", "train.weight_decay"),
    PeerKey("LLaMA-Factory", "max_grad_norm", "train.grad_clip"),
    PeerKey("LLaMA-Factory", "bf16", "model.dtype", convert="bf16: true is model.dtype=bf16", carry="flag:bf16"),
    PeerKey("LLaMA-Factory", "deepspeed", "distributed.zero_stage",
            convert="trainfit writes the DeepSpeed JSON itself: set distributed.strategy=deepspeed and the stage",
            carry="ds_json"),
    PeerKey("LLaMA-Factory", "save_steps", "train.save_every", carry="every"),
    PeerKey("LLaMA-Factory", "eval_steps", "train.eval_every", carry="every"),
    PeerKey("LLaMA-Factory", "logging_steps", "train.log_every", carry="every"),
    PeerKey("LLaMA-Factory", "report_to", "logging.report_to", carry="trackers"),
    PeerKey("LLaMA-Factory", "seed", "train.seed"),
    PeerKey("LLaMA-Factory", "output_dir", "run_dir"),
)


def _score(parts: list[str], peer: list[str]) -> int:
    """How many trailing parts of the user's key spell the end of the peer key (0 = no match). The user's
    first part may be a trainfit section the peer does not have (train.per_device_train_batch_size)."""
    n = 0
    while n < min(len(parts), len(peer)) and parts[-1 - n] == peer[-1 - n]:
        n += 1
    if n == 0 or (n < len(peer) and n < len(parts) - 1):  # the user's key goes on with other words
        return 0
    return n if len(peer[-1]) > 2 or n >= 2 else 0       # `n`, `lr`: only with their parent


def matches(dotted: str) -> list[PeerKey]:
    """The rows an unknown key spells: those with the longest match; among rows pointing to different
    trainfit keys, those in the section the user wrote it in when there are some."""
    parts = dotted.split(".")
    scored = [(s, r) for r in PEER_KEYS if (s := _score(parts, r.key.split(".")))]
    if not scored:
        return []
    best = max(s for s, _ in scored)
    rows = [r for s, r in scored if s == best]
    same_section = [r for r in rows if r.trainfit.split(".")[0] == parts[0]]
    return same_section or rows


def answer(dotted: str, value: Any) -> Optional[str]:
    """The sentence for an unknown key that means a trainfit key, or None: who writes it, what trainfit
    calls it, and the override to write (with the user's value when it carries over as is). A section of a
    peer's config (verl's `actor_rollout_ref: {rollout: {n: 8}}`) is answered key by key."""
    if isinstance(value, dict):
        said = [f"{k} {c}" for k, v in _leaves(value, dotted) if (c := _clause(k, v))]
        return f"Unknown config key {dotted!r} holds keys of another tool: {'; '.join(said)}." if said else None
    c = _clause(dotted, value)
    return None if c is None else f"Unknown config key {dotted!r}{c if c.startswith(':') else ' ' + c}."


def _clause(dotted: str, value: Any) -> Optional[str]:
    """`is verl's actor_rollout_ref.rollout.n; trainfit calls ... grpo.num_generations: write ...`."""
    rows = matches(dotted)
    if not rows:
        return None
    by_key: dict[str, list[str]] = {}
    for r in rows:
        if r.peer and r.peer not in by_key.setdefault(r.key, []):
            by_key[r.key].append(r.peer)
    peers = [" and ".join(f"{p}'s" for p in ps) + f" {k}" for k, ps in by_key.items() if ps]
    fixes = []
    for t in dict.fromkeys(r.trainfit for r in rows):
        row = next(r for r in rows if r.trainfit == t)
        fix = row.convert or f"write {t}={_show(value)}" + (f" ({row.note})" if row.note else "")
        fixes.append(f"trainfit calls {WHAT[t]} {t}: {fix}")
    return (f"is {', or '.join(peers)}; " if peers else ": ") + "; or ".join(fixes)


def _leaves(d: dict, prefix: str) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for k, v in d.items():
        out += _leaves(v, f"{prefix}.{k}") if isinstance(v, dict) else [(f"{prefix}.{k}", v)]
    return out


def _show(value: Any) -> str:
    return "VALUE" if isinstance(value, (dict, list)) or value == "<missing>" else str(value)
