"""verl: the Hydra overrides of ppo_trainer.yaml, as its run_*.sh scripts pass them to
`python3 -m verl.trainer.main_ppo key=value ...`.

Batch arithmetic. verl samples data.train_batch_size prompts per rollout (each rollout.n times) and updates in
mini-batches of actor.ppo_mini_batch_size prompts (x rollout.n completions), ppo_micro_batch_size_per_gpu
completions per forward. trainfit samples a fresh rollout for every optimizer step: its global batch is one
verl mini-batch, ppo_mini_batch_size x rollout.n completions (GRPO); for PPO one completion a prompt and
ppo.num_mini_batches = train_batch_size / ppo_mini_batch_size optimizer steps per rollout.
"""

from __future__ import annotations

from typing import Any, Optional

from trainfit.config.base import ConfigError
from trainfit.config.importers.common import Imported, reader, Mapped, map_keys, settle_batch
from trainfit.config.importers.shell import commands
from trainfit.config.importers.values import NotCarried, converter, scalar
from trainfit.config.words import count

A = "actor_rollout_ref."
# ppo_trainer.yaml's defaults the arithmetic reads when a script leaves them out.
DEFAULTS = {"algorithm.adv_estimator": "gae", "data.train_batch_size": 1024, A + "actor.ppo_mini_batch_size": 256,
            A + "rollout.n": 1, "trainer.n_gpus_per_node": 8, "trainer.nnodes": 1, A + "actor.kl_loss_coef": 0.001,
            A + "actor.use_kl_loss": False}
_FSDP = "verl's FSDP offload switch; trainfit offloads with DeepSpeed ZeRO (distributed.offload_optimizer, offload_params)"
_PADFREE = "trainfit packs micro-batches padding-free with train.padding_free (auto: on with flash-attention)"
_LOGPROB = "trainfit computes log-probs in the training micro-batches (train.micro_batch_size)"
_KERNELS = "train.fused_head=auto uses Liger's fused LM head on CUDA where it is installed"
_LOAD = "how verl hands weights to its engine; trainfit syncs the engine itself (and checks it, rollout.sync_check)"
DROPS = {
    "data.filter_overlong_prompts": "trainfit keeps a long prompt's last rollout.max_prompt_length tokens",
    "data.truncation": "trainfit keeps a long prompt's last rollout.max_prompt_length tokens",
    "data.val_batch_size": "trainfit evaluates task.num_eval held-out prompts",
    "data.shuffle": "trainfit shuffles with train.seed",
    A + "model.use_remove_padding": _PADFREE, A + "model.use_rmpad": _PADFREE, "critic.model.use_remove_padding": _PADFREE,
    "critic.model.use_rmpad": _PADFREE, A + "model.use_liger": _KERNELS, A + "model.use_fused_kernels": _KERNELS,
    A + "model.fused_kernel_options.": _KERNELS, A + "actor.fsdp_config.": _FSDP, A + "ref.fsdp_config.": _FSDP,
    "critic.model.fsdp_config.": _FSDP, A + "rollout.log_prob_micro_batch_size_per_gpu": _LOGPROB,
    A + "rollout.log_prob_micro_batch_size": _LOGPROB, A + "ref.log_prob_micro_batch_size_per_gpu": _LOGPROB,
    A + "ref.log_prob_micro_batch_size": _LOGPROB, "critic.ppo_micro_batch_size": "the critic trains in the policy's "
    "micro-batches (train.micro_batch_size)", "critic.ppo_micro_batch_size_per_gpu": "the critic trains in the "
    "policy's micro-batches (train.micro_batch_size)", "critic.model.enable_gradient_checkpointing": "the critic "
    "follows model.gradient_checkpointing", "trainer.critic_warmup": "trainfit trains the critic with the policy "
    "from the first step", A + "rollout.load_format": _LOAD, A + "rollout.layered_summon": _LOAD,
    A + "model.use_shm": _LOAD, A + "rollout.enforce_eager": "vLLM's CUDA graphs are vLLM's own choice here",
    A + "rollout.free_cache_engine": "rollout.sleep_level frees vLLM's cache between phases",
}


