"""The colocated vLLM engine's place among the trainer's ranks (vLLM's `external_launcher` executor).

Under torchrun vLLM joins the trainer's process group instead of starting one: its world is the trainer's
world, and it cuts it into tensor-parallel groups of `tensor_parallel_size` consecutive ranks
(vllm/distributed/parallel_state.py initialize_model_parallel: ranks reshaped [-1, dp, pp, tp]), each group
one engine whose ranks hold a shard each and must be fed the same requests. `tp_groups` is that cut.

vLLM's engine core, when it shuts down (closed, collected, or at the interpreter's exit), tears the
distributed environment down: its own groups, then torch's default process group
(parallel_state.destroy_distributed_environment), which under torchrun is the trainer's. A stage whose
engine goes while the run goes on (the next stage, the final save, the last barrier) would lose it, and a
finaliser that runs after the trainer left the group fails on the groups it finds gone ("Invalid process
group specified"). `own_teardown` replaces that finaliser with one that leaves the default group to whoever
started it.
"""

from __future__ import annotations

import os
import socket
import weakref
from contextlib import contextmanager
from typing import Optional

import torch

from trainfit.rollout.base import EngineError


def dist_ranks() -> tuple[int, int, int]:
    """(rank, local rank, world size) of this trainer process."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return (torch.distributed.get_rank(), int(os.environ.get("LOCAL_RANK", 0)), torch.distributed.get_world_size())
    return 0, 0, 1


def launcher_env() -> None:
    """external_launcher reads torchrun's variables; a plain `python` run is a world of one."""
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    # The engine core must run in this process for the trainer to reach its model (weight sync).
    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1"),
                 ("VLLM_ENABLE_V1_MULTIPROCESSING", "0")):
        os.environ.setdefault(k, v)


def tp_groups(world: int, tp: int) -> list[list[int]]:
    """The ranks of each engine: groups of `tp` consecutive ranks, as vLLM cuts the world (above)."""
    return [list(range(i * tp, (i + 1) * tp)) for i in range(world // tp)]


def _shutdown_core(core) -> None:
    dist = torch.distributed
    if not dist.is_initialized():   # the trainer left its group, and vLLM's subgroups went with it
        return
    destroy = dist.destroy_process_group

    def destroy_but_the_default(group=None):
        if group is not None and group is not dist.GroupMember.WORLD:
            destroy(group)

    dist.destroy_process_group = destroy_but_the_default
    try:
        core.shutdown()
    finally:
        dist.destroy_process_group = destroy


def own_teardown(llm) -> Optional[weakref.finalize]:
    """Give vLLM's in-process engine core (`llm`: a vllm.LLM) a shutdown that keeps torch's default process
    group, run when the client is collected or at exit, or by calling what this returns (once); None where
    this vLLM has no such finaliser (another release: its own teardown stays)."""
    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    finalizer = getattr(client, "_finalizer", None)
    core = getattr(client, "engine_core", None)
    if not isinstance(finalizer, weakref.finalize) or core is None or finalizer.detach() is None:
        return None
    # The callback must not hold the client, or the client would never be collected.
    client._finalizer = weakref.finalize(client, _shutdown_core, core)
    return client._finalizer


@contextmanager
def cpu_shm_named(tp: int):
    """vLLM's CPU build runs a tensor-parallel group's all-reduces through shared memory named after the
    group's ranks alone (vllm/distributed/device_communicators/cpu_communicator.py make_group_name: its
    instance part comes from the init method, always "env://" under external_launcher), so a second such run
    on this machine, or the segments a killed one left, make vLLM's start fail with errno 17 (EEXIST). Say so."""
    try:
        yield
    except RuntimeError as e:
        if tp < 2 or "SHMManager" not in str(e):
            raise
        raise EngineError(
            f"vLLM's CPU build could not create the shared memory of its tensor-parallel group ({e}): vLLM names "
            "it after the group's ranks only, so another run with rollout.tensor_parallel_size > 1 on this machine "
            "holds the same names, or a run that was killed left them behind. Wait for the other run, or remove "
            "the leftovers (ls /dev/shm/*cpushm*) when no vLLM runs here.") from e
