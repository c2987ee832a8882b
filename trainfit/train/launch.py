"""What can be known before starting any rank: checked by the launcher (train/parallel.py) and preflight."""

from __future__ import annotations

import os

from trainfit.config import Config, ConfigError
from trainfit.core import dist, machine
from trainfit.plan import plan
from trainfit.models.runnable import not_trainable, require_extras


def check_launch(cfg: Config) -> None:
    """What can be known before starting any rank: the engine's package, the device count, and the CPU RAM
    that offload needs on a GPU machine (check_cpu_ram below)."""
    reason = not_trainable(cfg)
    if reason:
        raise ConfigError(reason)
    require_extras(cfg)
    want = cfg.distributed.num_gpus
    if not dist.uses_cuda(cfg.train):
        return  # CPU processes: any count works (gloo)
    import torch  # here, not at the top: `trainfit plan` imports this module's checks without torch

    have = torch.cuda.device_count()
    if have < want:
        raise ConfigError(f"distributed.num_gpus={want} but only {have} CUDA device(s) are visible "
                          f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}); "
                          f"set distributed.num_gpus={max(have, 1)} or make the GPUs visible.")
    if cfg.engine() == "deepspeed":  # offloaded states must fit this machine's RAM (train/zero.py)
        check_cpu_ram(cfg)


def check_cpu_ram(cfg: Config) -> None:
    """Refuse (ConfigError, exit 2) an offloading config whose planned CPU RAM per node exceeds this
    machine's total RAM, naming both and the shortfall. Nothing is checked when the planner cannot
    plan the model here (e.g. its config is not cached: the run itself would say so)."""
    d = cfg.distributed
    if not (d.offload_optimizer or d.offload_params):
        return
    total, available = (machine.cpu_ram()[k] for k in ("total", "available"))
    try:
        need = plan(cfg, suggest=False).cpu_ram  # offloaded states of this node's num_gpus ranks
    except ConfigError:
        return
    if total is None or need <= total:
        return
    gib = 2 ** 30
    raise ConfigError(
        f"distributed.offload_optimizer={d.offload_optimizer} / offload_params={d.offload_params} keep about "
        f"{need / gib:.1f} GiB in CPU RAM on this node ({d.num_gpus} rank(s), as `trainfit plan` counts it), "
        f"but this machine has {total / gib:.1f} GiB ({(available or 0) / gib:.1f} GiB available): short by "
        f"{(need - total) / gib:.1f} GiB. Offload less (offload_params=false), shard over more nodes, train "
        "adapters (peft.method=lora), or run on a machine with more RAM (`trainfit fit --cpu-ram-gb` plans "
        "within a given amount).")
