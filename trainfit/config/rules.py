"""Rules between config fields, each message naming the keys, the values, the arithmetic and the fix."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainfit.config.base import round_up
from trainfit.config.stages import stage_spec
from trainfit.config.words import count

if TYPE_CHECKING:  # the schema imports these rules to run them; the rules only read its fields
    from trainfit.config.schema import Config


class Rule(str):
    """A cross-field error message that also carries its rule's code (e.g. tf.batch_micro), so tools
    like `trainfit doctor` can tell rules apart without reading the wording."""

    code: str

    def __new__(cls, code: str, message: str) -> "Rule":
        obj = super().__new__(cls, message)
        obj.code = code
        return obj


# Stage rules that refuse the global batch itself (config/rl.py grpo_errors).
GLOBAL_BATCH_RULES = ("tf.grpo_groups", "tf.grpo_groups_per_device")


def cross_field_errors(cfg: Config) -> list[Rule]:
    """Rules between fields, each message naming the keys, the values, the arithmetic and the fix."""
    errs: list[Rule] = []
    spec = stage_spec(cfg.stage)

    def add(code: str, message: str) -> None:
        errs.append(Rule(code, message))

    m = cfg.model
    if m.min_pixels is not None and m.max_pixels is not None and m.min_pixels > m.max_pixels:
        add("tf.cross_field", f"model.min_pixels={m.min_pixels} is larger than model.max_pixels={m.max_pixels}; images "
                         "are resized into [min_pixels, max_pixels]: lower min_pixels or raise max_pixels.")
    t, world = cfg.train, cfg.world_size
    gb, mb = t.global_batch_size, t.micro_batch_size
    # The stage's own rules (grpo, ppo, dpo) come first: those on the global batch say which batch is
    # valid, and the micro-batch rule waits for one (its divisors of a refused batch would mislead).
    own = [Rule(code, msg) for code, msg in spec.rules(cfg)]
    if gb % world:
        add("tf.batch_world", f"train.global_batch_size={gb} is not divisible by the device count {world} "
                    f"(distributed.num_gpus{' - rollout_gpus' if cfg.distributed.rollout_gpus else ''} x num_nodes); "
                    f"use a multiple of {world}, e.g. {round_up(gb, world)}.")
    errs += own
    if gb % world == 0 and not any(r.code in GLOBAL_BATCH_RULES for r in own):
        per_dev = gb // world
        if per_dev % mb:
            ok = [d for d in range(1, per_dev + 1) if per_dev % d == 0]
            add("tf.batch_micro", f"train.micro_batch_size={mb} does not divide the per-device batch {per_dev} "
                        f"(train.global_batch_size={gb} / {count(world, 'device')}), so accumulation {per_dev}/{mb} "
                        f"is not whole; pick micro_batch_size from {ok}.")
    if spec.reads_pairs and cfg.data.path is None and cfg.task.name is None:
        add("tf.rm_data", f"stage {cfg.stage} trains on preference pairs: set data.path to JSONL rows with "
                    "`prompt` (or `messages`), `chosen` and `rejected`, or task.name to make pairs from a task "
                    "(its answer chosen, a wrong one rejected).")
    if spec.data in ("text", "sft") and cfg.task.name is None and cfg.data.path is None:
        add("tf.data_missing", f"stage {cfg.stage} needs data: set data.path (a file, directory or glob) or task.name.")
    if spec.data in ("text", "sft") and cfg.task.name is not None and cfg.data.path is not None \
            and not (spec.env_eval and cfg.env.type != "none"):   # there task.name names the held-out episodes
        # The trainer (train/run.py, train/sft.py) trains these stages on the task's examples whenever
        # task.name is set, so data.path would be read by nobody: say so rather than ignore the file.
        add("tf.data_and_task", f"stage {cfg.stage} has both data.path={cfg.data.path!r} and task.name="
                    f"{cfg.task.name}; it would train on the task's examples and ignore data.path. To train on the "
                    "file, remove task.name (in a pipeline, give the task only to the stages that use it, e.g. "
                    "under the grpo or ppo stage in `stages:`, or set task.name: null in this stage); to train on "
                    "the task, remove data.path.")
    if cfg.data.packing and not spec.packs:
        add("tf.cross_field", f"data.packing=true applies to stage sft, not {cfg.stage}"
                    + (" (pretraining already packs text into full blocks of data.max_seq_length)"
                       if spec.data == "text" else "") + ": set data.packing=false.")
    if cfg.train.padding_free == "on" and not spec.padding_free:
        add("tf.cross_field", f"train.padding_free=on applies to stages grpo, ppo and dpo, not {cfg.stage}"
                    + (" (sft packs its micro-batches with data.packing=true)" if spec.packs else "")
                    + ": set train.padding_free=auto.")
    if t.stop_at_accuracy is not None and (not t.eval_every or cfg.task.name is None):
        add("tf.cross_field", f"train.stop_at_accuracy={t.stop_at_accuracy} ends the stage at a held-out evaluation "
                    f"reaching it, but " + ("task.name is not set, so there is no held-out accuracy: set task.name"
                                             if cfg.task.name is None else
                                             "train.eval_every=0 evaluates only before and after: set "
                                             "train.eval_every, e.g. 100") + ", or remove train.stop_at_accuracy.")
    if spec.data == "text" and cfg.task.name is not None and cfg.data.path is None:
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
    if cfg.data.streaming and not spec.streams:
        add("tf.cross_field", f"data.streaming=true applies to stage pretrain, not {cfg.stage}: set data.streaming=false.")
    if cfg.model.quantization != "none" and cfg.peft.method == "none":
        add("tf.quantization_peft", f"model.quantization={cfg.model.quantization} freezes a quantized base, so it needs adapters: "
                    "set peft.method=lora (QLoRA) or dora, or model.quantization=none.")
    if cfg.model.quantization != "none" and cfg.engine() == "fsdp":
        add("tf.quantization_fsdp", f"model.quantization={cfg.model.quantization} with distributed.strategy=fsdp is not "
                    "run: FSDP2 all-gathers each layer's weights into plain tensors, which drops bitsandbytes' "
                    "quantization state. Use distributed.strategy=ddp or deepspeed with zero_stage<=2 for QLoRA "
                    "(adapters are small), or model.quantization=none to shard a bf16 base with FSDP.")
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
        if spec.plain_head:
            add("tf.cross_field", f"train.fused_head={fh} applies to stages sft, pretrain, dpo and grpo, not {cfg.stage} "
                        f"({spec.plain_head}); set train.fused_head=off or auto.")
    if spec.not_fsdp_adapters and cfg.peft.method != "none" and cfg.engine() == "fsdp":
        add("tf.fsdp_adapters", f"stage {cfg.stage} with peft.method={cfg.peft.method} under distributed.strategy=fsdp "
                    f"is not run: {spec.not_fsdp_adapters}. Use distributed.strategy=ddp (adapters are small) or "
                    "deepspeed, or peft.method=none to shard the whole model with FSDP.")
    if cfg.rl_models.offload_frozen and not cfg.frozen_sharding():
        add("tf.cross_field", f"rl_models.offload_frozen=true keeps the frozen models' shards in CPU RAM, but "
                    f"{cfg.engine()} on {cfg.world_size} training GPU(s) keeps them whole on every GPU (only FSDP "
                    "and ZeRO-3 over several GPUs shard them); set distributed.strategy=fsdp (or deepspeed with "
                    "zero_stage=3) and distributed.num_gpus of 2 or more, or rl_models.offload_frozen=false.")
    if spec.critic and cfg.ppo.shared_base and cfg.engine() == "fsdp":
        add("tf.ppo_shared_base_fsdp", "ppo.shared_base=true with distributed.strategy=fsdp: FSDP2 shards the "
                    "policy and the critic apart, so a critic over the policy's own base would hold that base "
                    "sharded twice. Remove ppo.shared_base (under FSDP the critic gets a base of its own, sharded "
                    "like the policy's), or use distributed.strategy=ddp or deepspeed to share the base.")
    errs += [Rule(code, msg) for code, msg in
             fsdp_offload_errors(cfg) + rollout_errors(cfg) + states_asleep_errors(cfg)]
    if not set(cfg.task.operations) <= set("+-*") or not cfg.task.operations:
        add("tf.operations", f"task.operations={cfg.task.operations!r} must be a non-empty subset of '+-*'.")
    return errs


def fsdp_offload_errors(cfg: Config) -> list[tuple[str, str]]:
    """FSDP2's CPU offload (train/fsdp.py `shard`, torch's CPUOffloadPolicy): one switch, offload_params, that
    keeps every shard of parameters, gradients and so of the optimizer state in CPU RAM, the optimizer stepping
    there; over the ranks of a process group."""
    d, out = cfg.distributed, []
    if cfg.engine() != "fsdp" or not (d.offload_params or d.offload_optimizer):
        return []
    if not d.offload_params:
        out.append(("tf.fsdp_offload_optimizer", "distributed.offload_optimizer=true with distributed.strategy=fsdp and "
                    "offload_params=false: FSDP2's CPU offload keeps the parameter shards, their gradients and the "
                    "optimizer state in CPU RAM together (the optimizer steps there on the CPU shards), so it cannot "
                    "offload the optimizer state alone. Set distributed.offload_params=true too (all three offloaded, "
                    "each layer copied to the GPU for its forward and backward), or offload_optimizer=false; to "
                    "offload the optimizer alone, use distributed.strategy=deepspeed with zero_stage=2."))
    if cfg.world_size == 1:
        out.append(("tf.fsdp_offload_world", f"distributed.offload_params=true with distributed.strategy=fsdp on "
                    f"one process (distributed.num_gpus={d.num_gpus} x num_nodes={d.num_nodes}): trainfit shards "
                    "with FSDP2 over two or more processes, and one process trains the whole model unsharded, so "
                    "nothing would be offloaded. Set distributed.num_gpus to 2 or more, or use "
                    "distributed.strategy=deepspeed with zero_stage=3 (it offloads on one GPU)."))
    if cfg.train.optimizer != "adamw":
        out.append(("tf.fsdp_offload_optimizer_kind", f"train.optimizer={cfg.train.optimizer} with "
                    "distributed.strategy=fsdp and offload_params=true: the offloaded optimizer steps on the CPU "
                    "shards, and bitsandbytes' 8-bit AdamW steps CUDA tensors only. Set train.optimizer=adamw, or "
                    "distributed.offload_params=false."))
    return out


def states_asleep_errors(cfg: Config) -> list[tuple[str, str]]:
    """distributed.offload_train_states_during_rollout: what it applies to (train/zero.py StatesAsleep)."""
    d = cfg.distributed
    if not d.offload_train_states_during_rollout:
        return []
    key = "distributed.offload_train_states_during_rollout=true"
    if not stage_spec(cfg.stage).rollout:
        return [("tf.cross_field", f"{key} applies to stages grpo and ppo, which generate rollouts; stage "
                 f"{cfg.stage} generates none. Set it to false.")]
    if cfg.engine() != "deepspeed" or d.zero_stage != 3:
        return [("tf.cross_field", f"{key} runs under DeepSpeed ZeRO-3, not {cfg.engine()}"
                 + (f" zero_stage={d.zero_stage}" if cfg.engine() == "deepspeed" else "")
                 + " (FSDP2 and ZeRO 1-2 keep their states on the GPU through the rollout). Set "
                 "distributed.strategy=deepspeed and distributed.zero_stage=3, or set it to false.")]
    if d.offload_optimizer or d.offload_params:
        which = "offload_optimizer" if d.offload_optimizer else "offload_params"
        return [("tf.cross_field", f"{key} with distributed.{which}=true: ZeRO-Offload already keeps those "
                 "states in CPU RAM for the whole run, so there is nothing to move for the rollout. Set "
                 "offload_train_states_during_rollout=false, or offload_optimizer=false and "
                 "offload_params=false to keep them on the GPU while training and in CPU RAM while generating.")]
    return []


def rollout_errors(cfg: Config) -> list[tuple[str, str]]:
    """Rules between the rollout engine, the environment and the rest of the config."""
    out: list[tuple[str, str]] = []
    r, e = cfg.rollout, cfg.env
    if r.engine == "openai" and not r.base_url:
        out.append(("tf.openai_url", "rollout.engine=openai needs rollout.base_url, the server's OpenAI-compatible "
                    "URL (e.g. http://127.0.0.1:8000/v1 for `trainfit serve` or `vllm serve`)."))
    if r.engine == "openai" and stage_spec(cfg.stage).rollout and cfg.peft.method == "none":
        out.append(("tf.openai_full", "rollout.engine=openai pushes the trained weights to the server as a LoRA adapter "
                    "(its load_lora_adapter endpoint); with peft.method=none there is no adapter to push. Set "
                    "peft.method=lora, or use rollout.engine=hf or vllm for full fine-tuning."))
    spec = stage_spec(cfg.stage)
    if e.type != "none" and not spec.envs and not spec.env_eval:
        out.append(("tf.env_stage", f"env.type={e.type} runs multi-turn episodes for stage grpo (and held-out episodes "
                    f"for sft); this stage is {cfg.stage}. Set stage=grpo or env.type=none."))
    if e.type != "none" and spec.env_eval and not spec.envs and (cfg.task.name is None or cfg.data.path is None):
        out.append(("tf.env_eval", f"env.type={e.type} in stage {cfg.stage} evaluates held-out episodes while training "
                    f"on data.path: set data.path (e.g. `trainfit env expert` rows) and task.name (the rows /reset "
                    f"receives; its held-out rows are the episodes evaluated); or set stage=grpo to train in the environment, "
                    "or env.type=none."))
    if r.max_turns > 1 and e.type == "none":
        out.append(("tf.turns_env", f"rollout.max_turns={r.max_turns} needs an environment to answer the turns: set env.type "
                    "(tools, simulated_user or http), or rollout.max_turns=1."))
    if spec.envs and e.type != "none" and 0 < r.max_images_per_episode < r.max_turns and cfg.engine() == "deepspeed":
        out.append(("tf.images_deepspeed", f"rollout.max_images_per_episode={r.max_images_per_episode} below "
                    f"rollout.max_turns={r.max_turns} drops screenshots mid-episode, so an episode trains as one row "
                    "per context it acted in and a step has more rows than episodes, which DeepSpeed's fixed "
                    f"accumulation cannot take. Set rollout.max_images_per_episode={r.max_turns} (or 0: keep them all), "
                    "or train without DeepSpeed (distributed.strategy=auto)."))
    out += async_errors(cfg) + worker_mode_errors(cfg) + rollout_gpu_errors(cfg) + retry_errors(cfg)
    if e.type == "http" and not e.url:
        out.append(("tf.env_url", "env.type=http needs env.url, the environment service's base URL (it serves POST "
                    "/reset and POST /step, see trainfit/envs/http.py)."))
    if e.type == "simulated_user" and e.user_model is None and cfg.peft.method == "none":
        out.append(("tf.env_user", "env.type=simulated_user plays the user with the policy's own weights with adapters "
                    "disabled, which needs adapters: set peft.method=lora, or name a separate model in env.user_model."))
    return out


def retry_errors(cfg: Config) -> list[tuple[str, str]]:
    """A remote part's retry window must hold at least one whole request (trainfit/core/retry.py)."""
    out: list[tuple[str, str]] = []
    r, e = cfg.rollout, cfg.env
    if r.engine == "openai" and r.retry_max_s < r.request_timeout_s:
        out.append(("tf.openai_retry", f"rollout.retry_max_s={r.retry_max_s:g} is shorter than one request "
                    f"(rollout.request_timeout_s={r.request_timeout_s:g}), so a slow generation could never finish: "
                    f"set rollout.retry_max_s to at least {r.request_timeout_s:g} (or lower request_timeout_s)."))
    if e.type == "http" and e.retry_max_s < e.timeout_s:
        out.append(("tf.env_retry", f"env.retry_max_s={e.retry_max_s:g} is shorter than one request "
                    f"(env.timeout_s={e.timeout_s:g}), so a slow reply could never arrive: set env.retry_max_s to at "
                    f"least {e.timeout_s:g} (or lower env.timeout_s)."))
    return out


