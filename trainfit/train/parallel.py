"""How the trained module is spread over ranks: one process, DDP replicas, or FSDP2 shards.

    engine = cfg.engine()          # single | ddp | fsdp | deepspeed
    train_model = wrap(model, cfg, ranks, is_peft)   # deepspeed: deepspeed_initialize(model, optimizer, cfg)

DDP keeps a full replica per rank and all-reduces gradients. DeepSpeed ZeRO 1-2 partitions optimizer
state and gradients (its engine owns accumulation boundaries and clipping), ZeRO-3 the parameters too,
and ZeRO-Offload keeps the optimizer partition (and for ZeRO-3 the parameters) in CPU RAM (zero.py). FSDP2 (`fully_shard`) shards every
decoder layer and the root over the ranks: parameters, gradients and optimizer state live 1/N per
rank and are gathered layer by layer for compute; with distributed.offload_params those shards live in
CPU RAM (each layer copied to the device for its forward and backward, the optimizer stepping on the CPU). Both average gradients over ranks; the loop scales
the loss by the rank count so the result is the gradient of the whole step's loss.

Sharded modules talk to every rank in each forward, so every rank must run the same number of
forwards: generation uses `synced_gpus` and evaluation runs on all ranks (see `collective_forward`).
Checkpoints of a sharded model are gathered into full tensors on rank 0 (the same files as DDP); its final
save gathers one tensor at a time as rank 0 writes it (final_save.py).
ZeRO-3 parameters are gathered whole for evaluation, the saves final_save.py cannot stream and an hf-engine
rollout (`full_weights`); for an engine with its own copy of the weights the rollout gathers a tensor or a
layer at a time (`rollout_weights`).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from trainfit.config import Config, ConfigError
from trainfit.core.dist import Ranks
from trainfit.train import fsdp, zero
from trainfit.train.ds_config import deepspeed_config
from trainfit.train.launch import check_launch


def wrap(model, cfg: Config, ranks: Ranks, is_peft: bool):
    """The module the training forward goes through (the same object for FSDP2: sharded in place)."""
    engine = cfg.engine()
    if not ranks.distributed or engine in ("single", "deepspeed"):  # deepspeed wraps with the optimizer
        return model
    if engine == "fsdp":
        fsdp.shard(model, ranks.world, offload=cfg.distributed.offload_params)
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    cuda = next(model.parameters()).is_cuda
    return DDP(model, device_ids=[ranks.local_rank] if cuda else None)


def deepspeed_initialize(model, optimizer, cfg: Config):
    """A DeepSpeed engine around `model` and our optimizer, with the exported config's batch numbers.

    The exported JSON's optimizer/scheduler blocks are for the deepspeed launcher alone; here the
    trainer's own AdamW and schedule are passed in, so both sides use one definition of each.
    """
    try:
        import deepspeed
    except ImportError:
        raise ConfigError("distributed.strategy=deepspeed needs DeepSpeed: pip install 'trainfit[deepspeed]'.") from None


    check_launch(cfg)  # the ZeRO stages and offload settings the trainer runs
    zero.ensure_op_cache()  # before DeepSpeed's comm init, which loads its CPU comm op
    ds_cfg = {k: v for k, v in deepspeed_config(cfg).items() if k not in ("optimizer", "scheduler")}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_cfg)
    zero.register(model, engine)  # stages hold `model`: full_weights finds its engine
    return engine


def full_weights(model):
    """Context: ZeRO-3 parameters gathered whole with the partition hooks off (a collective to enter);
    a no-op for every other model. See zero.py."""
    return zero.full_weights(model)


def rollout_weights(model, cfg: Config):
    """Context for a rollout (sync, generation, scoring forwards): ZeRO-3 gathers `model` whole only where
    `cfg.rollout_gathers_whole()` (the hf engine generates with this module); else nothing is gathered
    here (the sync gathers a tensor at a time, the scoring forwards a layer at a time under the hooks)."""
    return zero.full_weights(model) if cfg.rollout_gathers_whole() else contextlib.nullcontext()


def states_asleep(model, cfg: Config) -> zero.StatesAsleep:
    """What `distributed.offload_train_states_during_rollout` puts to sleep for generation (a no-op object
    when it is off or `model` has no ZeRO-3 engine)."""
    return zero.StatesAsleep(model if cfg.distributed.offload_train_states_during_rollout else None)


def is_zero3(model) -> bool:
    """`model` (raw module or engine) is partitioned by a DeepSpeed ZeRO-3 engine."""
    return zero.zero3_engine(model) is not None


def is_deepspeed(model) -> bool:
    return type(model).__name__ == "DeepSpeedEngine"


def is_sharded(model) -> bool:
    """`model` (or each model of PPO's pair) is sharded by FSDP2."""
    return bool(fsdp.fsdp_roots(model))


def collective_forward(model) -> bool:
    """True when every rank must join every forward (sharded parameters are gathered in it)."""
    return is_sharded(model)


@contextlib.contextmanager
def gradient_sync(model, sync: bool):
    """Skip the gradient all-reduce / reduce-scatter on all but the last micro-step of a step."""
    if sync or is_deepspeed(model):              # DeepSpeed syncs at its own accumulation boundary
        yield
    elif hasattr(model, "no_sync"):              # DDP
        with model.no_sync():
            yield
    elif is_sharded(model) and not fsdp.offloaded(model):   # FSDP2 (each root of PPO's pair)
        # Offloaded shards are reduce-scattered at every micro-step instead: skipping the sync would keep
        # every layer's whole gradient on the device until the last one, what the offload is there to avoid.
        fsdp.set_requires_gradient_sync(model, False)
        try:
            yield
        finally:
            fsdp.set_requires_gradient_sync(model, True)
    else:
        yield


def clip_grad_norm(model, params: list, max_norm: float) -> torch.Tensor:
    """The gradient norm of `params`, clipped to `max_norm` (torch.nn.utils.clip_grad_norm_; offloaded FSDP2
    shards through fsdp.clip_offloaded, whose norm is reduced on the mesh's device)."""
    if is_sharded(model) and fsdp.offloaded(model):
        return fsdp.clip_offloaded(params, max_norm)
    return torch.nn.utils.clip_grad_norm_(params, max_norm)


def checkpoint_state(model, is_peft: bool) -> Optional[dict]:
    """What a single process's checkpoint holds (the adapters under peft, PPO's policy. / critic.
    keys), gathered from the shards onto rank 0; None elsewhere. A collective."""
    sd = fsdp.trainable_state(model, is_peft, tie_aware)
    return sd if sd else None


def full_optimizer_state(model, optimizer) -> Optional[dict]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    sd = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return sd if sd else None


def load_full_state(model, optimizer, model_state: dict, optimizer_state: dict, is_peft: bool = False) -> None:
    """Scatter a checkpoint's weights (`checkpoint_state`'s keys) and full optimizer state (read by every
    rank) into the shards, or into a plain module (an FSDP run resumed on one process)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    named, whole = fsdp.to_names(model, is_peft, model_state)
    config = getattr(model, "config", None)
    if whole and "lm_head.weight" not in named and getattr(config, "tie_word_embeddings", False):
        named["lm_head.weight"] = named["model.embed_tokens.weight"]   # saved once (tie_aware)
    opts = StateDictOptions(full_state_dict=True, strict=whole)
    set_model_state_dict(model, named, options=opts)
    set_optimizer_state_dict(model, optimizer, optimizer_state, options=opts)


def tie_aware(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the LM head when it is a copy of the (tied) embeddings, as safetensors files keep one."""
    head, emb = state.get("lm_head.weight"), state.get("model.embed_tokens.weight")
    if head is not None and emb is not None and torch.equal(head, emb):
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    return state
