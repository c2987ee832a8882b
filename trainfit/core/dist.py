"""torch.distributed wiring: ranks from the launcher, process-group set-up, rank-0 helpers, relaunch.

`trainfit train cfg.yaml` with distributed.num_gpus x num_nodes > 1 re-launches itself under torchrun
(the elastic launcher); started by the user under `torchrun` or the `deepspeed` launcher it reads
RANK / LOCAL_RANK / WORLD_SIZE and runs as one rank. On CPU the backend is gloo (tests, laptops),
on CUDA nccl. The math does not depend on the rank count: see train/loop.py.

torch is imported inside the functions that need it: `plan`, `fit` and the checks before a launch read
the ranks, ports and torchrun command from here without it (`trainfit plan` answers without torch).
"""

from __future__ import annotations

import datetime
import os
import sys
from dataclasses import dataclass
from typing import Any, Optional

from trainfit.config import Config, ConfigError, DistributedConfig, TrainConfig
from trainfit.core.ports import DEFAULT_PORT, free_port, port_free


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


SINGLE = Ranks()


def launched_ranks() -> Optional[Ranks]:
    """The ranks a launcher (torchrun, deepspeed, mpirun with the usual variables) set, else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    return Ranks(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))


def resolve_port(d: DistributedConfig) -> int:
    """distributed.master_port: `auto` takes $MASTER_PORT (else torchrun's 29500) if free, else any free one."""
    p = d.master_port
    if p == "auto":
        first = int(os.environ.get("MASTER_PORT") or DEFAULT_PORT)
        return first if port_free(first) else free_port()
    if d.num_nodes == 1 and not port_free(int(p)):
        raise ConfigError(f"distributed.master_port={p} is already in use on this machine (another run?); set "
                          f"distributed.master_port=auto to pick a free one, or e.g. {free_port()}.")
    return int(p)


# Seconds torchrun waits for the ranks to checkpoint and exit after a signal before it kills them.
SHUTDOWN_GRACE_S = 900


def torchrun_command(d: DistributedConfig, argv: list[str], port: int) -> list[str]:
    """The torchrun command line that runs `trainfit <argv>` on every GPU (or CPU process) of this node."""
    # A Ctrl-C / SIGTERM lets the ranks finish their step and write a checkpoint (train/interrupt.py); torchrun
    # SIGKILLs ranks still running after its shutdown timeout, 30 s by default, too short for a large model's
    # checkpoint. $TORCH_ELASTIC_SHUTDOWN_TIMEOUT, when set, is the user's own choice.
    grace = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT") or str(SHUTDOWN_GRACE_S)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={d.num_gpus}",
           f"--nnodes={d.num_nodes}", f"--node_rank={d.node_rank}",
           f"--master_addr={d.master_addr}", f"--master_port={port}", f"--shutdown-timeout={grace}"]
    return cmd + ["-m", "trainfit.app.cli", *argv]


def node_commands(d: DistributedConfig, argv: list[str], port: int) -> list[str]:
    """One printable command per node, for multi-node runs."""
    return [" ".join(torchrun_command(d.model_copy(update={"node_rank": n}), argv, port)) for n in range(d.num_nodes)]


def uses_cuda(t: TrainConfig) -> bool:
    """train.device as the ranks will run it: `cpu` stays on CPU (gloo) even when a GPU is visible."""
    if t.device != "auto":
        return t.device == "cuda"
    import torch

    return torch.cuda.is_available()


def init(cfg: Config) -> Ranks:
    """Join the process group when launched with several ranks; check the launcher agrees with cfg."""
    import torch
    import torch.distributed as dist

    ranks = launched_ranks()
    if ranks is None or (ranks.world == 1 and cfg.engine() != "deepspeed"):
        return SINGLE
    if ranks.world != cfg.world_size:
        raise ConfigError(f"the launcher started {ranks.world} ranks but the config asks for "
                          f"distributed.num_gpus x num_nodes = {cfg.world_size}; make them agree (e.g. "
                          f"distributed.num_gpus={ranks.world // cfg.distributed.num_nodes}).")
    cuda = uses_cuda(cfg.train)
    if cuda:
        torch.cuda.set_device(ranks.local_rank)
    elif cfg.engine() == "deepspeed":
        # DeepSpeed picks its accelerator by itself (CUDA whenever one is visible) and would move a
        # train.device=cpu run onto the GPU; its CPU accelerator keeps it where the config says.
        os.environ["DS_ACCELERATOR"] = "cpu"
    timeout = datetime.timedelta(seconds=cfg.distributed.timeout_s)
    if not dist.is_initialized():
        try:
            dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout,
                                    **({"device_id": torch.device("cuda", ranks.local_rank)} if cuda else {}))
        except (RuntimeError, dist.DistBackendError) as e:  # rendezvous failures
            raise ConfigError(
                f"rank {ranks.rank} could not join the process group at {os.environ.get('MASTER_ADDR')}:"
                f"{os.environ.get('MASTER_PORT')} within distributed.timeout_s={cfg.distributed.timeout_s}: {e}. "
                "Check that every node runs its command, that master_addr is reachable and the port open.") from None
    return ranks


def barrier(ranks: Ranks) -> None:
    if ranks.distributed:
        import torch.distributed as dist

        dist.barrier()


def all_reduce_sum(values: dict[str, float], ranks: Ranks) -> dict[str, float]:
    """Sum float metrics over ranks (float64 on CPU, so sums of counts stay exact)."""
    if not ranks.distributed or not values:
        return dict(values)
    import torch
    import torch.distributed as dist

    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t)
    return {k: float(v) for k, v in zip(keys, t.tolist())}


def all_gather_objects(obj: Any, ranks: Ranks) -> list[Any]:
    if not ranks.distributed:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * ranks.world
    dist.all_gather_object(out, obj)
    return out


def shutdown(ranks: Ranks, code: int = 0) -> None:
    """Leave the process group after a finished run. Every rank waits for the others first, so none tears
    its connections down while a peer still talks to it. A rank other than 0 then ends at once
    (os._exit after flushing): it owns no file (rank 0 writes them), and gloo's worker threads can abort
    the interpreter's teardown ("terminate called without an active exception", SIGABRT; seen in CI on a
    loaded 2-core machine after a 2-rank FSDP run had saved everything), failing a finished run. `code`: that
    rank's exit status (a run stopped by a signal ends with 128 + the signal)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if ranks.distributed:
        dist.barrier()
    dist.destroy_process_group()
    if ranks.distributed and not ranks.main:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def zero3_partitioned(p) -> bool:
    """A DeepSpeed ZeRO-3 parameter whose data is this rank's partition alone (not gathered now)."""
    return getattr(getattr(p, "ds_status", None), "name", "") == "NOT_AVAILABLE"


def full_tensor(t):
    """`t` whole: an FSDP2 DTensor's shards all-gathered (a collective: every rank of its mesh calls it), any
    other tensor as it is. A shard FSDP2's CPU offload keeps in CPU RAM is gathered on its mesh's device (NCCL
    serves no CPU tensors; on a gloo mesh that is the CPU already)."""
    if not hasattr(t, "full_tensor"):
        return t
    if t.device.type != t.device_mesh.device_type:
        t = t.to(t.device_mesh.device_type)
    return t.full_tensor()