def async_errors(cfg: Config) -> list[tuple[str, str]]:
    """What rollout.mode=async does not combine with yet (trainfit/train/async_rollout.py)."""
    r = cfg.rollout
    if r.mode != "async":
        return []
    spec, out = stage_spec(cfg.stage), []
    if not spec.async_rollout:
        what = "samples no rollout" if not spec.rollout else "samples its rollouts in turn with training"
        return [("tf.async_stage", f"rollout.mode=async applies to stage grpo; stage {cfg.stage} {what}. "
                 "Set rollout.mode=sync.")]
    if r.engine == "vllm" and (r.worker == "process" or cfg.distributed.rollout_gpus):
        where = ("rollout.worker=process (a child process, which would need a vLLM instance of its own)"
                 if r.worker == "process" else f"distributed.rollout_gpus={cfg.distributed.rollout_gpus} (a GPU of "
                 "its own, which would need a vLLM instance there beside the trainer's)")
        out.append(("tf.async_engine", f"rollout.mode=async with rollout.engine=vllm samples with the stage's one "
                    f"colocated vLLM instance from a thread on the trainer's device, not with {where}. Set "
                    "rollout.worker=thread and distributed.rollout_gpus=0, rollout.engine=openai with a separate "
                    "`vllm serve` (the worker pushes each version's adapter to it), or rollout.engine=hf."))
    if cfg.env.type == "simulated_user" and cfg.env.user_model is None:
        out.append(("tf.async_user", "rollout.mode=async with env.type=simulated_user and no env.user_model: the "
                    "simulated user is the trained module with its adapters switched off, which the trainer updates "
                    "while the worker's episodes run. Name a separate model in env.user_model, or set "
                    "rollout.mode=sync."))
    if r.worker == "process":
        out += _process_worker_errors(cfg)
    d = cfg.distributed
    # With rollout GPUs, a world above 1 alone is said by tf.rollout_gpus_split (the split it runs).
    only_world = d.rollout_gpus and d.strategy == "auto" and cfg.engine() in ("single", "ddp")
    if (cfg.world_size > 1 or cfg.engine() != "single") and not only_world:
        out.append(("tf.async_single", f"rollout.mode=async trains in one process; this config trains with "
                    f"{cfg.engine()} on {count(cfg.world_size, 'device')} ((distributed.num_gpus={d.num_gpus} - "
                    f"rollout_gpus={d.rollout_gpus}) x num_nodes={d.num_nodes}, distributed.strategy, zero_stage, "
                    "offload_*). Set distributed.num_gpus=1 (or num_gpus=2 with rollout_gpus=1: one GPU trains, "
                    "one samples) and distributed.strategy=auto without ZeRO or offload, or rollout.mode=sync."))
    return out


