"""How PPO's and GRPO's frozen models (the reference copy of the policy, the reward model) are spread over ranks.

    ref = spread(copy.deepcopy(policy).eval().requires_grad_(False), cfg, ranks)
    for chunk, real in even_chunks(samples, micro, ranks, is_spread(ref)):
        out = ref(chunk)          # every rank runs as many forwards; a repeated chunk's (real False) is dropped

One process, DDP and ZeRO-1/2 keep them whole on every rank, as they keep the trained weights. When the
trained module is sharded over several ranks (`Config.frozen_sharding`, which the planner reads too) they
are sharded the same way, with nothing to train:
- FSDP2: every decoder layer and the root `fully_shard`ed on the training mesh (fsdp.shard); no gradients,
  no optimizer state. The root reshards after its forward too (FSDP2 keeps a root whole after forward
  for the backward that follows; a frozen model has none).
- DeepSpeed ZeRO-3: an engine without an optimizer, from the run's own ZeRO-3 config (OpenRLHF's eval
  engines): every parameter partitioned, gathered layer by layer in the forward by hooks on the module,
  so the module is called as itself.
With rl_models.offload_frozen (or ZeRO-3's offload_params) the shards stay in CPU RAM and each layer is
copied to the GPU for its forward (`Config.frozen_offload`; verl's param offload of ref and reward).
A rank then holds 1/N of each frozen model plus the layers its forward gathers, as plan/components.py
`scoring_models` plans them.

Their forwards are collectives (a layer is all-gathered in each), so every rank must run the same number:
the stages take their chunks from `even_chunks`, as generation runs with synced_gpus.
"""

from __future__ import annotations

import weakref
from typing import Iterator

import torch
from torch import nn

from trainfit.config import Config
from trainfit.core.dist import Ranks, all_gather_objects
from trainfit.train import fsdp, zero
from trainfit.train.ds_config import deepspeed_config

# The frozen modules `spread` sharded (weak: a finished stage's models are not kept alive here).
_SPREAD: "weakref.WeakSet" = weakref.WeakSet()


def spread(model: nn.Module, cfg: Config, ranks: Ranks) -> nn.Module:
    """`model` (frozen, eval mode) sharded in place like the trained module, or as it is when that is whole."""
    how = cfg.frozen_sharding() if ranks.distributed else ""
    if how == "fsdp":
        # rl_models.offload_frozen: the shards in CPU RAM, each layer's copied over for its all-gather.
        for root in fsdp.shard(model, ranks.world, offload=cfg.frozen_offload()):
            root.set_reshard_after_forward(True)
    elif how == "zero3":
        _zero3(model, cfg)
    if how:
        _SPREAD.add(model)
    return model


def is_spread(model) -> bool:
    """`model` is a frozen model `spread` sharded: each of its forwards is a collective."""
    return model is not None and model in _SPREAD


def _zero3(model: nn.Module, cfg: Config) -> None:
    """Partition `model` with a DeepSpeed ZeRO-3 engine that has no optimizer; it keeps its own dtype."""
    import deepspeed

    zero.ensure_op_cache()
    ds = {k: v for k, v in deepspeed_config(cfg).items() if k not in ("optimizer", "scheduler")}
    ds["zero_optimization"] = {k: v for k, v in ds["zero_optimization"].items() if k != "offload_optimizer"}
    if cfg.frozen_offload():   # offload_params (already in the config) or rl_models.offload_frozen
        ds["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
    # DeepSpeed casts the module to the precision its config enables: the frozen model's own (a reward
    # model may be loaded in another dtype than the policy's).
    dtype = next(model.parameters()).dtype
    ds["bf16"] = {"enabled": dtype == torch.bfloat16}
    ds["fp16"] = {"enabled": dtype == torch.float16}
    engine, *_ = deepspeed.initialize(model=model, config=ds)
    # The engine owns the partition hooks and removes them when collected; the module keeps it alive
    # (a plain attribute, not a submodule: the engine is an nn.Module that holds `model`).
    object.__setattr__(model, "_zero3_engine", engine)
    model.eval()


def even_chunks(items: list, size: int, ranks: Ranks, collective: bool) -> Iterator[tuple[list, bool]]:
    """`items`, `size` at a time, as (chunk, real). With `collective` forwards every rank gets as many
    chunks as the rank with the most (their counts are gathered): the extra ones repeat its last chunk,
    with real False (run the forward, drop its result)."""
    size = max(size, 1)
    parts = [items[i:i + size] for i in range(0, len(items), size)]
    n = max(all_gather_objects(len(parts), ranks)) if collective and ranks.distributed else len(parts)
    for i in range(n):
        yield (parts[i], True) if i < len(parts) else (parts[-1], False)
