"""The final save of a sharded model (FSDP2, DeepSpeed ZeRO-3): each tensor gathered whole only when rank 0
writes it, so rank 0 holds one safetensors shard at most, never the model.

    save_final_model(model, is_peft, ranks, final_dir, ckpt_root, save, console)   # every rank calls it

The final dir is written as `.tmp-final` and renamed once whole; a failed write (a full disk) removes it and
stops the run with storage.py's paragraph (exit 2): the last checkpoint is kept and `--resume` continues.

Rank 0 runs the save with a `LazyWeights` of the model's tensors (names and sizes known from the shards'
metadata, nothing gathered yet). Each tensor it reads is named to the other ranks (a broadcast), and all
ranks gather it together (FSDP2: the DTensor's all-gather; ZeRO-3: that one parameter's); the other ranks
serve these requests until rank 0 is done, however its save ended. What the save does not read is never
gathered: an adapter run reads its adapters (and the base only where trainfit must save one beside them,
models/save.py), so a 72B frozen base is not moved.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from trainfit.core.dist import Ranks, all_gather_objects, full_tensor
from trainfit.models.save_shards import LazyWeights
from trainfit.models.state import trainable_state
from trainfit.train import fsdp, zero
from trainfit.train.checkpoint import refuse_nonfinite
from trainfit.train.storage import DiskWriteError, guarded_write

_DONE = "\0done"   # not a tensor name: the end of rank 0's requests


def save_final_model(model, is_peft: bool, ranks: Ranks, final_dir: Path, ckpt_root: Path,
                     save: Callable[..., Any], console, from_module: bool = False) -> None:
    """Rank 0 writes the final model with `save(dir)`, or for weights sharded over the ranks `save(dir,
    state_dict=LazyWeights)` while every rank serves its gathers. Non-finite weights are refused first; a
    failed write raises DiskWriteError on every rank. A collective: every rank calls it.

    `from_module`: the stage's save reads the module's own weights (it merges adapters into them, or saves a
    critic sharing the policy's base); FSDP2 does not run such stages, and under ZeRO-3 every parameter is
    gathered whole into the module for it (zero.full_weights), as it was before saves streamed."""
    sharded = sharded_kind(model)
    if sharded == "zero3" and from_module:
        with zero.full_weights(model):
            _write_final(model, is_peft, ranks, final_dir, ckpt_root, save)
        return
    _write_final(model, is_peft, ranks, final_dir, ckpt_root, save, sharded, console)


def _write_final(model, is_peft: bool, ranks: Ranks, final_dir: Path, ckpt_root: Path, save: Callable[..., Any],
                 sharded: Optional[str] = None, console=None) -> None:
    """`sharded`: the kind of shards rank 0's save reads through gathers; None: it reads the module itself."""
    if sharded:
        refuse_nonfinite_shards(model, ranks, "final model")
    else:
        refuse_nonfinite(trainable_state(model, is_peft) if ranks.main else {}, ranks, "final model")
    tmp = final_dir.with_name(".tmp-" + final_dir.name)
    error = None
    try:
        with guarded_write("the final model", ckpt_root, tmp):
            if ranks.main:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            if sharded:
                weights = write_gathered(model, ranks, lambda w: save(tmp, state_dict=w))
                if weights is not None:
                    console.print(f"[dim]{gathered_line(weights)}[/]", highlight=False)
            elif ranks.main:
                save(tmp)
            if ranks.main:
                _publish(tmp, final_dir)
    except DiskWriteError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        error = str(e)
    error = next((e for e in all_gather_objects(error, ranks) if e), None)
    if error is not None:
        raise DiskWriteError(error)


def _publish(tmp: Path, final_dir: Path) -> None:
    """The whole new final dir in place of an earlier one (a resumed run that saved before)."""
    if final_dir.exists():
        old = final_dir.with_name(".old-" + final_dir.name)
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final_dir, old)
        os.replace(tmp, final_dir)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final_dir)


def sharded_kind(model) -> Optional[str]:
    """"fsdp" or "zero3" when `model`'s weights are spread over the ranks (the final save gathers them), else None."""
    if fsdp.fsdp_roots(model):
        return "fsdp"
    return "zero3" if zero.zero3_engine(model) is not None else None


def _tensors(model) -> dict[str, torch.Tensor]:
    """Every tensor the model's files hold, by its state_dict name (FSDP2: DTensors; ZeRO-3: parameters whose
    data is empty outside a gather); a tied one (an LM head sharing the embeddings) under its first name
    only, as transformers saves it."""
    sd = model.state_dict(keep_vars=True)
    return {k: sd[k] for k in fsdp.unique_state_names(model)}


def _shape(t: torch.Tensor) -> torch.Size:
    return getattr(t, "ds_shape", None) or t.shape   # ZeRO-3 keeps the whole shape aside


def _gather(t: torch.Tensor, kind: str, main: bool) -> Optional[torch.Tensor]:
    """`t` whole, on CPU on rank 0 (None elsewhere). A collective for a sharded tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        whole = full_tensor(t)
    elif kind == "zero3" and hasattr(t, "ds_id"):
        from deepspeed.runtime.zero import GatheredParameters

        with GatheredParameters([t]):
            return t.data.detach().cpu().clone() if main else None
    else:
        whole = t
    return whole.detach().cpu().clone() if main else None


def write_gathered(model, ranks: Ranks, write: Callable[[LazyWeights], Any]) -> Optional[LazyWeights]:
    """Rank 0 runs `write(weights)`, gathering each tensor it reads with every rank; the others serve those
    gathers until it is done. Returns rank 0's LazyWeights (what it read is in `.read`), None elsewhere. An
    error in `write` ends the gathers first (so no rank waits in one) and is raised on rank 0."""
    import torch.distributed as dist

    kind = sharded_kind(model)
    tensors = _tensors(model)

    def request(name: str) -> None:
        box = [name]
        dist.broadcast_object_list(box, src=0)

    if not ranks.main:
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            if box[0] == _DONE:
                return None
            _gather(tensors[box[0]], kind, main=False)

    def fetch(name: str) -> torch.Tensor:
        request(name)
        return _gather(tensors[name], kind, main=True)

    weights = LazyWeights([(k, _shape(t).numel(), t.element_size()) for k, t in tensors.items()], fetch)
    try:
        write(weights)
    finally:
        request(_DONE)
    return weights


def refuse_nonfinite_shards(model, ranks: Ranks, what: str) -> None:
    """NonFiniteStop on every rank when any rank's shards hold a NaN or inf (a collective): checked where the
    weights lie, before anything is gathered or written."""
    kind = sharded_kind(model)
    local = {k: t.to_local() if hasattr(t, "to_local") else getattr(t, "ds_tensor", t) if kind == "zero3" else t
             for k, t in _tensors(model).items()}
    refuse_nonfinite(local, ranks, what, every_rank=True)


def gathered_line(weights: LazyWeights) -> str:
    """What the final save gathered, for the console (and the tests that check an adapter run gathers no base):
    'final save gathered 12 of 180 tensors from the shards (0.1 of 24.0 MiB), one at a time'."""
    mib = 2 ** 20
    total = sum(n for _, n in weights.sizes)
    return (f"final save gathered {len(weights.read)} of {len(weights.sizes)} tensors from the shards "
            f"({weights.read_bytes() / mib:.1f} of {total / mib:.1f} MiB), one at a time")