def _process_worker_errors(cfg: Config) -> list[tuple[str, str]]:
    """rollout.worker=process (trainfit/train/async_process.py): a child process on the CPU beside one trainer.
    On a GPU the child would need the trainer's CUDA tensors over CUDA IPC, a path not built (or tested) yet."""
    out, d = [], cfg.distributed
    if cfg.train.device == "cuda" or d.rollout_gpus:
        what = "train.device=cuda" if cfg.train.device == "cuda" else f"distributed.rollout_gpus={d.rollout_gpus}"
        out.append(("tf.worker_process_gpu", f"rollout.worker=process runs the rollout worker in a child process on "
                    f"the CPU, and {what} puts the weights on a GPU, which the process worker does not take yet. "
                    "Set rollout.worker=thread (the worker on a GPU, or on a GPU of its own with "
                    "distributed.rollout_gpus), or train.device=cpu with distributed.rollout_gpus=0."))
    if cfg.model.quantization != "none":
        out.append(("tf.worker_process_quantized", f"rollout.worker=process with model.quantization="
                    f"{cfg.model.quantization}: the child process shares the frozen base with the trainer through "
                    "shared memory, and a bitsandbytes base is not shared that way yet. Set rollout.worker=thread, "
                    "or model.quantization=none."))
    return out


