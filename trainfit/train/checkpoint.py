"""Atomic checkpoints: everything needed to continue a run exactly where it stopped.

Layout under `<stage_dir>/checkpoints/`:
  step-000040/            one finished checkpoint (written as .tmp-step-000040, then renamed)
    model.safetensors     trainable weights (the adapter's when PEFT is on)
    optimizer.pt, scheduler.pt, rng.pt, state.json (step, world size), stage-rank<r>.pt (per rank)
    deepspeed/            DeepSpeed's own files, under DeepSpeed
    manifest.json         size and SHA-256 of every file above (ckpt_manifest.py)
  latest                  a text file naming the newest finished checkpoint (replaced atomically)
  damaged-step-000060/    one that failed its manifest at a resume, moved aside (ckpt_manifest.resume_point)

A crash at any point leaves `latest` naming a complete checkpoint: the directory is renamed into place
only after every file in it is flushed and its manifest written, and `latest` is rewritten with
os.replace after that. A write that fails (a full disk: ENOSPC) removes the partial directory and stops
the run with CheckpointWriteError, saying how much space a checkpoint takes (storage.write_failure);
`latest` still names the previous one. `--resume` verifies `latest` against its manifest and falls back
to the newest older one that verifies.

Loading never runs pickled code: every .pt file is read with `torch.load(weights_only=True)`, which
rebuilds tensors, numbers, strings and plain containers only (plus the one trainfit dataclass that
GRPO's rollout buffer is, allowlisted by name). A file that names any other Python callable (a
checkpoint written by someone else, made to run code on load) is refused with a ConfigError.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from safetensors.torch import load_file

from trainfit.config import ConfigError
from trainfit.core.dist import SINGLE, Ranks, all_gather_objects, all_reduce_sum, barrier
from trainfit.models.save_shards import save_safetensors
from trainfit.models.state import load_trainable_state, trainable_state
from trainfit.train import parallel
from trainfit.train.ckpt_manifest import (LATEST, MANIFEST, fsync_dir, latest_checkpoint, save_hashed, write_atomic,
                                          write_hashed, write_manifest)
from trainfit.train.nonfinite import NonFiniteStop, advice, tensors_finite
from trainfit.train.stage import StepBatch
from trainfit.train.storage import failure_of, tree_bytes, write_failure


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointWriteError(ConfigError):
    """A checkpoint could not be written (a full disk, a quota, an I/O error): its partial directory is gone, the
    previous checkpoint is intact, and the message says how to continue."""


def save_checkpoint(ckpt_root: Path, step: int, *, model, is_peft: bool, optimizer, scheduler,
                    stage_state: dict, keep: int, fault: Optional[Callable[[str], None]] = None,
                    ranks: Ranks = SINGLE, engine=None) -> Path:
    """Write a checkpoint atomically, with its manifest (ckpt_manifest.py). Every rank calls it: each writes its
    own stage state (rollout buffers differ per rank); rank 0 writes the replicated rest and publishes it.

    An OSError on any rank (ENOSPC...) removes the partial checkpoint and raises CheckpointWriteError on every
    rank, the previous checkpoint still `latest`. A rank that failed skips its later writes but joins every
    collective, so no rank waits for another."""
    name = f"step-{step:06d}"
    tmp, final = ckpt_root / f".tmp-{name}", ckpt_root / name
    failed: Optional[tuple] = None   # (file, errno, strerror) of this rank's first failed write
    sums: dict[str, dict] = {}       # manifest entries of the files hashed while written
    if ranks.main:
        failed = _attempt(lambda: _fresh_dir(tmp), tmp)
    barrier(ranks)
    own = f"stage-rank{ranks.rank}.pt"
    failed = failed or _attempt(lambda: sums.update({own: save_hashed(stage_state, tmp / own)}), tmp / own)
    if engine is not None:  # DeepSpeed: every rank writes its optimizer partition (a collective)
        # Skipped by all ranks alike when one failed already: DeepSpeed's save waits for every rank.
        if not all_reduce_sum({"failed": float(failed is not None)}, ranks)["failed"]:
            failed = _attempt(lambda: engine.save_checkpoint(str(tmp / "deepspeed"), tag="state", save_latest=False),
                              tmp / "deepspeed")
    sharded = parallel.is_sharded(model)
    if sharded:  # gathering full tensors is a collective: every rank takes part, rank 0 receives
        model_sd, optim_sd = parallel.checkpoint_state(model, is_peft), parallel.full_optimizer_state(model, optimizer)
    zero3 = parallel.is_zero3(model)
    if zero3:  # the weights as a plain file too (for export and inspection): gathered, a collective
        with parallel.full_weights(model):
            model_sd = {k: v.clone() for k, v in trainable_state(model, is_peft).items()} if ranks.main else {}
    if ranks.main and not sharded and not zero3:
        model_sd = trainable_state(model, is_peft)
    refuse_nonfinite(model_sd if ranks.main else {}, ranks, f"checkpoint of step {step}")
    if ranks.main and failed is None:
        if not sharded:
            optim_sd = optimizer.state_dict() if engine is None else None
        failed = _attempt(lambda: _write_main(tmp, sums, model_sd, optim_sd, scheduler, step, ranks, engine,
                                              sharded, fault), tmp)
    reports = all_gather_objects((failed, sums), ranks)
    failed = next((f for f, _ in reports if f is not None), None)
    if ranks.main:
        if failed is None:
            for _, s in reports:
                sums.update(s)
            failed = _attempt(lambda: _publish(ckpt_root, tmp, final, sums, keep), tmp)
        message = _abandon(ckpt_root, tmp, final, step, failed) if failed is not None else None
    message = all_gather_objects(message if ranks.main else None, ranks)[0]
    if message is not None:
        raise CheckpointWriteError(message)
    return final


def _attempt(write: Callable[[], Any], where: Path) -> Optional[tuple]:
    """Run `write`; on an OSError, (the file it names or `where`, errno, strerror) instead of raising."""
    try:
        write()
    except OSError as e:
        return failure_of(e, where)
    return None


def _fresh_dir(tmp: Path) -> None:
    tmp.parent.mkdir(parents=True, exist_ok=True)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()


def _write_main(tmp: Path, sums: dict, model_sd: dict, optim_sd, scheduler, step: int, ranks: Ranks, engine,
                sharded: bool, fault: Optional[Callable[[str], None]]) -> None:
    """Rank 0's files: the weights, the optimizer (unless DeepSpeed holds it), schedule, RNG and state.json."""
    save_weights(model_sd, tmp / "model.safetensors")
    if fault:
        fault("checkpoint")  # tests kill the process here, mid-write
    if engine is None:
        sums["optimizer.pt"] = save_hashed(optim_sd, tmp / "optimizer.pt")
    sums["scheduler.pt"] = save_hashed(scheduler.state_dict(), tmp / "scheduler.pt")
    sums["rng.pt"] = save_hashed(rng_state(), tmp / "rng.pt")
    fmt = "deepspeed" if engine is not None else "full" if sharded else "torch"
    # "manifest": a checkpoint from now on has one, so a lost manifest reads as damage, not as an old checkpoint.
    sums["state.json"] = write_hashed(tmp / "state.json", json.dumps(
        {"step": step, "world_size": ranks.world, "optimizer_format": fmt, "manifest": MANIFEST}).encode())


