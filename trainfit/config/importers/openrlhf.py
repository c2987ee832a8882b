"""OpenRLHF: the command lines of its example scripts, `deepspeed --module openrlhf.cli.train_sft --flag value`,
`torchrun ... -m openrlhf.cli.train_dpo`, `ray job submit -- python3 -m openrlhf.cli.train_ppo_ray ...`.

Batch arithmetic. OpenRLHF samples rollout_batch_size prompts per rollout, each n_samples_per_prompt times,
and trains on them max_epochs times in optimizer steps of train_batch_size samples (completions),
micro_train_batch_size per forward on one GPU. trainfit's global batch is OpenRLHF's train_batch_size (GRPO:
train_batch_size / n_samples_per_prompt prompts per step), sampled afresh for every optimizer step and trained on
grpo.num_iterations = max_epochs times; PPO's rollout is ppo.num_mini_batches optimizer steps.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from trainfit.config.base import ConfigError
from trainfit.config.importers.common import Imported, reader, map_keys, settle_batch, steps_from_samples
from trainfit.config.importers.shell import commands
from trainfit.config.importers.values import scalar

STAGES = {"train_sft": "sft", "train_dpo": "dpo", "train_kto": "dpo", "train_rm": "rm", "train_ppo": "ppo",
          "train_ppo_ray": "ppo"}
# openrlhf/cli defaults the arithmetic reads when a script leaves them out.
DEFAULTS = {"train_batch_size": 128, "micro_train_batch_size": 8, "rollout_batch_size": 1024, "n_samples_per_prompt": 1,
            "max_epochs": 1, "num_episodes": 1, "zero_stage": 2, "init_kl_coef": 0.01, "kl_estimator": "k1",
            "actor_num_gpus_per_node": 8, "actor_num_nodes": 1, "advantage_estimator": "gae"}
_PLACED = "trainfit holds the reference, reward and critic models on the training GPUs (the planner counts them there)"
_ENGINE = "an internal of OpenRLHF's vLLM engines; trainfit runs one engine colocated with each training process"
_TOKENS = "trainfit's micro-batches count samples; `trainfit fit` sizes them to the card"
DROPS = {
    "ref_num_nodes": _PLACED, "ref_num_gpus_per_node": _PLACED, "reward_num_nodes": _PLACED,
    "reward_num_gpus_per_node": _PLACED, "critic_num_nodes": _PLACED, "critic_num_gpus_per_node": _PLACED,
    "colocate_all_models": "trainfit colocates every model on the training GPUs", "vllm_num_engines": _ENGINE,
    "vllm_sync_backend": _ENGINE, "enforce_eager": _ENGINE, "fsdp2_enable_sleep": _ENGINE,
    "deepspeed_enable_sleep": _ENGINE, "use_dynamic_batch": _TOKENS, "train_max_tokens_per_gpu": _TOKENS,
    "rollout_max_tokens_per_gpu": _TOKENS, "ring_attn_size": "trainfit has no sequence (ring-attention) parallelism",
    "ring_head_stride": "trainfit has no sequence (ring-attention) parallelism",
    "ckpt_path": "checkpoints go to run_dir", "save_hf_ckpt": "the final model is saved in Hugging Face format",
    "max_ckpt_num": "train.keep_checkpoints keeps the latest checkpoints (2 by default)",
    "load_checkpoint": "`trainfit train --resume` continues a run from run_dir",
    "dynamic_filtering": "trainfit trains every group of a rollout (no dynamic sampling)",
    "dynamic_filtering_reward_range": "trainfit trains every group of a rollout (no dynamic sampling)",
    "enable_vllm_is_correction": "trainfit checks the engine's log-probs against the trainer's (rollout.sync_check) "
    "instead of reweighting", "vllm_enable_is_correction": "trainfit checks the engine's log-probs against the "
    "trainer's (rollout.sync_check) instead of reweighting", "vllm_is_correction_type": "no reweighting of the "
    "engine's samples here (rollout.sync_check)",
    "agent_func_path": "an OpenRLHF agent function; trainfit's multi-turn environments are env.type (tools, "
    "simulated_user, http)",
    "remote_rm_url": "OpenRLHF's reward server or reward_func(queries, prompts, labels); trainfit's rewards are "
    "task.rewards (`default` checks the dataset's answers; a module:function of your own)",
    "normalize_reward": "trainfit normalises advantages (grpo.scale_rewards, ppo.whiten_advantages), not rewards",
    "use_wandb": "set logging.report_to=[wandb]", "dataset_probs": "trainfit reads one data.path",
}


def words(text: str) -> tuple[str, list[str], int]:
    """(the openrlhf.cli module, its flags, the GPUs its launcher names or 0)."""
    for c in commands(text):
        for i, w in enumerate(c):
            name = w.rsplit(".", 1)[-1].removesuffix(".py").rsplit("/", 1)[-1]
            if ("openrlhf.cli." in w or w.endswith(".py")) and name in STAGES:
                return name, c[i + 1:], _launcher_gpus(c[:i])
    raise ConfigError("no openrlhf.cli.train_* command found (e.g. `deepspeed --module openrlhf.cli.train_sft "
                      "--pretrain ...`); give an OpenRLHF example script or the command itself.")


def _launcher_gpus(launcher: list[str]) -> int:
    for flag in ("--nproc-per-node", "--nproc_per_node", "--num_gpus"):
        if flag in launcher and launcher.index(flag) + 1 < len(launcher):
            return int(scalar(launcher[launcher.index(flag) + 1]))
    return 0


def flags(ws: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    key = None
    for w in ws:
        if w.startswith("--"):
            key, _, v = w[2:].partition("=")
            out[key] = scalar(v) if v else True
        elif key is not None:
            v = scalar(w)
            out[key] = v if out[key] is True else (out[key] if isinstance(out[key], list) else [out[key]]) + [v]
    return out


def peer_args(text: str) -> dict[str, Any]:
    return flags(words(text)[1])


def convert(text: str, stage: Optional[str] = None, num_gpus: Optional[int] = None) -> Imported:
    module, ws, launcher = words(text)
    args = flags(ws)

    guessed, adv = STAGES[module], args.get("advantage_estimator", DEFAULTS["advantage_estimator"])
    if guessed == "ppo" and adv != "gae":
        guessed = "grpo"
    im = Imported("openrlhf", stage or guessed, "--stage" if stage else f"OpenRLHF's {module}" + (
        f" with --advantage_estimator {adv}" if STAGES[module] == "ppo" else ""))
    get = reader(im, args, DEFAULTS)
    if STAGES[module] == "ppo":
        get("advantage_estimator")
    if module == "train_kto":
        im.compute("dpo.loss_type", "kto", "OpenRLHF's train_kto")
    handled = {"train_batch_size", "micro_train_batch_size", "rollout_batch_size", "n_samples_per_prompt",
               "max_epochs", "num_episodes", "max_samples", "init_kl_coef", "use_kl_loss", "use_kl_estimator_k3",
               "actor_num_gpus_per_node", "actor_num_nodes", "lora_rank", "zero_stage"}
    rl = im.stage in ("grpo", "ppo")
    world = num_gpus or (get("actor_num_gpus_per_node") * get("actor_num_nodes") if rl else launcher or 1)
    where = ("--num-gpus" if num_gpus else "actor_num_gpus_per_node x actor_num_nodes" if rl else
             "the launcher's process count" if launcher else "no process count in the launcher: 1 assumed, pass --num-gpus")
    im.compute("distributed.num_gpus", world, f"{where} = {world}")
    if rl:
        _rl_batch(im, get, world, args)
    else:
        tb, micro = get("train_batch_size"), get("micro_train_batch_size")
        settle_batch(im, global_=tb, micro=micro, world=world, group=1, global_formula=f"train_batch_size {tb} samples "
                     "per optimizer step on all GPUs", micro_formula=f"micro_train_batch_size {micro}")
        if not steps_from_samples(im, epochs=get("max_epochs"), samples=args.get("max_samples"),
                                  per_step=im.values["train.global_batch_size"], what="samples per step",
                                  peer_keys="max_epochs x max_samples / train_batch_size"):
            im.drop("max_epochs", get("max_epochs"), "trainfit counts optimizer steps: set train.max_steps = epochs x "
                    "dataset rows / train.global_batch_size (the rows are not known here)")
    im.compute("distributed.zero_stage", get("zero_stage"), "zero_stage" + ("" if "zero_stage" in args else
                                                                              " (OpenRLHF's default)"))
    if args.get("lora_rank"):
        im.compute("peft.method", "lora", f"lora_rank {args['lora_rank']} > 0")
        im.compute("peft.r", args["lora_rank"], "lora_rank")
    map_keys(im, args, handled, DROPS)
    return im


def _rl_batch(im: Imported, get, world: int, args: dict) -> None:
    tb, micro, n = get("train_batch_size"), get("micro_train_batch_size"), get("n_samples_per_prompt")
    rb, epochs = get("rollout_batch_size"), get("max_epochs")
    per_rollout = f"{rb} x {n} / {tb} = {rb * n / tb:g}"
    if im.stage == "grpo":
        im.compute("grpo.num_generations", n, f"n_samples_per_prompt {n}")
        im.compute("grpo.num_iterations", epochs, f"max_epochs {epochs}: each sample is trained on {epochs} time(s)")
    else:
        if n > 1:
            im.drop("n_samples_per_prompt", n, "trainfit's PPO samples one completion a prompt")
        im.compute("ppo.num_mini_batches", max(1, rb // tb), f"rollout_batch_size {rb} / train_batch_size {tb}: "
                   "optimizer steps per rollout")
        im.compute("ppo.epochs", epochs, f"max_epochs {epochs}")
    settle_batch(im, global_=tb, micro=micro, world=world, group=n if im.stage == "grpo" else 1,
                 micro_formula=f"micro_train_batch_size {micro}",
                 global_formula=f"train_batch_size {tb} completions per optimizer step ({tb // n} prompts x "
                 f"{n}); OpenRLHF's rollout of rollout_batch_size {rb} prompts x {n} is {per_rollout} optimizer "
                 "steps per epoch, trainfit samples a fresh rollout for every step")
    samples = args.get("max_samples")
    if samples:
        steps = max(1, math.ceil(get("num_episodes") * samples * n * epochs / im.values["train.global_batch_size"]))
        im.compute("train.max_steps", steps, f"ceil(num_episodes {get('num_episodes')} x max_samples {samples} x "
                   f"n_samples_per_prompt {n} x max_epochs {epochs} / train_batch_size "
                   f"{im.values['train.global_batch_size']}) = {steps}")
    else:
        im.drop("num_episodes", get("num_episodes"), "trainfit counts optimizer steps: set train.max_steps = episodes "
                "x prompts x n_samples_per_prompt / train.global_batch_size (the prompts are not known here)")
    im.compute("rollout.engine", "vllm" if "vllm_num_engines" in args else "hf", "vllm_num_engines: OpenRLHF "
               "generates with vLLM" if "vllm_num_engines" in args else "no vllm_num_engines: generation in the trainer")
    loss, coef = bool(args.get("use_kl_loss")), get("init_kl_coef")
    given = "" if "init_kl_coef" in args else " (OpenRLHF's default)"
    if im.stage == "grpo":
        if loss or "init_kl_coef" not in args:
            im.compute("grpo.beta", coef if loss else 0.0, f"--use_kl_loss with init_kl_coef {coef}{given}" if loss
                       else "no --use_kl_loss: no KL term in the loss")
        else:
            im.drop("init_kl_coef", coef, "without --use_kl_loss OpenRLHF folds the KL into the rewards; trainfit's "
                    "GRPO has its KL in the loss (grpo.beta), PPO in the rewards (stage ppo, ppo.kl_coef)")
    else:
        im.compute("ppo.kl_mode", "loss" if loss else "reward", "--use_kl_loss" if loss else "no --use_kl_loss: the "
                   "KL penalty folded into the rewards")
        im.compute("ppo.kl_coef", coef, f"init_kl_coef {coef}{given}")
    if loss and "kl_estimator" not in args:
        est = "k3" if args.get("use_kl_estimator_k3") else "k1"
        im.compute("grpo.kl_estimator", est, "--use_kl_estimator_k3" if est == "k3" else "OpenRLHF's default k1")
    if "prompt_data" in args:
        im.compute("task.name", "dataset", "OpenRLHF's prompts are dataset rows (--prompt_data), which task.name=dataset "
                   "reads")
