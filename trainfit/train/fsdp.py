"""FSDP2 (`fully_shard`) over the trained module: full weights, LoRA/DoRA adapters, PPO's policy + critic.

    roots = shard(model, world)        # every decoder layer its own group, then each root
    sd = trainable_state(model, is_peft)   # rank 0: the checkpoint's weights, gathered (a collective)

Every decoder layer (the classes a transformers model names in `_no_split_modules`) is one group:
its parameters are all-gathered together for its forward and its gradients reduce-scattered together.
FSDP2 keeps each parameter a DTensor of its own, so a layer may hold a frozen base (bf16) beside
trainable adapters (fp32): only the trainable ones get gradients and optimizer state, and the dtype
FSDP requires to be uniform is that of the trainable ones (all the adapters'). The rest of a model
(embeddings, final norm, LM head, a value head) is its root's group.

A module of several models (PPO's `PolicyCritic`) gets one root per model, not one over both: the
stage calls the policy and the critic apart (old log-probs, values, generation), and FSDP2 unshards
a root's own parameters only when that root's forward runs.

Checkpoints keep the files a single process writes: the trainable tensors gathered to rank 0 under
the names `models.state.trainable_state` gives them (a peft adapter's saved keys, `policy.` /
`critic.` for PPO), never the frozen base; a resume scatters them back into the shards.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch import nn


def layer_types(model: nn.Module) -> set[str]:
    """Class names of the decoder layers of every transformers model inside `model` (a peft model, a
    value model's backbone and PPO's pair included)."""
    out: set[str] = set()
    for m in model.modules():
        out.update(getattr(m, "_no_split_modules", None) or ())
    return out


def roots_of(model: nn.Module) -> list[nn.Module]:
    """The modules that get a root group: each model of a multi-model module, else the module itself."""
    if hasattr(model, "trainable_state_dict"):   # value_model.PolicyCritic: its policy and its critic
        return [model.policy, model.critic]
    return [model]


def shard(model: nn.Module, world: int, offload: bool = False) -> list[nn.Module]:
    """Shard `model` in place over `world` ranks; returns its FSDP roots. `offload` (distributed.offload_params):
    every group keeps its shards, their gradients and so the optimizer state in CPU RAM (CPUOffloadPolicy);
    a layer is copied to the device for its forward and backward, pinned for the copy when CUDA is there."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    # The mesh lives where the model does: FSDP2's default mesh is on the accelerator whenever one
    # is visible, which would move a train.device=cpu (gloo) run's shards onto the GPU.
    device = next(model.parameters()).device.type
    mesh = init_device_mesh(device, (world,))
    # Pinned host memory makes the copies asynchronous; it exists only beside CUDA.
    policy = CPUOffloadPolicy(pin_memory=device == "cuda") if offload else OffloadPolicy()
    names = layer_types(model)
    for module in model.modules():
        if type(module).__name__ in names and any(True for _ in module.parameters()):
            fully_shard(module, mesh=mesh, offload_policy=policy)
    roots = roots_of(model)
    for root in roots:
        fully_shard(root, mesh=mesh, offload_policy=policy)
        if offload:
            _OFFLOADED.add(root)
    return roots


_OFFLOADED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()   # the roots `shard` offloaded


def offloaded(model: nn.Module) -> bool:
    """`shard` keeps `model`'s shards in CPU RAM (offload=True)."""
    return any(r in _OFFLOADED for r in roots_of(model))


def clip_offloaded(params: list, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over offloaded shards: the global norm of the gradients of `params`, and
    the gradients scaled to at most `max_norm` (inf: unscaled). torch's own reduces the shards' norms with a
    collective on the gradients' device, the CPU, which NCCL does not serve; here each rank sums its shards'
    squares on the CPU and only that number crosses to the mesh's device for the all-reduce."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    mesh = next(g.device_mesh for g in grads if isinstance(g, DTensor))
    squares = torch.stack([torch.linalg.vector_norm(t, dtype=torch.float32) for t in local]).square().sum()
    squares = squares.to(mesh.device_type)
    dist.all_reduce(squares, group=mesh.get_group())
    norm = squares.sqrt().cpu()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for t in local:
        t.mul_(coef)
    return norm


def fsdp_roots(model: nn.Module) -> list[nn.Module]:
    """The FSDP roots `shard` made inside `model` ([] when it is not sharded)."""
    from torch.distributed.fsdp import FSDPModule

    return [r for r in roots_of(model) if isinstance(r, FSDPModule)]


def _options(trainable_only: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)


def full_state(model: nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """Full (unsharded) tensors by name on rank 0 ({} elsewhere): every tensor, or the trainable ones
    only (adapters: the frozen base is never gathered). A collective: every rank calls it."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(trainable_only))


def _adapter_names(model: nn.Module) -> dict[str, str]:
    """{saved key: parameter name} of a peft model's adapters: the keys `get_peft_model_state_dict`
    writes (adapter name dropped, peft's own renames) for the names the module holds."""
    from peft import get_peft_model_state_dict

    names = [n for n, p in model.named_parameters() if p.requires_grad]
    index = {n: torch.tensor(i) for i, n in enumerate(names)}   # peft renames keys: follow each by its index
    return {k: names[int(v)] for k, v in get_peft_model_state_dict(model, state_dict=index).items()}


def saved_names(model: nn.Module, is_peft: bool) -> Optional[dict[str, str]]:
    """{checkpoint key: parameter name} for what `models.state.trainable_state` saves of `model`, or None
    when it saves every tensor under its own name (a full fine-tune)."""
    if hasattr(model, "trainable_state_dict"):   # PolicyCritic: policy.<its keys>, critic.<trainable names>
        pol = saved_names(model.policy, model.is_peft)
        out = ({f"policy.{k}": f"policy.{v}" for k, v in pol.items()} if pol is not None
               else {f"policy.{n}": f"policy.{n}" for n in unique_state_names(model.policy)})
        out.update({f"critic.{n}": f"critic.{n}" for n, p in model.critic.named_parameters() if p.requires_grad})
        return out
    return _adapter_names(model) if is_peft else None


def unique_state_names(model: nn.Module) -> list[str]:
    """state_dict names, a tied tensor (embeddings = LM head) under its first name only, as saved."""
    seen, out = set(), []
    for k, v in model.state_dict(keep_vars=True).items():
        if id(v) not in seen:
            seen.add(id(v))
            out.append(k)
    return out


def trainable_state(model: nn.Module, is_peft: bool, tie_aware) -> dict[str, torch.Tensor]:
    """What a single process's checkpoint holds (`models.state.trainable_state`), gathered from the
    shards onto rank 0 ({} elsewhere). A collective."""
    names = saved_names(model, is_peft)
    if names is None:
        return tie_aware(full_state(model))
    sd = full_state(model, trainable_only=not _whole_policy(model))
    return {k: sd[v].contiguous() for k, v in names.items()} if sd else {}


def _whole_policy(model: nn.Module) -> bool:
    """PPO with a full fine-tune: the policy's every tensor is saved (buffers too), so gather them all."""
    return hasattr(model, "trainable_state_dict") and not model.is_peft


def to_names(model: nn.Module, is_peft: bool, sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], bool]:
    """A checkpoint's weights (`trainable_state`'s keys) by parameter name, and whether they are the
    whole model (strict loading) or its trainable part."""
    names = saved_names(model, is_peft)
    if names is None:
        return sd, True
    return {names[k]: v for k, v in sd.items()}, False


def set_requires_gradient_sync(model: nn.Module, sync: bool) -> None:
    for root in fsdp_roots(model):
        root.set_requires_gradient_sync(sync)