def save_weights(state: dict, path: Path) -> None:
    """safetensors' save_file, an I/O error raised as OSError (save_shards.save_safetensors)."""
    save_safetensors(state, path)


def _publish(ckpt_root: Path, tmp: Path, final: Path, sums: dict, keep: int) -> None:
    """The manifest (hashing the files written by other libraries), then the rename into place and `latest`."""
    write_manifest(tmp, sums)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(ckpt_root)
    write_atomic(ckpt_root / LATEST, final.name.encode())
    _prune(ckpt_root, keep)


def _abandon(ckpt_root: Path, tmp: Path, final: Path, step: int, failed: tuple) -> str:
    """Remove what a failed save left (the partial directory; a renamed one `latest` does not name yet), then
    the message naming the checkpoint that is still `latest`."""
    written = tree_bytes(tmp)
    previous = latest_checkpoint(ckpt_root)
    for leftover in (tmp, *([final] if previous != final else [])):
        shutil.rmtree(leftover, ignore_errors=True)
    (ckpt_root / (LATEST + ".tmp")).unlink(missing_ok=True)
    return write_failure(step, failed, ckpt_root, latest_checkpoint(ckpt_root), written)


def refuse_nonfinite(state: dict, ranks: Ranks, what: str, every_rank: bool = False) -> None:
    """Raise NonFiniteStop on every rank when rank 0's weights `state` (`every_rank`: any rank's, its shards)
    hold a NaN or inf (a collective), so no checkpoint or final model is ever written with them."""
    bad = (ranks.main or every_rank) and not tensors_finite(state.values())
    if not all_reduce_sum({"bad": float(bad)}, ranks)["bad"]:
        return
    names = [k for k, v in state.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    raise NonFiniteStop(f"the {what} was not written: the weights hold NaN or inf values "
                        f"({', '.join(names[:3])}{' ...' if len(names) > 3 else ''}), so the run stops; the "
                        "checkpoints written before are finite. " + advice())


def _prune(ckpt_root: Path, keep: int) -> None:
    done = sorted(p for p in ckpt_root.glob("step-*") if p.is_dir())
    for old in done[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def _allowed_globals() -> list:
    """Non-tensor classes a trainfit checkpoint holds: GRPO's rollout buffer is a StepBatch. Allowlisted
    classes are rebuilt from their fields (no __reduce__, no __init__ call), so they cannot run code."""
    return [StepBatch]


# What DeepSpeed's ZeRO 1-2 optimizer files hold besides tensors (read from checkpoints it wrote):
# plain classes and an enum, rebuilt from their fields by the weights-only unpickler.
DEEPSPEED_GLOBALS = ("deepspeed.runtime.fp16.loss_scaler.LossScaler",
                     "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                     "deepspeed.runtime.zero.config.ZeroStageEnum",
                     "deepspeed.utils.tensor_fragment.fragment_address")


def _deepspeed_globals() -> list:
    import importlib

    out = []
    for name in DEEPSPEED_GLOBALS:
        module, _, attr = name.rpartition(".")
        out.append(getattr(importlib.import_module(module), attr))
    return out


def safe_load(file: Path, extra: tuple = (), **kw) -> Any:
    """torch.load(weights_only=True); a file that would need code to rebuild is refused (ConfigError)."""
    try:
        with torch.serialization.safe_globals([*_allowed_globals(), *extra]):
            return torch.load(file, weights_only=True, **kw)
    except pickle.UnpicklingError:
        try:
            names = torch.serialization.get_unsafe_globals_in_checkpoint(file)
        except Exception:  # not a torch zip file, or opcodes torch's scanner does not read
            names = []
        what = f" ({', '.join(sorted(names))})" if names else ""
        raise ConfigError(
            f"checkpoint file {file} holds Python objects{what} that would run code when loaded, so trainfit "
            "refuses to load it: checkpoints are read with torch.load(weights_only=True), which accepts "
            "tensors, numbers, strings and plain containers only. A checkpoint written by trainfit never "
            "holds such objects; if you did not write this one, do not resume from it, and start the run "
            "again (without --resume, or with another run_dir).") from None


def check_deepspeed_files(ds_dir: Path) -> None:
    """DeepSpeed's loader reads its files with torch.load(weights_only=False), which would run any
    pickled code. Read each one first the safe way (memory-mapped: no copy of the tensors is kept),
    allowing only the DeepSpeed classes above, so DeepSpeed then loads files known to hold no code."""
    extra = tuple(_deepspeed_globals())
    for f in sorted(ds_dir.rglob("*.pt")):
        try:
            safe_load(f, extra, map_location="cpu", mmap=True)
        except RuntimeError:  # a pre-zip (legacy) file cannot be memory-mapped: read it whole
            safe_load(f, extra, map_location="cpu")


def load_checkpoint(path: Path, *, model, is_peft: bool, optimizer, scheduler,
                    ranks: Ranks = SINGLE, engine=None) -> tuple[int, dict]:
    """Restore weights, optimizer, scheduler and RNG; return (step, this rank's stage state).

    A checkpoint from another rank count resumes too (weights and optimizer are replicated); the
    stage state then comes from rank 0 with `world_changed` set, for the stage to decide what to keep.
    Every file is read without running pickled code (see `safe_load`); DeepSpeed's own files are
    scanned the same way before DeepSpeed's loader reads them.
    """
    meta = json.loads((path / "state.json").read_text())
    fmt = meta.get("optimizer_format", "torch")
    if (engine is not None) != (fmt == "deepspeed") or (fmt == "deepspeed" and meta["world_size"] != ranks.world):
        raise ConfigError(
            f"checkpoint {path} holds a {fmt} optimizer state from {meta.get('world_size', 1)} rank(s) and this run "
            f"has {ranks.world} rank(s) {'under' if engine is not None else 'without'} DeepSpeed. DeepSpeed "
            "checkpoints resume only under DeepSpeed on the same rank count: each rank's file holds its own ZeRO "
            "partition of the optimizer state (and under ZeRO-3 of the weights), which trainfit does not re-split "
            "for another count; other checkpoints resume only without DeepSpeed. Resume with the settings it was "
            "written with (distributed.num_gpus / num_nodes / strategy); its full weights are in "
            f"{path / 'model.safetensors'} for a new run.")
    model_sd = load_file(str(path / "model.safetensors"))
    own = path / f"stage-rank{ranks.rank}.pt"
    same_world = meta.get("world_size", 1) == ranks.world and own.is_file()
    # Read every file of ours before touching the model, so a refused checkpoint changes nothing.
    scheduler_sd, rng = safe_load(path / "scheduler.pt"), safe_load(path / "rng.pt")
    stage_state = safe_load(own if same_world else path / "stage-rank0.pt")
    if engine is not None:  # DeepSpeed restores the weights and its optimizer partitions itself
        check_deepspeed_files(path / "deepspeed")
        engine.load_checkpoint(str(path / "deepspeed"), tag="state", load_lr_scheduler_states=False)
        scheduler.load_state_dict(scheduler_sd)
        set_rng_state(rng)
        return meta["step"], stage_state
    optim_sd = safe_load(path / "optimizer.pt")
    full = fmt == "full"  # written from FSDP shards: full tensors, keyed by name
    if parallel.is_sharded(model) and not full:
        raise ConfigError(f"checkpoint {path} was written without FSDP sharding and cannot resume under "
                          "distributed.strategy=fsdp; resume it with strategy ddp or on one process.")
    if full:  # loads into shards, or into a plain module (FSDP run resumed on one process)
        parallel.load_full_state(model, optimizer, model_sd, optim_sd, is_peft)
    else:
        load_trainable_state(model, is_peft, model_sd)
        optimizer.load_state_dict(optim_sd)
    scheduler.load_state_dict(scheduler_sd)
    set_rng_state(rng)
    if not same_world:
        stage_state["world_changed"] = True
    return meta["step"], stage_state


def clean_partial(ckpt_root: Path) -> None:
    for tmp in ckpt_root.glob(".tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)
