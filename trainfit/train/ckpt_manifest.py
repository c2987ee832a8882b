"""A checkpoint's manifest: the size and SHA-256 of every file in it, checked before a resume trusts it.

    entry = save_hashed(obj, tmp / "optimizer.pt")    # torch.save, hashed as the bytes are written
    write_manifest(tmp, {"optimizer.pt": entry, ...})  # hashes the rest (safetensors, DeepSpeed's files)
    verify(step_dir)                                   # Check("ok" | "unverified" | "bad", what is wrong)

`manifest.json` holds {"algorithm": "sha256", "files": {relative path: {"size", "sha256"}}}, every file
of the checkpoint but itself, DeepSpeed's partitions under `deepspeed/` included. `state.json` records
that a manifest was written, so a checkpoint whose manifest is lost reads as damaged, not as one from
before manifests existed (those load unverified, and the resume says so).

Why SHA-256: it is the digest `sha256sum` and the Hugging Face hub use, so a user can check a file by
hand (`jq -r '.files | to_entries[] | "\\(.value.sha256)  \\(.key)"' manifest.json | sha256sum -c`); on a
CPU with SHA instructions it is the fastest cryptographic hash of the standard library (bench/ckpt_hash.py:
2.4x blake2b and md5); zlib's crc32, 1.8-2.7x faster, is a 32-bit sum, weak for files of many GiB. Its
cost is one SHA-256 pass over the bytes: the files torch.save writes are hashed on their way to the disk
(no second read); the safetensors file and DeepSpeed's files, written by their libraries, are read back
once, from the page cache as a rule.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from trainfit.config import ConfigError
from trainfit.core.dist import SINGLE, Ranks, all_gather_objects

LATEST = "latest"   # a text file naming the newest finished checkpoint (replaced atomically)
MANIFEST = "manifest.json"
ALGORITHM = "sha256"
CHUNK = 1 << 22


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


class HashingFile:
    """A binary file open for writing whose bytes are hashed and counted as they are written. torch.save's
    writer turns a failed write into a RuntimeError ("unexpected pos"): the OSError is kept in `error`."""

    def __init__(self, f):
        self.f, self.hash, self.size = f, hashlib.sha256(), 0
        self.error: Optional[OSError] = None

    def write(self, data) -> int:
        try:
            n = self.f.write(data)
        except OSError as e:
            self.error = e
            raise
        self.hash.update(data)
        self.size += len(data)
        return n

    def flush(self) -> None:
        self.f.flush()

    def entry(self) -> dict:
        return {"size": self.size, ALGORITHM: self.hash.hexdigest()}


def save_hashed(obj: Any, path: Path) -> dict:
    """torch.save(obj, path), flushed to the disk; its manifest entry. A failed write raises OSError naming path."""
    return _write_through(path, lambda out: torch.save(obj, out))


def write_hashed(path: Path, data: bytes) -> dict:
    """Write `data` to path, flushed to the disk; its manifest entry."""
    return _write_through(path, lambda out: out.write(data))


def _write_through(path: Path, write: Callable[[HashingFile], Any]) -> dict:
    out = None
    try:
        with open(path, "wb") as f:
            out = HashingFile(f)
            write(out)
            f.flush()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as e:
        err = out.error if out is not None and out.error is not None else e
        if not isinstance(err, OSError):
            raise
        raise OSError(err.errno, err.strerror, str(path)) from None
    return out.entry()


def hash_file(path: Path) -> dict:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, ALGORITHM: h.hexdigest()}


def write_manifest(ckpt_dir: Path, known: dict[str, dict]) -> None:
    """Write ckpt_dir/manifest.json over every file in ckpt_dir: `known` entries (hashed while written) as
    they are, the others hashed now. Each file not hashed while written is fsynced as it is read."""
    files = {}
    for f in sorted(p for p in ckpt_dir.rglob("*") if p.is_file()):
        rel = f.relative_to(ckpt_dir).as_posix()
        if rel == MANIFEST:
            continue
        if rel not in known:
            files[rel] = hash_file(f)
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        else:
            files[rel] = known[rel]
    write_hashed(ckpt_dir / MANIFEST, json.dumps({"algorithm": ALGORITHM, "files": files}, indent=1).encode())


@dataclass
class Check:
    """What verify found: "ok" (every file matches), "unverified" (no manifest: written before manifests
    existed), or "bad", with `detail` naming the damaged files."""

    status: str
    detail: str = ""

    @property
    def usable(self) -> bool:
        return self.status != "bad"


def verify(ckpt_dir: Path) -> Check:
    """Check a finished checkpoint against its manifest: sizes first (a truncated file costs no read), then
    the SHA-256 of each file."""
    state = _read_json(ckpt_dir / "state.json")
    manifest_path = ckpt_dir / MANIFEST
    if not manifest_path.is_file():
        if state is None:
            return Check("bad", "state.json is missing or unreadable")
        if state.get("manifest"):
            return Check("bad", f"{MANIFEST} is missing")
        return Check("unverified")
    manifest = _read_json(manifest_path)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if (not isinstance(files, dict) or manifest.get("algorithm") != ALGORITHM
            or not all(isinstance(e, dict) and isinstance(e.get("size"), int) and isinstance(e.get(ALGORITHM), str)
                       for e in files.values())):
        return Check("bad", f"{MANIFEST} is unreadable")
    problems = []
    for rel, want in files.items():
        f = ckpt_dir / rel
        size = f.stat().st_size if f.is_file() else None
        if size is None:
            problems.append(f"{rel} is missing")
        elif size != want["size"]:
            problems.append(f"{rel} is {size:,} bytes, the manifest says {want['size']:,} "
                            f"({'truncated' if size < want['size'] else 'grown'})")
    for rel, want in files.items() if not problems else ():
        try:
            if hash_file(ckpt_dir / rel)[ALGORITHM] != want[ALGORITHM]:
                problems.append(f"{rel} does not match its SHA-256 in {MANIFEST} (corrupted)")
        except OSError as e:   # an I/O error reading it back: as damaged as a wrong sum
            problems.append(f"{rel} cannot be read ({e.strerror})")
    return Check("bad", "; ".join(problems)) if problems else Check("ok")


def _read_json(path: Path) -> Optional[dict]:
    try:
        out = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return out if isinstance(out, dict) else None


def latest_checkpoint(ckpt_root: Path) -> Optional[Path]:
    """The newest complete checkpoint, or None. Half-written `.tmp-*` directories are ignored."""
    pointer = ckpt_root / LATEST
    if not pointer.is_file():
        return None
    path = ckpt_root / pointer.read_text().strip()
    return path if (path / "state.json").is_file() else None


STEP = re.compile(r"step-\d+")   # a finished checkpoint's directory name
DAMAGED = "damaged-"   # a checkpoint that failed its manifest, moved aside by a resume: damaged-step-000040


def resume_point(ckpt_root: Path, ranks: Ranks = SINGLE, console=None) -> Optional[Path]:
    """The checkpoint `--resume` continues from, or None when there is none: `latest`, verified against its
    manifest. When it is damaged (truncated, corrupted, a file missing), the newest older one that verifies,
    said in one message on `console`; each damaged one is moved aside to damaged-step-N (out of `latest` and of
    pruning, kept for a look). A checkpoint without a manifest (written before manifests) is taken unverified,
    and the message says so. ConfigError when checkpoints exist and none is usable. Rank 0 checks (reading
    every file once); every rank gets its answer."""
    answer = _choose(ckpt_root) if ranks.main else None
    path, note, error = all_gather_objects(answer, ranks)[0]
    if error is not None:
        raise ConfigError(error)
    if note is not None and console is not None:
        console.print(note, style="yellow", markup=False, highlight=False, soft_wrap=True)
    return None if path is None else Path(path)


def _candidates(ckpt_root: Path) -> tuple[list[Path], list[tuple[Path, str]]]:
    """(the checkpoints to try, newest first: `latest`'s, then older ones; those already known to be bad). A
    directory newer than `latest` was never published; all are tried when `latest` is unreadable."""
    done = sorted((p for p in ckpt_root.glob("step-*") if p.is_dir() and STEP.fullmatch(p.name)), reverse=True)
    try:
        named = ckpt_root / (ckpt_root / LATEST).read_text().strip()
    except (OSError, UnicodeDecodeError):
        return done, []
    if named.parent != ckpt_root or not STEP.fullmatch(named.name):
        return done, []
    older = [p for p in done if p.name < named.name]
    return ([named, *older], []) if named.is_dir() else (older, [(named, "its directory is missing")])


def _choose(ckpt_root: Path) -> tuple[Optional[str], Optional[str], Optional[str]]:
    """(path, message, error) for resume_point, on rank 0."""
    candidates, bad = _candidates(ckpt_root)
    if not candidates and not bad:
        return None, None, None
    chosen, check = None, None
    for c in candidates:
        check = verify(c)
        if check.usable:
            chosen = c
            break
        bad.append((c, check.detail))
    listing = "; ".join(f"{p.name}: {why}" for p, why in bad)
    if chosen is None:
        return None, None, (
            f"--resume: no checkpoint in {ckpt_root} is usable ({listing}); nothing was changed. Restore the damaged "
            "files from a backup and resume again, or start the stage again: without --resume in another run dir "
            "(run_dir=runs/new), or with --overwrite to discard this run.")
    notes = []
    try:
        if bad:
            moved = [_move_aside(p) for p, _ in bad if p.is_dir()]
            write_atomic(ckpt_root / LATEST, chosen.name.encode())
            notes.append(f"checkpoint damaged: {listing}. Resuming from {chosen} instead (step {int(chosen.name[5:])})"
                         + (f"; moved {'it' if len(moved) == 1 else 'them'} aside to {', '.join(str(m) for m in moved)}"
                            if moved else "")
                         + ".")
    except OSError as e:
        return None, None, f"--resume: could not move the damaged checkpoint aside in {ckpt_root} ({e}); {listing}."
    if check.status == "unverified":
        notes.append(f"{chosen} has no {MANIFEST} (written before trainfit checked checkpoints): resuming from it "
                     "without verifying its files.")
    return str(chosen), " ".join(notes) or None, None


def _move_aside(path: Path) -> Path:
    target, n = path.with_name(DAMAGED + path.name), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{DAMAGED}{path.name}-{n}")
    os.replace(path, target)
    return target
