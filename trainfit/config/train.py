"""Config sections of the run: the optimizer loop (`train`), logging, distribution and the hardware."""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from trainfit.config.base import _Section


class TrainConfig(_Section):
    global_batch_size: int = Field(32, ge=1, description=(
        "Samples per optimizer step across all devices. For GRPO a sample is one completion."))
    micro_batch_size: int = Field(8, ge=1, description="Samples per forward pass on one device; accumulation is derived.")
    max_steps: int = Field(100, description="Optimizer steps to run (at least 1).")
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
    padding_free: Literal["auto", "on", "off"] = Field("auto", description=(
        "grpo, ppo, dpo: each training micro-batch as one padding-free row, its sequences back to back with "
        "position ids restarting per sequence (the reference, old-log-prob and value forwards too), so a "
        "micro-batch costs its real tokens, not micro x its longest; the same log-probs, losses and gradients. "
        "flash-attention runs its varlen kernels on it; sdpa / eager attend through a block-diagonal "
        "[tokens, tokens] mask, whose attention work grows with the row's square. `auto` = on with "
        "model.attn_implementation flash_attention_2 / 3, else off; not for vision-language policies. "
        "(sft packs with data.packing.)"))
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
    stop_at_accuracy: Optional[float] = Field(None, gt=0.0, le=1.0, description=(
        "End the stage at the first held-out evaluation (every eval_every steps) whose accuracy reaches this "
        "fraction, e.g. 0.5: SFT until half the held-out problems are solved, then RL from there. max_steps "
        "stays the limit and the length of the learning-rate schedule. The held-out set then also decides "
        "when the stage ends, as early stopping does; needs task.name and eval_every."))
    save_every: int = Field(0, ge=0, description="Checkpoint every N steps (0 = only the final model).")
    keep_checkpoints: int = Field(2, ge=1, description="Most recent checkpoints kept on disk.")
    log_every: int = Field(1, ge=1, description="Write metrics every N steps.")
    max_bad_steps: int = Field(5, description=(
        "Non-finite steps in a row the run rides out: an optimizer step whose loss or gradient norm is NaN or inf "
        "is skipped (no weight, optimizer-state or learning-rate change; `skipped_nonfinite: 1` in metrics.jsonl), "
        "and after this many in a row the run stops with what to try. 5 lets a few bad batches pass and stops a "
        "run whose lr, dtype or data make every step diverge. At least 1."))

    @field_validator("max_steps")
    @classmethod
    def _some_steps(cls, v: int) -> int:
        # 0 would evaluate, then save the untrained model as the stage's final one and report success.
        if v < 1:
            raise ValueError(f"train.max_steps={v} trains nothing: the stage would save its starting model as its "
                             "final one. Set the number of optimizer steps to at least 1, e.g. train.max_steps=100 "
                             "(to look at a config without training, use `trainfit train CONFIG --dry-run` or "
                             "`trainfit plan CONFIG`).")
        return v

    @field_validator("max_bad_steps")
    @classmethod
    def _some_bad_steps(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"train.max_bad_steps={v}: it counts the non-finite steps in a row that are skipped "
                             "before the run stops; use at least 1 (1 stops at the first one), e.g. "
                             "train.max_bad_steps=5.")
        return v

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

    @field_validator("padding_free", mode="before")
    @classmethod
    def _padding_free_bool(cls, v: Any) -> Any:
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v   # YAML's bare on / off


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
    plot: bool = Field(True, description=(
        "Write metrics.png (loss, reward, accuracy against step) at the end, and report.html (the run report, with "
        "replay.html for kept episodes) at every evaluation and at the end."))
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
    offload_train_states_during_rollout: bool = Field(False, description=(
        "GRPO / PPO under DeepSpeed ZeRO-3: move the trained models' optimizer state, fp32 master weights "
        "and gradient buffers to CPU RAM while the rollout engine generates, and back before the scoring "
        "forwards (as OpenRLHF's --deepspeed_enable_sleep): the card holds the engine's KV cache instead, "
        "for two host<->device copies of those states a rollout."))
    num_gpus: int = Field(1, ge=1, description=(
        "GPUs per node (or CPU processes with gloo when train.device=cpu): one training process per GPU, "
        "except the distributed.rollout_gpus that run the rollout worker. More than one training process in "
        "total makes `trainfit train` re-launch itself under torchrun."))
    rollout_gpus: int = Field(0, ge=0, description=(
        "rollout.mode=async: GPUs of the node's num_gpus that run the rollout worker (the last ones; the "
        "first num_gpus - rollout_gpus train, trainfit/config/devices.py). The worker holds a whole copy of "
        "the policy there and the trainer's weights are copied to it after every optimizer step. 0 = the "
        "worker shares the trainer's device. For now 1 rollout GPU beside 1 training GPU."))
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
