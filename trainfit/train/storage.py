"""The disk under a run dir: writable, room for a checkpoint, and what to say when a write fails.

Before a run (preflight, dry-run and train): a run dir that cannot be written (a read-only mount, no
permission) is refused, since the run would fail at its first line of metrics. Its disk's free space is
compared with one checkpoint, estimated from the planner's states (trainable weights in their dtype, the
optimizer's moments, DeepSpeed's fp32 masters and its own copy of the weights; a PPO critic doubles it):
- less than ONE checkpoint (or, with train.save_every=0, than the final model): refused. The first save
  cannot succeed, so the run would spend its compute up to train.save_every and stop with nothing kept.
- less than what the run keeps (train.keep_checkpoints of them, one more while it is written, and the
  final model): a warning. The run can go on for a while, space may be freed meanwhile, and the
  estimate leaves out the small files; if the disk fills, the write fails cleanly (checkpoint.py) and
  the previous checkpoint stays usable.

While a run writes a checkpoint, an OSError (ENOSPC, EDQUOT, EIO, EROFS...) becomes `write_failure`'s
paragraph: the file, the error, the space free and needed, and how to continue. Any other file of the run
(the final model, a metrics row, summary.json, the figure) fails the same way, with `run_write_failure`'s
paragraph (`guarded_write`): the run stops with exit 2, its last checkpoint kept, and `--resume` continues.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Iterator, Optional

from trainfit.config import Config, ConfigError
from trainfit.config.stages import stage_spec
from trainfit.models.shapes import arch_facts, model_source
from trainfit.plan.components import targets
from trainfit.plan.states import model_states, parallel_of

GiB = 2 ** 30


def nearest_existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists (a run dir is made when the run starts)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def size_text(n: float) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB / 10 else f"{n / 2 ** 20:.1f} MiB"


def free_bytes(path: Path) -> int:
    return shutil.disk_usage(nearest_existing(path)).free


def tree_bytes(path: Path) -> int:
    """Bytes of the files under `path` (0 when it is gone)."""
    try:
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    except OSError:
        return 0


def check_writable(run_dir: str, dirs: list[Path]) -> None:
    """ConfigError when run_dir (or the directory it will be made in) or one of `dirs` that exists cannot take
    a new file. The probe is a real file (unnamed where the filesystem allows, O_TMPFILE), as permission bits
    and even os.access miss ACLs, root-squashed NFS and a mount remounted read-only."""
    for where in [nearest_existing(Path(run_dir)), *(d for d in dirs if d.is_dir())]:
        try:
            with tempfile.TemporaryFile(dir=where):
                pass
        except OSError as e:
            raise ConfigError(not_writable(run_dir, where, e)) from None


def not_writable(run_dir: str, where: Path, e: OSError) -> str:
    readonly = e.errno == errno.EROFS or _mounted_readonly(where)
    why = ("is on a read-only filesystem" if readonly else
           "is not writable by this user" if e.errno in (errno.EACCES, errno.EPERM) else "cannot be written")
    fix = (f"or remount {_mount_point(where)} read-write" if readonly else
           "or give this user write permission on it" if e.errno in (errno.EACCES, errno.EPERM) else
           "or fix the storage")
    return (f"run_dir={run_dir} cannot be written: {where} {why} ({e.strerror}). A run writes its config, metrics "
            "and checkpoints there, so it does not start. Set run_dir to a writable directory, e.g. "
            f"run_dir=runs/new (to continue this run there, copy the run dir first and add --resume), {fix}.")


def _mounted_readonly(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def _mount_point(path: Path) -> Path:
    path = path.resolve()
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def checkpoint_bytes(cfg: Config) -> tuple[int, int]:
    """(one checkpoint, the final model) of stage config `cfg`, in bytes, from the planner's unsharded states:
    a checkpoint holds every rank's share (DeepSpeed's partitions, FSDP's gathered state)."""
    facts = arch_facts(model_source(cfg.model))
    m, pe, t = cfg.model, cfg.peft, cfg.train
    par = replace(parallel_of(cfg), world=1, offload_optimizer=False, offload_params=False)
    full = pe.method == "none"
    st = model_states(facts, dtype=m.dtype, trainable="full" if full else "adapters", peft=pe.method, r=pe.r,
                      targets=targets(cfg, facts), optimizer=t.optimizer, par=par, quantization=m.quantization,
                      double_quant=m.bnb_4bit_double_quant)
    weights = st.weights if full else st.adapters   # model.safetensors: the trainable state only
    one = weights + st.optimizer + st.master + (weights if cfg.engine() == "deepspeed" else 0)
    # The final model: the whole weights, or with adapters only theirs (over a hub base, models/save.py; a base
    # trainfit must save beside them, a preset's or a GGUF's, is left out: the estimate errs low, never refuses wrongly).
    return one * (2 if stage_spec(cfg.stage).critic else 1), weights


