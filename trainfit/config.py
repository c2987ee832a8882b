"""The one typed config of trainfit: the schema, its cross-field rules, and derived batch arithmetic.

Every field is documented once, here. Cross-field rules live in `cross_field_errors`; derived
numbers (accumulation, prompts per step) live in `BatchPlan`, computed and never asked for twice.
Reading YAML and overrides is config_io.py (re-exported below, so `trainfit.config.load_config` works).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from trainfit.stage_specs import DPO_REFERENCE_FREE, stage_spec


class ConfigError(Exception):
    """A user mistake in a config: the CLI prints the message as one paragraph and exits 2."""


class _Section(BaseModel):
    # Unknown keys are errors (typos must not pass silently); defaults are validated too.
    model_config = ConfigDict(extra="forbid", validate_default=True, protected_namespaces=())


class ModelConfig(_Section):
    name: str = Field("preset:tiny", description=(
        "What to load: a Hugging Face hub id, a local directory (full model or PEFT adapter), a .gguf "
        "file, or a built-in random-init preset `preset:tiny` / `preset:small` (no download)."))
    gguf_file: Optional[str] = Field(None, description="GGUF file name inside `name` when `name` is a hub id or directory.")
    revision: Optional[str] = Field(None, description="Hub revision (branch, tag or commit).")
    trust_remote_code: bool = Field(False, description="Allow custom modelling code from the hub.")
    dtype: Literal["fp32", "bf16", "fp16"] = Field("fp32", description="Dtype of the weights being trained (and of frozen ones).")
    gradient_checkpointing: Union[bool, int, float] = Field(False, description=(
        "Recompute activations in backward to save memory: `true` = every decoder layer, `false` or 0 = "
        "none, an integer k = the first k decoder layers (more than the model has = all), a fraction "
        "0 < f < 1 = the first ceil(f x layers). Fewer checkpointed layers recompute less (faster) and "
        "keep more activations (like DeepSpeed's `number_checkpoints`); `trainfit fit` searches it."))
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flash_attention_3"] = Field(
        "sdpa", description="Attention kernel passed to transformers.")
    quantization: Literal["none", "4bit", "8bit"] = Field("none", description=(
        "Quantize the frozen base with bitsandbytes (QLoRA). Needs `peft.method` lora/dora and the `bnb` extra."))
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit data type.")
    bnb_4bit_double_quant: bool = Field(True, description="Quantize the 4-bit absmax constants too (saves ~0.4 bit/param).")
    seed: int = Field(0, description="Seed for random-init presets and `init: random`.")
    init: Literal["pretrained", "random"] = Field("pretrained", description=(
        "`pretrained` loads the weights of `name`; `random` builds its architecture (a catalog name such as "
        "qwen3-0.6b, a hub id, or a local directory with config.json) with random weights, for pretraining "
        "from scratch. Presets are always random."))
    config_overrides: dict[str, Any] = Field(default_factory=dict, description=(
        "Architecture numbers changed before the model is built, by the trainer and the planner alike, e.g. "
        "{num_hidden_layers: 4, hidden_size: 256} or Mamba's {state_size: 16, expand: 2} (mamba_ssm names "
        "d_state, d_conv, d_model, n_layer are accepted). Keys must exist in the architecture's config "
        "(nested dicts for sub-configs such as text_config). Needs `init: random` or a preset."))
    tokenizer: Optional[str] = Field(None, description=(
        "Tokenizer to use instead of the model's: a hub id or local directory, or `preset` (trainfit's local "
        "512-token tokenizer, no download). Default: the model's own; with `init: random` the tokenizer of "
        "the named model (local directory, hub cache or network), else an error naming this key. The "
        "embedding keeps the architecture's vocab_size: set config_overrides.vocab_size to match a smaller "
        "tokenizer."))
    freeze_vision_tower: bool = Field(True, description=(
        "Vision-language models: keep the vision encoder's weights fixed (no gradients, no optimizer state, "
        "no LoRA adapters on it). The projector is governed by `freeze_projector`."))
    freeze_projector: bool = Field(True, description=(
        "Vision-language models: keep the projector that maps vision features into the language model "
        "(Qwen-VL's patch merger and DeepStack mergers, LLaVA's multi_modal_projector) fixed."))
    max_pixels: Optional[int] = Field(None, ge=1, description=(
        "Vision-language models: largest image area in pixels after resizing (Qwen-VL's max_pixels); bounds "
        "the image tokens per image (one token per (patch x merge)^2 pixels, e.g. 28 x 28 for Qwen2.5-VL). "
        "None = the processor's own setting."))
    min_pixels: Optional[int] = Field(None, ge=1, description=(
        "Vision-language models: smallest image area in pixels after resizing (Qwen-VL's min_pixels). None = "
        "the processor's own setting."))

    @model_validator(mode="after")
    def _checkpointing(self) -> "ModelConfig":
        g = self.gradient_checkpointing
        if isinstance(g, bool):
            return self
        if isinstance(g, int) and g < 0:
            raise ValueError(f"model.gradient_checkpointing={g}: a layer count must be >= 0 (0 = none, true = all).")
        if isinstance(g, float) and not 0.0 < g < 1.0:
            raise ValueError(f"model.gradient_checkpointing={g}: a fraction of the layers must lie strictly between "
                             "0 and 1; write true for all layers, false for none, or an integer layer count.")
        return self

    def checkpointed_layers(self, n_layers: int) -> int:
        """How many of the model's `n_layers` decoder layers are checkpointed (the first ones, see
        models.enable_checkpointing). One rule for the trainer, the planner and `fit`."""
        g = self.gradient_checkpointing
        if isinstance(g, bool):
            return n_layers if g else 0
        if isinstance(g, float):  # round() first: 0.3 x 10 is 3.0000000000000004 in floats
            return min(n_layers, math.ceil(round(g * n_layers, 6)))
        return min(n_layers, g)


class PeftConfig(_Section):
    method: Literal["none", "lora", "dora"] = Field("none", description="Full fine-tuning, LoRA, or DoRA adapters (peft).")
    r: int = Field(16, ge=1, description="Adapter rank.")
    alpha: float = Field(32.0, gt=0, description="Adapter scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter input.")
    target_modules: Union[Literal["all-linear"], list[str]] = Field(
        "all-linear", description="Module names to adapt; `all-linear` = every linear layer except the LM head.")
    adapter_compute: Literal["model", "fp32"] = Field("model", description=(
        "What LoRA's matmuls compute in on a bf16 base (peft keeps the adapter weights fp32 either way, so "
        "their gradients and optimizer state stay fp32). `model`: bf16, each adapter weight cast for its "
        "matmul as torch autocast does, so backward keeps the bf16 layer inputs it already has (~30% less "
        "activation memory on Qwen2.5-0.5B). `fp32`: peft's own behaviour, which casts every adapted layer's "
        "input to fp32 and keeps that copy for backward. Unused for DoRA, k-bit bases and fp32/fp16 models."))


# Where a data.path / task.path dataset is read from besides the path itself (trainfit/sources/): one
# description for both sections.
_SUBSET = ("Configuration (subset) of a hub dataset or dataset folder, e.g. `main` for openai/gsm8k; none = its "
           "only one.")
_SPLIT = "Split of `path` to train on; none = `train`, or the only split."
_EVAL_SPLIT = ("Split held out for evaluation, read from `eval_path` when it is set, else from `path` (e.g. `test`); "
               "none = `eval_path`'s train or only split, or a share of `path`.")
_REVISION = "Hub revision (branch, tag or commit) of a hub dataset in `path` / `eval_path`."
_COLUMNS = ("Which column feeds each field trainfit reads, e.g. {prompt: question, answer: answer}; dotted names "
            "reach into nested columns (reward_model.ground_truth). Fields: text; prompt, completion, messages "
            "(sft); prompt or messages, chosen, rejected (rm); prompt or messages, answer, completion (tasks). "
            "Unmapped fields are found by name, and common shapes need no mapping (TRL's prompt/completion, "
            "messages, chosen/rejected; verl's parquet rows; alpaca; sharegpt): the run's start says what fed what.")


class DataConfig(_Section):
    path: Optional[str] = Field(None, description=(
        "Training data for pretrain/sft/rm: a file (.txt, .jsonl, .json, .parquet, .arrow, .csv, .tsv), a "
        "directory of them, a glob, a `save_to_disk` dataset folder, or a Hugging Face hub dataset id "
        "(org/name; read with `datasets`, through the HF cache, HF_HUB_OFFLINE and HF_TOKEN). Unused when "
        "`task` gives the data."))
    subset: Optional[str] = Field(None, description=_SUBSET)
    split: Optional[str] = Field(None, description=_SPLIT)
    revision: Optional[str] = Field(None, description=_REVISION)
    columns: dict[str, str] = Field(default_factory=dict, description=_COLUMNS)
    streaming: bool = Field(False, description=(
        "pretrain: read `path` as a stream (a datasets IterableDataset) instead of loading it whole: text is "
        "tokenized and packed as the run goes, in file order, and checkpoints keep the stream's position, so "
        "a resumed run continues with the same next batch. Eval loss needs `eval_path` or `eval_split`."))
    format: Literal["auto", "text", "prompt_completion", "messages"] = Field("auto", description=(
        "`text` (raw text or JSONL `text` field), `prompt_completion` (JSONL prompt/completion) or "
        "`messages` (JSONL chat); `auto` decides from the first record."))
    text_field: str = Field("text", description="Field (column) that holds raw text for pretraining; `columns.text` overrides it.")
    max_seq_length: int = Field(512, ge=8, description="Tokens per training sequence (pretrain packs into blocks of this size).")
    eval_path: Optional[str] = Field(None, description="Held-out data for eval loss; else `eval_fraction` of `path`.")
    eval_split: Optional[str] = Field(None, description=_EVAL_SPLIT)
    eval_fraction: float = Field(0.05, ge=0.0, lt=1.0, description="Share of records held out when no `eval_path` or `eval_split`.")
    packing: bool = Field(False, description=(
        "sft: padding-free packing. Each micro-batch's sequences go back to back in one row, position ids "
        "restarting per sequence, and the attention keeps them apart (flash-attention varlen on CUDA, a "
        "block-diagonal mask with sdpa / eager): the same loss and gradients, no compute on padding."))


class TaskConfig(_Section):
    name: Optional[str] = Field(None, description=(
        "Built-in task (`arithmetic`, `arithmetic_tagged`; `shapes`, images for vision-language models), "
        "`jsonl` (rows with `prompt` or `messages`, `answer`, and any metadata), or `dataset` (the same rows "
        "from any source task.path reads; its `default` reward and accuracy check mathematical answers with "
        "math_verify). Gives SFT examples and GRPO prompts with rewards."))
    path: Optional[str] = Field(None, description=(
        "Rows for `name: jsonl` / `dataset`: a JSONL file, or anything data.path reads (parquet, a dataset "
        "folder, a hub id such as openai/gsm8k, ...)."))
    subset: Optional[str] = Field(None, description=_SUBSET)
    split: Optional[str] = Field(None, description=_SPLIT)
    revision: Optional[str] = Field(None, description=_REVISION)
    columns: dict[str, str] = Field(default_factory=dict, description=_COLUMNS)
    answer_pattern: Optional[str] = Field(None, description=(
        "A regex that finds the answer inside the answer column, for answers that carry their reasoning, e.g. "
        "'####\\s*(.+)' for GSM8K: its first group (or the whole match) is the answer, and the whole column "
        "stays the SFT target. A row it does not match is an error."))
    eval_path: Optional[str] = Field(None, description="Held-out rows for `name: jsonl` / `dataset` (else rows are split).")
    eval_split: Optional[str] = Field(None, description=_EVAL_SPLIT)
    seed: int = Field(1234, description="Seed of the generated task stream (eval uses a disjoint stream).")
    num_eval: int = Field(200, ge=0, description="Held-out examples for accuracy.")
    max_operand: int = Field(20, ge=1, description="Arithmetic: largest operand.")
    num_operands: int = Field(2, ge=2, le=4, description="Arithmetic: operands per expression.")
    operations: str = Field("+-", description="Arithmetic: operators to draw from (subset of '+-*').")
    chat: bool = Field(False, description="Present prompts through the tokenizer's chat template.")
    rewards: list[str] = Field(default_factory=lambda: ["default"], description=(
        "Reward functions for GRPO: `default` (the task's own), built-ins `exact_match`, `numeric_match`, "
        "`format`, `math_verify` (Hugging Face's Math-Verify: LaTeX and plain answers, `pip install "
        "'trainfit[math]'`), or a user function `module:function` / `path/to/file.py:function`."))
    reward_weights: Optional[list[float]] = Field(None, description="One weight per reward (default all 1).")


class TrainConfig(_Section):
    global_batch_size: int = Field(32, ge=1, description=(
        "Samples per optimizer step across all devices. For GRPO a sample is one completion."))
    micro_batch_size: int = Field(8, ge=1, description="Samples per forward pass on one device; accumulation is derived.")
    max_steps: int = Field(100, ge=0, description="Optimizer steps to run.")
    lr: float = Field(1e-4, gt=0, description="Peak learning rate.")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="Cosine floor as a fraction of `lr`.")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps.")
    schedule: Literal["cosine", "constant"] = Field("cosine", description="LR schedule after warmup.")
    weight_decay: float = Field(0.0, ge=0.0, description="AdamW decoupled weight decay.")
    adam_beta1: float = Field(0.9, ge=0.0, lt=1.0, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, ge=0.0, lt=1.0, description="AdamW beta2.")
    adam_eps: float = Field(1e-8, gt=0.0, description="AdamW epsilon.")
    optimizer: Literal["adamw", "adamw_8bit", "paged_adamw_8bit"] = Field("adamw", description="Optimizer (8-bit ones need `bnb`).")
    logits_chunk_rows: int = Field(0, ge=0, description=(
        "Compute log-probs over this many token rows at a time, so no full fp32 copy of the [tokens, "
        "vocab] logits is kept for backward (0 = all rows at once)."))
    fused_head: Literal["auto", "off", "chunked", "liger"] = Field("auto", description=(
        "The LM head fused with the log-probs (sft, pretrain, grpo), so no [tokens, vocab] logits or their "
        "gradient are kept: `chunked` = head and log-softmax over logits_chunk_rows rows at a time (256 when "
        "0), recomputed in backward (any device, one more head matmul); `liger` = Liger's fused linear "
        "cross-entropy (CUDA, `pip install 'trainfit[liger]'`); `off` = the model's own head; `auto` = liger "
        "on CUDA when it is installed and the model allows it, else off. Not for heads that are LoRA-adapted "
        "or quantized, models that change logits after the head (softcapping, logit scales), FSDP or ZeRO-3."))
    grad_clip: float = Field(1.0, ge=0.0, description="Max global gradient norm (0 disables).")
    compile: bool = Field(False, description=(
        "torch.compile the policy's decoder layers (one graph shared by all layers) for the forward and "
        "backward of training, checkpoint recomputes included; no-grad forwards (rollout decoding, scoring, "
        "evaluation) stay eager. The first steps pay the compilation (seconds on GPU, minutes on a small CPU)."))
    seed: int = Field(0, description="Seed of data order, sampling and init of adapters.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="`auto` = CUDA when available.")
    cpu_threads: Union[Literal["auto"], int] = Field("auto", description=(
        "torch threads per process when training on CPU, said at each stage's start (`CPU threads: ...`). "
        "`auto`: OMP_NUM_THREADS when you set it, else 1 for a model under 100M parameters (a second thread "
        "waits at every op's barrier and stalls whenever another job holds a core: 1.5-14x slower from 0.16M to "
        "104M parameters on a shared 2-core machine, bench/results/cpu_threads.json), else the cores this "
        "process may use (affinity mask, cgroup CPU quota) divided among the ranks on this node. An integer is "
        "used as it is, over OMP_NUM_THREADS (more threads may pay off on an idle many-core machine). GPU runs "
        "keep torch's default."))
    eval_every: int = Field(0, ge=0, description="Evaluate every N steps (0 = only before and after).")
    save_every: int = Field(0, ge=0, description="Checkpoint every N steps (0 = only the final model).")
    keep_checkpoints: int = Field(2, ge=1, description="Most recent checkpoints kept on disk.")
    log_every: int = Field(1, ge=1, description="Write metrics every N steps.")

    @field_validator("cpu_threads")
    @classmethod
    def _threads_positive(cls, v: Any) -> Any:
        if v != "auto" and v < 1:
            raise ValueError(f"train.cpu_threads={v}: use `auto` (chosen from the cores and the model size) or a "
                             "thread count of at least 1, e.g. train.cpu_threads=1.")
        return v

    @field_validator("fused_head", mode="before")
    @classmethod
    def _fused_head_off(cls, v: Any) -> Any:
        return "off" if v is False else v   # YAML reads a bare `off` as false


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
        "of the base. None = true with peft and no rl_models.value_model; false = a separate critic base."))


# Rollout engines and environments (sections of this schema, in their own file for length).
from trainfit.config_rollout import EnvConfig, RolloutConfig  # noqa: E402
from trainfit.config_dpo import DPOConfig  # noqa: E402


TRACKERS = ("tensorboard", "wandb", "trackio", "mlflow")


class LoggingConfig(_Section):
    report_to: list[Literal["tensorboard", "wandb", "trackio", "mlflow"]] = Field(["tensorboard"], description=(
        "Experiment trackers every metric goes to besides metrics.jsonl: tensorboard (event files in the "
        "stage dir), wandb, trackio, mlflow (each `pip install 'trainfit[NAME]'`; configured by their own "
        "environment variables, e.g. WANDB_MODE=offline, TRACKIO_DIR, MLFLOW_TRACKING_URI). A list, one "
        "name, a comma-separated string, or none / [] for no tracker. The older `logging.tensorboard: "
        "true/false` is still read: it adds or removes tensorboard here."))
    project: str = Field("trainfit", description="Project (wandb, trackio) or experiment (mlflow) the runs go to.")
    run_name: Optional[str] = Field(None, description=(
        "Run name in the trackers; default the run dir's name, plus the stage folder (0-sft) in a pipeline."))
    progress: bool = Field(True, description="Show the rich progress bar (off when stdout is not a terminal is fine too).")
    plot: bool = Field(True, description="Write metrics.png (loss, reward, accuracy against step) at the end.")
    save_completions: int = Field(4, ge=0, description="Completions per step written to completions.jsonl (GRPO).")
    save_transcripts: int = Field(16, ge=0, description=(
        "Episodes per step written to transcripts.jsonl (multi-turn GRPO with an `env`): every message, "
        "the tokens' roles, rewards, and failures."))

    @model_validator(mode="before")
    @classmethod
    def _report_to(cls, raw: Any) -> Any:
        """Normalise report_to ("none", "wandb", "wandb,mlflow" -> lists) and fold the legacy
        `tensorboard: bool` into it, so whether TensorBoard runs is asked in one place."""
        if not isinstance(raw, dict):
            return raw
        raw = dict(raw)
        given = "report_to" in raw
        rt = raw.get("report_to", ["tensorboard"])
        if rt is None:
            rt = []
        if isinstance(rt, str):
            rt = [p.strip() for p in rt.split(",") if p.strip()]
        if isinstance(rt, (list, tuple)):
            rt = [str(x).strip().lower() for x in rt]
            if "none" in rt:
                if len(rt) > 1:
                    raise ValueError(f"logging.report_to={rt} mixes 'none' with trackers; write none (or []) "
                                     "for no tracker, or list only the trackers.")
                rt = []
            rt = list(dict.fromkeys(rt))  # drop repeats, keep the order
            bad = [t for t in rt if t not in TRACKERS]
            if bad:
                raise ValueError(f"logging.report_to={rt}: unknown tracker {bad[0]!r}; choose from "
                                 f"{', '.join(TRACKERS)}, or none.")
        if "tensorboard" in raw:
            tb = raw.pop("tensorboard")
            if not isinstance(tb, bool):
                raise ValueError(f"logging.tensorboard={tb!r} must be true or false (or use logging.report_to).")
            if isinstance(rt, list) and tb != ("tensorboard" in rt):
                if given:
                    raise ValueError(
                        f"logging.tensorboard={str(tb).lower()} contradicts logging.report_to={rt}: the older "
                        "switch and the list both say whether TensorBoard runs. Remove logging.tensorboard and "
                        "list tensorboard in logging.report_to or leave it out, or make the switch agree "
                        f"(logging.tensorboard={str(not tb).lower()}).")
                rt = rt + ["tensorboard"] if tb else [t for t in rt if t != "tensorboard"]
        raw["report_to"] = rt
        return raw

    @property
    def tensorboard(self) -> bool:
        """Derived: TensorBoard event files are written when report_to lists tensorboard."""
        return "tensorboard" in self.report_to


class DistributedConfig(_Section):
    strategy: Literal["auto", "ddp", "fsdp", "deepspeed"] = Field("auto", description="Data-parallel engine.")
    zero_stage: int = Field(0, ge=0, le=3, description="DeepSpeed ZeRO stage (0-3).")
    offload_optimizer: bool = Field(False, description="Keep optimizer state in CPU RAM.")
    offload_params: bool = Field(False, description="Keep parameters in CPU RAM (ZeRO-3).")
    num_gpus: int = Field(1, ge=1, description=(
        "Processes per node: one per GPU (or CPU processes with gloo when train.device=cpu). More than one "
        "in total makes `trainfit train` re-launch itself under torchrun."))
    num_nodes: int = Field(1, ge=1, description="Nodes.")
    node_rank: int = Field(0, ge=0, description="This node's index (0 = the node with master_addr).")
    master_addr: str = Field("127.0.0.1", description="Address of node 0 for the rendezvous.")
    master_port: Union[int, Literal["auto"]] = Field("auto", description=(
        "Rendezvous port; `auto` uses $MASTER_PORT (torchrun's variable; default 29500) when free, else any "
        "free port (single node)."))
    timeout_s: int = Field(600, ge=10, description="Seconds to wait for every rank to join (and for collectives).")
    base_global_batch_size: Optional[int] = Field(None, ge=1, description=(
        "Global batch at which train.lr was tuned; with lr_scaling the trainer rescales the lr when "
        "train.global_batch_size differs (and doctor warns when it differs without scaling)."))
    lr_scaling: Literal["none", "linear", "sqrt"] = Field("none", description=(
        "Rescale train.lr by G/B (linear) or sqrt(G/B) (sqrt, usual for Adam), G = global batch, "
        "B = base_global_batch_size."))


class HardwareConfig(_Section):
    gpu: Optional[str] = Field(None, description="GPU to plan for when none is detected (e.g. h100-80gb, h200).")
    memory_margin: float = Field(0.10, ge=0.0, lt=1.0, description="Share of the card kept free for fragmentation.")


class RLModelsConfig(_Section):
    reward_model: Optional[str] = Field(None, description=(
        "Reward model (sequence classifier) id or dir; none = reward functions. In a pipeline, `stage:rm` = "
        "the final dir of the rm stage before this one."))
    reward_dtype: Literal["fp32", "bf16", "fp16"] = Field("bf16", description="Reward model dtype (frozen).")
    value_model: Optional[str] = Field(None, description="PPO critic; default = initialised from the policy.")


StageName = Literal["pretrain", "sft", "rm", "dpo", "grpo", "ppo"]


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
        return self.distributed.num_gpus * self.distributed.num_nodes

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

    def ppo_shared_base(self) -> bool:
        """Whether PPO's critic shares the policy's frozen base (ppo.shared_base resolved)."""
        if self.ppo.shared_base is not None:
            return self.ppo.shared_base
        return self.peft.method != "none" and not self.rl_models.value_model

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
        g = cfg.grpo.num_generations if cfg.stage in ("grpo",) else 1
        per_dev = t.global_batch_size // world
        return cls(t.global_batch_size, t.micro_batch_size, world, per_dev // t.micro_batch_size,
                   per_dev, g, t.global_batch_size // g)

    def describe(self) -> str:
        s = (f"global batch {self.global_batch} = micro {self.micro_batch} x accumulation {self.accumulation}"
             f" x devices {self.world_size}")
        if self.group_size > 1:
            s += f"; {self.prompts_per_step} prompts x {self.group_size} generations per step"
        return s


class Rule(str):
    """A cross-field error message that also carries its rule's code (e.g. tf.batch_micro), so tools
    like `trainfit doctor` can tell rules apart without reading the wording."""

    code: str

    def __new__(cls, code: str, message: str) -> "Rule":
        obj = super().__new__(cls, message)
        obj.code = code
        return obj


def cross_field_errors(cfg: Config) -> list[Rule]:
    """Rules between fields, each message naming the keys, the values, the arithmetic and the fix."""
    errs: list[Rule] = []

    def add(code: str, message: str) -> None:
        errs.append(Rule(code, message))

    m = cfg.model
    if m.min_pixels is not None and m.max_pixels is not None and m.min_pixels > m.max_pixels:
        add("tf.cross_field", f"model.min_pixels={m.min_pixels} is larger than model.max_pixels={m.max_pixels}; images "
                         "are resized into [min_pixels, max_pixels]: lower min_pixels or raise max_pixels.")
    t, world = cfg.train, cfg.world_size
    gb, mb = t.global_batch_size, t.micro_batch_size
    if gb % world:
        add("tf.batch_world", f"train.global_batch_size={gb} is not divisible by the device count {world} "
                    f"(distributed.num_gpus x num_nodes); use a multiple of {world}, e.g. {_round_up(gb, world)}.")
    else:
        per_dev = gb // world
        if per_dev % mb:
            ok = [d for d in range(1, per_dev + 1) if per_dev % d == 0]
            add("tf.batch_micro", f"train.micro_batch_size={mb} does not divide the per-device batch {per_dev} "
                        f"(train.global_batch_size={gb} / {world} devices), so accumulation {per_dev}/{mb} "
                        f"is not whole; pick micro_batch_size from {ok}.")
    if cfg.stage == "grpo":
        g = cfg.grpo.num_generations
        if gb % g:
            add("tf.grpo_groups", f"train.global_batch_size={gb} is not a multiple of grpo.num_generations={g}: a GRPO "
                        f"group would be split across optimizer steps; use {_round_up(gb, g)} "
                        f"({_round_up(gb, g) // g} prompts x {g}).")
        elif (gb // world) % g and gb % world == 0:
            add("tf.grpo_groups_per_device", f"train.global_batch_size={gb} gives {gb // world} completions per device, not whole "
                        f"groups of grpo.num_generations={g}; make global_batch_size a multiple of {g * world}.")
        if cfg.task.name is None:
            add("tf.grpo_task", "stage grpo needs prompts and rewards: set task.name (arithmetic, arithmetic_tagged, or jsonl with task.path).")
    if cfg.stage == "ppo":
        if cfg.task.name is None:
            add("tf.ppo_task", "stage ppo needs prompts: set task.name (arithmetic, arithmetic_tagged, or jsonl with "
                        "task.path).")
        if not cfg.task.rewards and not cfg.rl_models.reward_model:
            add("tf.ppo_rewards", "stage ppo needs a reward: list reward functions in task.rewards, or set "
                        "rl_models.reward_model to a sequence-classifier directory (e.g. a stage rm final dir).")
        if cfg.ppo.shared_base and cfg.peft.method == "none":
            add("tf.ppo_shared_base_peft", "ppo.shared_base=true puts the critic's adapters on the policy's frozen base, "
                        "which needs adapters: set peft.method=lora or dora, or ppo.shared_base=false.")
        if cfg.ppo.shared_base and cfg.rl_models.value_model:
            add("tf.ppo_shared_base_value", f"ppo.shared_base=true with rl_models.value_model="
                        f"{cfg.rl_models.value_model!r}: a critic loaded from its own directory has its own base. "
                        "Remove rl_models.value_model (the critic starts from the policy), or set ppo.shared_base=false.")
    if stage_spec(cfg.stage).reads_pairs and cfg.data.path is None and cfg.task.name is None:
        add("tf.rm_data", f"stage {cfg.stage} trains on preference pairs: set data.path to JSONL rows with "
                    "`prompt` (or `messages`), `chosen` and `rejected`, or task.name to make pairs from a task "
                    "(its answer chosen, a wrong one rejected).")
    if cfg.stage in ("pretrain", "sft") and cfg.task.name is None and cfg.data.path is None:
        add("tf.data_missing", f"stage {cfg.stage} needs data: set data.path (a file, directory or glob) or task.name.")
    if cfg.stage in ("pretrain", "sft") and cfg.task.name is not None and cfg.data.path is not None:
        # The trainer (train/run.py, train/sft.py) trains these stages on the task's examples whenever
        # task.name is set, so data.path would be read by nobody: say so rather than ignore the file.
        add("tf.data_and_task", f"stage {cfg.stage} has both data.path={cfg.data.path!r} and task.name="
                    f"{cfg.task.name}; it would train on the task's examples and ignore data.path. To train on the "
                    "file, remove task.name (in a pipeline, give the task only to the stages that use it, e.g. "
                    "under the grpo or ppo stage in `stages:`, or set task.name: null in this stage); to train on "
                    "the task, remove data.path.")
    if cfg.data.packing and cfg.stage != "sft":
        add("tf.cross_field", f"data.packing=true applies to stage sft, not {cfg.stage}"
                    + (" (pretraining already packs text into full blocks of data.max_seq_length)"
                       if cfg.stage == "pretrain" else "") + ": set data.packing=false.")
    if cfg.stage == "pretrain" and cfg.task.name is not None and cfg.data.path is None:
        add("tf.pretrain_data", "stage pretrain trains on raw text: set data.path (tasks give SFT/GRPO examples).")
    if cfg.distributed.node_rank >= cfg.distributed.num_nodes:
        add("tf.node_rank", f"distributed.node_rank={cfg.distributed.node_rank} must be below distributed.num_nodes="
                    f"{cfg.distributed.num_nodes} (ranks count from 0).")
    if cfg.distributed.lr_scaling != "none" and not cfg.distributed.base_global_batch_size:
        add("tf.lr_scaling_base", f"distributed.lr_scaling={cfg.distributed.lr_scaling} needs distributed.base_global_batch_size, "
                    "the global batch at which train.lr was tuned.")
    if cfg.task.name in ("jsonl", "dataset") and not cfg.task.path:
        add("tf.jsonl_path", f"task.name={cfg.task.name} needs task.path, the rows with `prompt` or `messages` and "
                    "`answer` (a JSONL or parquet file, a dataset folder or a hub id).")
    if cfg.data.streaming and cfg.stage != "pretrain":
        add("tf.cross_field", f"data.streaming=true applies to stage pretrain, not {cfg.stage}: set data.streaming=false.")
    if cfg.model.quantization != "none" and cfg.peft.method == "none":
        add("tf.quantization_peft", f"model.quantization={cfg.model.quantization} freezes a quantized base, so it needs adapters: "
                    "set peft.method=lora (QLoRA) or dora, or model.quantization=none.")
    if cfg.model.init == "random" and cfg.peft.method != "none":
        add("tf.random_peft", f"model.init=random with peft.method={cfg.peft.method} would train adapters over a frozen "
                    "base of random weights, which learns nothing useful; pretrain from scratch with peft.method=none, "
                    "or load trained weights with model.init=pretrained.")
    if cfg.model.config_overrides and cfg.model.init != "random" and not cfg.model.name.startswith("preset:"):
        add("tf.overrides_pretrained", f"model.config_overrides={cfg.model.config_overrides} changes the architecture of "
                    f"{cfg.model.name!r}, whose pretrained weights would no longer match it; set model.init=random to "
                    "build the changed architecture with random weights, or remove model.config_overrides.")
    if cfg.task.reward_weights is not None and len(cfg.task.reward_weights) != len(cfg.task.rewards):
        add("tf.reward_weights", f"task.reward_weights has {len(cfg.task.reward_weights)} entries but task.rewards has "
                    f"{len(cfg.task.rewards)}; give one weight per reward.")
    fh = cfg.train.fused_head
    if fh in ("chunked", "liger"):
        sharded = cfg.engine() == "fsdp" or (cfg.engine() == "deepspeed" and cfg.distributed.zero_stage == 3)
        if sharded:
            add("tf.cross_field", f"train.fused_head={fh} applies the LM head's weight outside the model's forward, "
                        f"where {cfg.engine()} (zero_stage={cfg.distributed.zero_stage}) keeps it sharded; set "
                        "train.fused_head=off (or auto), or use distributed.strategy=ddp / deepspeed zero_stage<=2.")
        if cfg.stage in ("ppo", "rm"):
            add("tf.cross_field", f"train.fused_head={fh} applies to stages sft, pretrain, dpo and grpo, not {cfg.stage} "
                        "(" + ("PPO's policy-critic forward keeps the plain head" if cfg.stage == "ppo"
                               else "a reward model has no LM head") + "); set train.fused_head=off or auto.")
    errs += [Rule(code, msg) for code, msg in rollout_errors(cfg)]
    errs += [Rule(code, msg) for code, msg in dpo_errors(cfg)] if cfg.stage == "dpo" else []
    if not set(cfg.task.operations) <= set("+-*") or not cfg.task.operations:
        add("tf.operations", f"task.operations={cfg.task.operations!r} must be a non-empty subset of '+-*'.")
    return errs


def rollout_errors(cfg: Config) -> list[tuple[str, str]]:
    """Rules between the rollout engine, the environment and the rest of the config."""
    out: list[tuple[str, str]] = []
    r, e = cfg.rollout, cfg.env
    if r.engine == "openai" and not r.base_url:
        out.append(("tf.openai_url", "rollout.engine=openai needs rollout.base_url, the server's OpenAI-compatible "
                    "URL (e.g. http://127.0.0.1:8000/v1 for `trainfit serve` or `vllm serve`)."))
    if r.engine == "openai" and cfg.stage in ("grpo", "ppo") and cfg.peft.method == "none":
        out.append(("tf.openai_full", "rollout.engine=openai pushes the trained weights to the server as a LoRA adapter "
                    "(its load_lora_adapter endpoint); with peft.method=none there is no adapter to push. Set "
                    "peft.method=lora, or use rollout.engine=hf or vllm for full fine-tuning."))
    if e.type != "none" and cfg.stage != "grpo":
        out.append(("tf.env_stage", f"env.type={e.type} runs multi-turn episodes for stage grpo; this stage is {cfg.stage}. "
                    "Set stage=grpo or env.type=none."))
    if r.max_turns > 1 and e.type == "none":
        out.append(("tf.turns_env", f"rollout.max_turns={r.max_turns} needs an environment to answer the turns: set env.type "
                    "(tools, simulated_user or http), or rollout.max_turns=1."))
    if e.type == "http" and not e.url:
        out.append(("tf.env_url", "env.type=http needs env.url, the environment service's base URL (it serves POST "
                    "/reset and POST /step, see trainfit/envs/http.py)."))
    if e.type == "simulated_user" and e.user_model is None and cfg.peft.method == "none":
        out.append(("tf.env_user", "env.type=simulated_user plays the user with the policy's own weights with adapters "
                    "disabled, which needs adapters: set peft.method=lora, or name a separate model in env.user_model."))
    return out


def dpo_errors(cfg: Config) -> list[tuple[str, str]]:
    """Rules between the dpo section and the rest of the config (stage dpo)."""
    out: list[tuple[str, str]] = []
    d, lt = cfg.dpo, cfg.dpo.loss_type
    needs_ref = lt not in DPO_REFERENCE_FREE
    if not needs_ref and d.reference in ("adapters_off", "copy"):
        out.append(("tf.dpo_reference", f"dpo.reference={d.reference} with dpo.loss_type={lt}: {lt} is reference-free, "
                    "so a reference would only cost memory; set dpo.reference=auto (or none)."))
    if needs_ref and d.reference == "none":
        out.append(("tf.dpo_reference", f"dpo.reference=none with dpo.loss_type={lt}, which compares the policy with a "
                    "reference; set dpo.reference=auto, or a reference-free loss_type (simpo, orpo)."))
    if d.reference == "adapters_off" and cfg.peft.method == "none":
        out.append(("tf.dpo_reference", "dpo.reference=adapters_off needs adapters to switch off: set peft.method=lora "
                    "(or dora), or dpo.reference=copy (or auto) for full fine-tuning."))
    if d.precompute_reference and not needs_ref:
        out.append(("tf.dpo_reference", f"dpo.precompute_reference=true with the reference-free dpo.loss_type={lt}: "
                    "there is nothing to precompute; set dpo.precompute_reference=false."))
    if d.label_smoothing > 0 and lt not in ("sigmoid", "simpo"):
        out.append(("tf.dpo_smoothing", f"dpo.label_smoothing={d.label_smoothing} applies to loss_type sigmoid and simpo, "
                    f"not {lt}; set dpo.label_smoothing=0."))
    if d.sft_weight > 0 and lt in ("orpo", "kto"):
        out.append(("tf.dpo_sft_weight", f"dpo.sft_weight={d.sft_weight} with dpo.loss_type={lt}: "
                    + ("ORPO's loss already holds the chosen answer's NLL" if lt == "orpo" else
                       "KTO's rows are unpaired (no chosen answer)") + "; set dpo.sft_weight=0."))
    if lt == "kto" and cfg.train.global_batch_size < 2:
        out.append(("tf.dpo_kto_batch", "dpo.loss_type=kto estimates its KL reference point from mismatched rows of "
                    f"the step, which needs train.global_batch_size >= 2 (got {cfg.train.global_batch_size})."))
    return out


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


# Loading, overrides, pipelines and error paragraphs live in config_io; they are part of this API.
__all__ = ["BatchPlan", "Config", "ConfigError", "Rule", "cross_field_errors", "apply_override", "compact",
           "deep_merge", "expand_stages", "field_doc", "format_validation_error", "load_config", "to_yaml",
           "valid_keys", "validate"]
from trainfit.config_io import (apply_override, compact, deep_merge, expand_stages, field_doc,  # noqa: E402
                                format_validation_error, load_config, to_yaml, valid_keys, validate)