def words(text: str) -> list[str]:
    """The overrides of the main_ppo command in a script or one command."""
    for c in commands(text):
        for i, w in enumerate(c):
            if w.endswith("main_ppo") or w.endswith("main_ppo.py"):
                return c[i + 1:]
    raise ConfigError("no `python3 -m verl.trainer.main_ppo key=value ...` command found; give a verl run_*.sh "
                      "script or the command itself (its key=value overrides of ppo_trainer.yaml).")


def peer_args(text: str) -> dict[str, Any]:
    """The overrides as {dotted key: value} (Hydra's `+key=value` too; a later one wins, as in Hydra)."""
    return {w.lstrip("+").partition("=")[0]: scalar(w.partition("=")[2]) for w in words(text) if "=" in w}


def convert(text: str, stage: Optional[str] = None, num_gpus: Optional[int] = None) -> Imported:
    args = peer_args(text)

    adv = args.get("algorithm.adv_estimator", DEFAULTS["algorithm.adv_estimator"])
    im = Imported("verl", stage or ("ppo" if adv == "gae" else "grpo"),
                  "--stage" if stage else f"verl's algorithm.adv_estimator={adv}"
                  + ("" if "algorithm.adv_estimator" in args else " (its default)"))
    get = reader(im, args, DEFAULTS)
    get("algorithm.adv_estimator")
    handled = {"algorithm.adv_estimator", "data.train_batch_size", A + "actor.ppo_mini_batch_size",
               A + "actor.ppo_micro_batch_size_per_gpu", A + "actor.ppo_micro_batch_size", A + "rollout.n",
               A + "actor.use_kl_loss", A + "actor.kl_loss_coef", "algorithm.kl_ctrl.kl_coef",
               "algorithm.use_kl_in_reward", "critic.model.path", A + "model.lora_rank", "data.train_files", "data.val_files"}
    world = (num_gpus or get("trainer.n_gpus_per_node")) * get("trainer.nnodes")
    if num_gpus:
        im.compute("distributed.num_gpus", num_gpus, f"--num-gpus {num_gpus}")
        handled.add("trainer.n_gpus_per_node")
    if im.stage == "grpo" and "algorithm.adv_estimator" in args:
        try:
            im.set("grpo.advantage", converter("advantage")(adv))
            im.mapped.append(_m("algorithm.adv_estimator", adv, "grpo.advantage", im.values["grpo.advantage"]))
        except NotCarried as e:
            im.drop("algorithm.adv_estimator", adv, str(e))
    _batch(im, get, world, args)
    _kl(im, get, args)
    _task(im, args)
    critic = args.get("critic.model.path")
    if critic is not None and im.stage == "ppo":
        if critic == args.get(A + "model.path"):
            im.drop("critic.model.path", critic, "the policy's own model: trainfit's critic starts from the policy "
                    "(rl_models.value_model unset)")
        else:
            im.set("rl_models.value_model", critic)
            im.mapped.append(_m("critic.model.path", critic, "rl_models.value_model"))
    if args.get(A + "model.lora_rank"):
        im.compute("peft.method", "lora", f"{A}model.lora_rank={args[A + 'model.lora_rank']} > 0")
        im.compute("peft.r", args[A + "model.lora_rank"], f"{A}model.lora_rank")
    if "trainer.total_epochs" in args and "trainer.total_training_steps" not in args:
        handled.add("trainer.total_epochs")
        per_step = im.values["train.global_batch_size"] // get(A + "rollout.n") if im.stage == "grpo" else \
            im.values["train.global_batch_size"]
        im.drop("trainer.total_epochs", args["trainer.total_epochs"], "trainfit counts optimizer steps: train.max_steps "
                f"= {args['trainer.total_epochs']} epochs x the dataset's prompts / {per_step} prompts per step (the "
                "prompts are not known here; trainfit's default is kept)")
    map_keys(im, args, handled, DROPS)
    return im