def check_space(stages: list[Config], run_dir: str, reclaimed: int = 0) -> Optional[str]:
    """ConfigError when the run dir's disk cannot hold what the run must write first (one checkpoint, or the final
    model without train.save_every); a warning (returned) when it cannot hold all the run keeps. `reclaimed`:
    bytes already there that the run frees or reuses (a resume's checkpoints, a run --overwrite discards). None
    when there is room."""
    try:
        sizes = [checkpoint_bytes(s) for s in stages]
    except (ConfigError, OSError):   # the planner's limits are not the trainer's: no estimate, no check
        return None
    free = free_bytes(Path(run_dir)) + reclaimed
    first = [(i, one if s.train.save_every else final) for i, (s, (one, final)) in enumerate(zip(stages, sizes))]
    i, need = max(first, key=lambda x: x[1])
    where = nearest_existing(Path(run_dir))
    if free < need:
        s = stages[i]
        what = (f"one checkpoint of stage {i} ({s.stage}) needs about {size_text(need)} (its trainable weights and "
                f"optimizer state), so its first checkpoint (train.save_every={s.train.save_every}) would fail"
                if s.train.save_every else
                f"the final model of stage {i} ({s.stage}) needs about {size_text(need)}, so it could not be saved")
        raise ConfigError(f"run_dir={run_dir}: the disk holding {where} has {size_text(free)} free and {what}. "
                          "Free space there, or set run_dir to a directory on a larger disk, e.g. run_dir=runs/new.")
    kept = sum(s.train.keep_checkpoints * one * bool(s.train.save_every) + final
               for s, (one, final) in zip(stages, sizes))
    most = kept + max((one for s, (one, _) in zip(stages, sizes) if s.train.save_every), default=0)
    if free >= most:
        return None
    return (f"run_dir={run_dir}: the disk holding {where} has {size_text(free)} free, less than the about "
            f"{size_text(most)} this run keeps (train.keep_checkpoints checkpoints, one more while it is written, "
            "and the final model); if the disk fills, the run stops at that checkpoint with the previous one kept. "
            "Free space, lower train.keep_checkpoints, or set run_dir to a directory on a larger disk.")


class DiskWriteError(ConfigError):
    """A file of the run (the final model, a metrics row, the report) could not be written: the run stops
    with `run_write_failure`'s paragraph and exit 2 (a checkpoint's own failure is checkpoint.py's)."""


def failure_of(e: OSError, where: Path) -> tuple[str, int, str]:
    """(the file an OSError names, or `where`; its errno; its text)."""
    return str(e.filename or where), e.errno, e.strerror or str(e)


def _error_text(failed: tuple[str, int, str]) -> str:
    path, code, strerror = failed
    return f"{strerror} ({errno.errorcode.get(code, code)}) writing {path}"


def _fix(code: int) -> str:
    if code in (errno.ENOSPC, errno.EDQUOT):
        return ("Free space there (or lower train.keep_checkpoints), or move the run dir to a disk with room and "
                "set run_dir to its new place")
    return "Fix the storage (or move the run dir to a sound disk and set run_dir to its new place)"


def _again(resumable: bool) -> str:
    # Without an earlier checkpoint, --resume may have nothing to continue (a pipeline's finished stages aside).
    return "then run the same `trainfit train` command with " + ("--resume." if resumable else "--resume-or-start.")


def write_failure(step: int, failed: tuple[str, int, str], ckpt_root: Path, previous: Optional[Path],
                  written: int) -> str:
    """The paragraph for an OSError while writing the checkpoint of `step` (after its partial directory was
    removed). `failed`: (the file, errno, strerror); `previous`: the intact checkpoint before it, if any;
    `written`: bytes of the partial checkpoint when it failed."""
    need = tree_bytes(previous) if previous is not None else 0
    space = (f" A checkpoint of this run takes about {size_text(need)}" if need else
             f" The checkpoint had {size_text(written)} written when it failed")
    space += f"; the disk holding {ckpt_root} has {size_text(free_bytes(ckpt_root))} free."
    kept = (f"the previous checkpoint, {previous}, is intact" if previous is not None
            else "no earlier checkpoint exists")
    return (f"could not write the checkpoint of step {step}: {_error_text(failed)}. The partial checkpoint was "
            f"removed and {kept}.{space} {_fix(failed[1])}; {_again(previous is not None)}")


def run_write_failure(what: str, failed: tuple[str, int, str], previous: Optional[Path],
                      kept: Optional[str] = None) -> str:
    """The paragraph for an OSError while writing `what` outside a checkpoint (the final model, a metrics row,
    the summary): the error and file, the space free, what is kept (`previous`, the stage's last checkpoint,
    unless `kept` says otherwise) and how to continue."""
    where, given = nearest_existing(Path(failed[0]).parent), kept is not None
    kept = kept or (f"the last checkpoint, {previous}, is intact and the run continues from it"
                    if previous is not None else "no checkpoint of this stage was written yet")
    return (f"could not write {what}: {_error_text(failed)}. The run stopped; {kept}. The disk holding {where} "
            f"has {size_text(free_bytes(where))} free. {_fix(failed[1])}; {_again(previous is not None or given)}")


@contextlib.contextmanager
def guarded_write(what: str, ckpt_root: Path, file: Optional[Path] = None,
                  kept: Optional[str] = None) -> Iterator[None]:
    """Inside, an OSError (a full disk...) becomes DiskWriteError with `run_write_failure`'s paragraph.
    `ckpt_root`: the checkpoints of the stage writing (the last one is what a resume continues from); `file`:
    what is written, named when the error names no file (a write to an open file)."""
    try:
        yield
    except OSError as e:
        from trainfit.train.ckpt_manifest import latest_checkpoint   # torch: not at the top of a preflight module

        failed = failure_of(e, file or ckpt_root.parent)
        raise DiskWriteError(run_write_failure(what, failed, latest_checkpoint(ckpt_root), kept)) from None