def worker_mode_errors(cfg: Config) -> list[tuple[str, str]]:
    """rollout.worker chooses where the async worker runs; sync has none."""
    if cfg.rollout.worker != "thread" and cfg.rollout.mode != "async":
        return [("tf.worker_mode", f"rollout.worker={cfg.rollout.worker} places the asynchronous rollout worker, but "
                 f"rollout.mode={cfg.rollout.mode} samples in turn with training and has no worker. Set "
                 "rollout.mode=async (stage grpo), or rollout.worker=thread.")]
    return []


def rollout_gpu_errors(cfg: Config) -> list[tuple[str, str]]:
    """distributed.rollout_gpus: GPUs of their own for the async rollout worker (config/devices.py). What the
    worker supports today: one copy of the policy on one rollout GPU beside one training process."""
    d, n = cfg.distributed, cfg.distributed.rollout_gpus
    if n == 0:
        return []
    if cfg.rollout.mode != "async":
        return [("tf.rollout_gpus_mode", f"distributed.rollout_gpus={n} gives GPUs to the asynchronous rollout "
                 f"worker, but rollout.mode={cfg.rollout.mode} samples on the training GPUs in turn with training. "
                 "Set rollout.mode=async (stage grpo), or distributed.rollout_gpus=0.")]
    if n >= d.num_gpus:
        return [("tf.rollout_gpus_count", f"distributed.rollout_gpus={n} leaves no GPU to train: it must be below "
                 f"distributed.num_gpus={d.num_gpus} (num_gpus counts the training and the rollout GPUs of a node). "
                 f"Set distributed.num_gpus={n + 1}, or lower rollout_gpus.")]
    out = []
    if n != 1 or d.num_gpus != 2 or d.num_nodes != 1:
        out.append(("tf.rollout_gpus_split", f"distributed.rollout_gpus={n} with num_gpus={d.num_gpus} x "
                    f"num_nodes={d.num_nodes}: the async worker is one copy of the policy on one GPU, fed by one "
                    "training process, so the split it runs is one rollout GPU beside one training GPU. Set "
                    "distributed.num_gpus=2, rollout_gpus=1 and num_nodes=1, or rollout_gpus=0."))
    if cfg.train.device == "cpu":
        out.append(("tf.rollout_gpus_cpu", f"distributed.rollout_gpus={n} places the rollout worker on a GPU, but "
                    "train.device=cpu trains on the CPU. Set train.device=auto (or cuda) on a machine with "
                    f"{d.num_gpus} GPUs, or distributed.rollout_gpus=0 to sample on the CPU beside the trainer."))
    if cfg.model.quantization != "none":
        out.append(("tf.rollout_gpus_quantized", f"distributed.rollout_gpus={n} copies the whole policy to the "
                    f"rollout GPU, and a model.quantization={cfg.model.quantization} (bitsandbytes) base is not "
                    "copied across devices yet. Set model.quantization=none, or distributed.rollout_gpus=0."))
    return out