def _batch(im: Imported, get, world: int, args: dict) -> None:
    b, m, n = get("data.train_batch_size"), get(A + "actor.ppo_mini_batch_size"), get(A + "rollout.n")
    per_gpu = args.get(A + "actor.ppo_micro_batch_size_per_gpu")
    if per_gpu is None and args.get(A + "actor.ppo_micro_batch_size"):   # the older key counts all GPUs
        micro, words = max(1, args[A + "actor.ppo_micro_batch_size"] // world), (
            f"{A}actor.ppo_micro_batch_size {args[A + 'actor.ppo_micro_batch_size']} over all {count(world, 'GPU')} / {world}")
    else:
        micro = per_gpu or 1
        words = (f"{A}actor.ppo_micro_batch_size_per_gpu {per_gpu}" if per_gpu else
                 "no micro-batch given (verl's dynamic batch): 1, `trainfit fit` finds the largest that fits")
    steps = f"{b}/{m} = {b / m:g}"
    if im.stage == "grpo":
        im.compute("grpo.num_generations", n, f"{A}rollout.n {n} completions per prompt")
        settle_batch(im, global_=m * n, micro=micro, world=world, group=n, micro_formula=words + " completions",
                     global_formula=f"{A}actor.ppo_mini_batch_size {m} prompts x rollout.n {n} = {m * n} completions "
                     f"per optimizer step (verl's data.train_batch_size {b} prompts per rollout is {steps} optimizer "
                     "steps on one rollout; trainfit samples a fresh rollout for every step)")
        return
    if n > 1:
        im.drop(A + "rollout.n", n, "trainfit's PPO samples one completion a prompt")
    settle_batch(im, global_=m, micro=micro, world=world, group=1, micro_formula=words,
                 global_formula=f"{A}actor.ppo_mini_batch_size {m} prompts (one completion each) per optimizer step")
    im.compute("ppo.num_mini_batches", max(1, b // m), f"data.train_batch_size {b} / ppo_mini_batch_size {m}: "
               "optimizer steps per rollout" + ("" if b % m == 0 else f" (rounded down from {b / m:g})"))


def _kl(im: Imported, get, args: dict) -> None:
    """GRPO's KL term sits in the loss (actor.use_kl_loss with kl_loss_coef); PPO's in the rewards
    (algorithm.kl_ctrl.kl_coef, with use_kl_in_reward where the script says so) or in the loss."""
    use, coef_key = A + "actor.use_kl_loss", A + "actor.kl_loss_coef"
    loss = get(use)
    coef = get(coef_key) if loss else None
    said = f"{use}={loss}" + (f" with {coef_key} {coef}" if loss else "")
    if im.stage == "grpo":
        im.compute("grpo.beta", coef if loss else 0.0, said if loss else f"{said}: no KL term in the loss")
        for k in ("algorithm.use_kl_in_reward", "algorithm.kl_ctrl.kl_coef"):
            if k in args:
                im.drop(k, args[k], "a KL penalty in the rewards is stage ppo's (ppo.kl_coef); GRPO's KL term is in "
                        "the loss (grpo.beta)")
        return
    in_reward = args.get("algorithm.use_kl_in_reward")
    if loss:
        im.compute("ppo.kl_mode", "loss", f"{use}=True: the KL term in the policy loss")
        im.compute("ppo.kl_coef", coef, said)
    elif in_reward is False:
        im.compute("ppo.kl_coef", 0.0, f"{use}=False and algorithm.use_kl_in_reward=False: no KL penalty")
    elif "algorithm.kl_ctrl.kl_coef" in args:
        im.compute("ppo.kl_coef", args["algorithm.kl_ctrl.kl_coef"], "algorithm.kl_ctrl.kl_coef "
                   f"{args['algorithm.kl_ctrl.kl_coef']}, folded into the rewards (ppo.kl_mode=reward)")
    for k in ("algorithm.use_kl_in_reward", "algorithm.kl_ctrl.kl_coef"):
        if k in args and not any(k in c.formula for c in im.computed):
            im.drop(k, args[k], f"{use}=True puts the KL term in the loss instead")


def _task(im: Imported, args: dict) -> None:
    if args.get("data.train_files") is None:
        return
    im.compute("task.name", "dataset", "verl's prompts are dataset rows (its parquet: prompt, "
               "reward_model.ground_truth), which task.name=dataset reads")
    for peer, key in (("data.train_files", "task.path"), ("data.val_files", "task.eval_path")):
        files = args.get(peer)
        files = files if isinstance(files, list) else [files] if files is not None else []
        if files:
            im.set(key, files[0])
            im.mapped.append(_m(peer, args[peer], key, files[0]))
        for extra in files[1:]:
            im.drop(peer, extra, f"trainfit reads one {key}: put the files in one folder (or a glob) and give that")


def _m(k: str, v: Any, key: str, value: Any = None) -> Mapped:
    return Mapped(k, v, key, v if value is None else value)
