"""Storage faults, CPU (train.device=cpu): a damaged latest checkpoint is found by its manifest and the resume
falls back to the one before; a full disk while a checkpoint is written (injected at the write layer, and a
real size-limited tmpfs where the test runs as root, as CI does in `make test`) removes the partial
checkpoint and stops with a message; a run dir that cannot be written, or whose disk cannot hold one
checkpoint, is refused before the run starts."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from conftest import tiny_config
from trainfit.app.cli import app
from trainfit.config import ConfigError, to_yaml
from trainfit.train import checkpoint as ckpt, storage
from trainfit.train.ckpt_manifest import MANIFEST, HashingFile, resume_point, verify
from trainfit.train.run import DONE, run_pipeline

QUIET = Console(file=open("/dev/null", "w"))
STEPS = {"train.max_steps": 2, "train.save_every": 1, "train.global_batch_size": 4, "train.micro_batch_size": 2}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished 2-step SFT run with checkpoints at steps 1 and 2 (copied per test before damaging it)."""
    tmp = tmp_path_factory.mktemp("storage")
    cfg = tiny_config(tmp, "sft", **STEPS)
    run_pipeline(cfg, console=QUIET)
    return tmp / "run", cfg


def stopped_copy(finished_run, tmp_path) -> tuple[Path, Path]:
    """A copy of the run as if it had stopped after its last checkpoint; (its run dir, a config file naming it)."""
    src, cfg = finished_run
    run_dir = shutil.copytree(src, tmp_path / "run")
    (run_dir / DONE).unlink()
    config = tmp_path / "c.yaml"
    config.write_text(to_yaml(cfg.model_copy(update={"run_dir": str(run_dir)})))
    return run_dir, config


def train(config: Path, *args: str):
    return CliRunner().invoke(app, ["train", str(config), *args])


def flat(text: str) -> str:
    return " ".join(text.split())


def corrupt(file: Path) -> None:
    """Flip one byte in the middle: the size stays, only the checksum can tell."""
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def test_manifest_holds_the_size_and_sha256_of_every_file(finished_run):
    latest = ckpt.latest_checkpoint(finished_run[0] / "checkpoints")
    manifest = json.loads((latest / MANIFEST).read_text())
    files = {f.relative_to(latest).as_posix() for f in latest.rglob("*") if f.is_file()} - {MANIFEST}
    assert manifest["algorithm"] == "sha256" and set(manifest["files"]) == files
    assert {"model.safetensors", "optimizer.pt", "stage-rank0.pt", "state.json"} <= files
    for rel, entry in manifest["files"].items():
        data = (latest / rel).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, rel
    assert verify(latest).status == "ok"


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "lose_manifest"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_one_before(finished_run, tmp_path, damage):
    root = shutil.copytree(finished_run[0] / "checkpoints", tmp_path / "checkpoints")
    latest = root / "step-000002"
    if damage == "truncate":
        f = latest / "model.safetensors"
        f.write_bytes(f.read_bytes()[:1000])
    elif damage == "flip":
        corrupt(latest / "optimizer.pt")
    elif damage == "delete":
        (latest / "rng.pt").unlink()
    else:  # a checkpoint written with a manifest whose manifest is gone is damaged, not an old one
        (latest / MANIFEST).unlink()
    said = Console(record=True, width=400, file=open(os.devnull, "w"))
    chosen = resume_point(root, console=said)
    assert chosen == root / "step-000001"
    text = said.export_text()
    expected = {"truncate": "model.safetensors is 1,000 bytes", "flip": "optimizer.pt does not match its SHA-256",
                "delete": "rng.pt is missing", "lose_manifest": "manifest.json is missing"}[damage]
    assert expected in text and f"Resuming from {chosen} instead (step 1)" in text
    assert f"moved it aside to {root / 'damaged-step-000002'}" in text
    # Out of `latest` and of pruning, kept for a look; the next resume takes step 1 without a word.
    assert (root / "damaged-step-000002").is_dir() and not latest.exists()
    assert (root / "latest").read_text() == "step-000001"
    again = Console(record=True, file=open(os.devnull, "w"))
    assert resume_point(root, console=again) == chosen and again.export_text() == ""


def test_resume_through_the_cli_says_which_file_was_bad_and_trains_on(finished_run, tmp_path):
    run_dir, config = stopped_copy(finished_run, tmp_path)
    corrupt(run_dir / "checkpoints" / "step-000002" / "optimizer.pt")
    r = train(config, "--resume")
    out = flat(r.output)
    assert r.exit_code == 0, r.output
    assert "optimizer.pt does not match its SHA-256" in out
    assert f"resumed from {run_dir / 'checkpoints' / 'step-000001'} at step 1" in out
    assert (run_dir / DONE).is_file() and ckpt.latest_checkpoint(run_dir / "checkpoints").name == "step-000002"


def test_no_usable_checkpoint_exits_2_naming_each_and_changes_nothing(finished_run, tmp_path):
    run_dir, config = stopped_copy(finished_run, tmp_path)
    root = run_dir / "checkpoints"
    corrupt(root / "step-000002" / "model.safetensors")
    (root / "step-000001" / "scheduler.pt").write_bytes(b"")
    r = train(config, "--resume")
    out = flat(r.output)
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit) and "Traceback" not in r.output
    assert "no checkpoint in" in out and "is usable" in out
    assert "step-000002: model.safetensors does not match" in out and "step-000001: scheduler.pt is 0 bytes" in out
    assert "--overwrite" in out
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001", "step-000002"]


def test_a_checkpoint_from_before_manifests_loads_unverified_and_says_so(finished_run, tmp_path):
    root = shutil.copytree(finished_run[0] / "checkpoints", tmp_path / "checkpoints")
    latest = root / "step-000002"
    (latest / MANIFEST).unlink()
    state = json.loads((latest / "state.json").read_text())
    del state["manifest"]   # as trainfit wrote state.json before manifests
    (latest / "state.json").write_text(json.dumps(state))
    said = Console(record=True, width=400, file=open(os.devnull, "w"))
    assert resume_point(root, console=said) == latest
    text = said.export_text()
    assert f"{latest} has no manifest.json" in text and "resuming from it without verifying its files" in text


class FillingFile:
    """A file on a disk with `left[0]` bytes free: a write past them fails with ENOSPC, as a full disk's does."""

    def __init__(self, f, left: list[int]):
        self.f, self.left = f, left

    def write(self, data):
        if len(data) > self.left[0]:
            self.left[0] = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.left[0] -= len(data)
        return self.f.write(data)

    def flush(self):
        self.f.flush()


@contextlib.contextmanager
def full_disk_after(monkeypatch, budget: int):
    """Every file torch.save writes for a checkpoint goes through HashingFile to its file: that file becomes a
    FillingFile with `budget` bytes free between them all."""
    left, real = [budget], HashingFile.__init__
    with monkeypatch.context() as m:
        m.setattr(HashingFile, "__init__", lambda self, f: real(self, FillingFile(f, left)))
        yield


def test_enospc_while_writing_a_checkpoint_removes_it_keeps_the_previous_and_says_how_to_go_on(
        finished_run, tmp_path, monkeypatch):
    src, cfg = finished_run
    one = json.loads((src / "checkpoints" / "step-000001" / MANIFEST).read_text())["files"]
    hashed = sum(e["size"] for rel, e in one.items() if rel != "model.safetensors")
    run_dir = tmp_path / "run"
    config = tmp_path / "c.yaml"
    config.write_text(to_yaml(cfg.model_copy(update={"run_dir": str(run_dir)})))
    with full_disk_after(monkeypatch, hashed + hashed // 2):   # the second checkpoint fails half-way
        r = train(config)
    out = flat(r.output)
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit) and "Traceback" not in r.output, r.output
    root = run_dir / "checkpoints"
    assert "could not write the checkpoint of step 2: No space left on device (ENOSPC)" in out
    assert f"writing {root / '.tmp-step-000002' / 'optimizer.pt'}" in out
    assert f"the previous checkpoint, {root / 'step-000001'}, is intact" in out
    size = storage.size_text(storage.tree_bytes(root / "step-000001"))
    assert f"A checkpoint of this run takes about {size}; the disk holding {root} has" in out and "--resume" in out
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001"]
    assert verify(root / "step-000001").status == "ok"
    resumed = train(config, "--resume")
    assert resumed.exit_code == 0, resumed.output
    assert "resumed from" in resumed.output and (run_dir / DONE).is_file()


@contextlib.contextmanager
def tmpfs(where: Path, options: str):
    """A tmpfs mounted at `where` (root only: skips elsewhere; CI runs `make test` as root)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"mount -t tmpfs is not possible here: {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_a_real_full_tmpfs_stops_the_run_cleanly_with_the_previous_checkpoint_usable(finished_run, tmp_path):
    src, cfg = finished_run
    one = storage.tree_bytes(src / "checkpoints" / "step-000001")
    # Room for the config, the metrics and one checkpoint, not for the second beside it.
    with tmpfs(tmp_path / "disk", f"size={one * 3 // 2}") as disk:
        run_dir = disk / "run"
        config = tmp_path / "c.yaml"
        config.write_text(to_yaml(cfg.model_copy(update={"run_dir": str(run_dir)})))
        r = train(config)
        out = flat(r.output)
        assert r.exit_code == 2 and isinstance(r.exception, SystemExit) and "Traceback" not in r.output, r.output
        assert "warning:" in out and "train.keep_checkpoints" in out   # said before the run: the disk is short
        root = run_dir / "checkpoints"
        assert "could not write the checkpoint of step 2: No space left on device (ENOSPC)" in out
        assert f"the previous checkpoint, {root / 'step-000001'}, is intact" in out
        assert sorted(p.name for p in root.iterdir()) == ["latest", "step-000001"]
        assert verify(root / "step-000001").status == "ok"
        assert resume_point(root) == root / "step-000001"


def test_a_read_only_run_dir_is_refused_before_the_run(tmp_path):
    cfg = tiny_config(tmp_path, "sft", **STEPS)
    config = tmp_path / "c.yaml"
    if os.geteuid() == 0:   # root writes through permission bits: a read-only mount is what stops it
        with tmpfs(tmp_path / "ro", "ro,size=64k") as ro:
            config.write_text(to_yaml(cfg.model_copy(update={"run_dir": str(ro / "run")})))
            r = train(config)
            why = f"{ro} is on a read-only filesystem"
            assert f"remount {ro} read-write" in flat(r.output)
    else:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        config.write_text(to_yaml(cfg.model_copy(update={"run_dir": str(ro / "run")})))
        r = train(config)
        why = f"{ro} is not writable by this user"
    out = flat(r.output)
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit) and "Traceback" not in r.output, r.output
    assert f"run_dir={ro / 'run'} cannot be written: {why}" in out and "run_dir=runs/new" in out


def test_the_checkpoint_estimate_matches_a_real_checkpoint(finished_run):
    src, cfg = finished_run
    one, final = storage.checkpoint_bytes(cfg)
    files = json.loads((src / "checkpoints" / "step-000001" / MANIFEST).read_text())["files"]
    tensors = files["model.safetensors"]["size"] + files["optimizer.pt"]["size"]
    assert abs(one - tensors) / tensors < 0.05, (one, tensors)
    assert abs(final - (src / "final" / "model.safetensors").stat().st_size) / final < 0.05


def test_a_disk_short_of_one_checkpoint_is_refused_and_short_of_the_kept_ones_warned(tmp_path, monkeypatch):
    cfg = tiny_config(tmp_path, "sft", **STEPS)
    one, final = storage.checkpoint_bytes(cfg)
    monkeypatch.setattr(storage, "free_bytes", lambda path: one - 1)
    with pytest.raises(ConfigError) as e:
        storage.check_space([cfg], cfg.run_dir)
    assert f"run_dir={cfg.run_dir}" in str(e.value) and "its first checkpoint (train.save_every=1) would fail" in str(e.value)
    monkeypatch.setattr(storage, "free_bytes", lambda path: 2 * one)   # keep_checkpoints=2 + 1 written + final
    assert "train.keep_checkpoints" in storage.check_space([cfg], cfg.run_dir)
    assert storage.check_space([cfg], cfg.run_dir, reclaimed=2 * one) is None   # a resume reuses its checkpoints' room
    monkeypatch.setattr(storage, "free_bytes", lambda path: 3 * one + final)
    assert storage.check_space([cfg], cfg.run_dir) is None


def test_deepspeeds_files_are_in_the_manifest_and_checked(tmp_path):
    # DeepSpeed writes its partitions itself (under deepspeed/<tag>/); the manifest hashes them after, so a damaged
    # partition is found as any other file is.
    import torch

    from trainfit.train.ckpt_manifest import write_manifest

    step = tmp_path / "step-000004"
    (step / "deepspeed" / "state").mkdir(parents=True)
    torch.save({"w": torch.arange(64.0)}, step / "deepspeed" / "state" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    (step / "state.json").write_text(json.dumps({"step": 4, "manifest": MANIFEST}))
    write_manifest(step, {})
    manifest = json.loads((step / MANIFEST).read_text())["files"]
    assert set(manifest) == {"state.json", "deepspeed/state/zero_pp_rank_1_mp_rank_00_optim_states.pt"}
    assert verify(step).status == "ok"
    corrupt(step / "deepspeed" / "state" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    check = verify(step)
    assert check.status == "bad" and "deepspeed/state/zero_pp_rank_1_mp_rank_00_optim_states.pt does not match" in check.detail


def test_a_failure_with_no_checkpoint_before_it_names_the_error_and_resume_or_start(tmp_path):
    msg = storage.write_failure(3, (str(tmp_path / ".tmp-step-000003" / "optimizer.pt"), errno.EIO, "Input/output error"),
                                tmp_path, None, 5 * 2 ** 20)
    assert msg.startswith("could not write the checkpoint of step 3: Input/output error (EIO) writing ")
    assert "no earlier checkpoint exists" in msg and "had 5.0 MiB written when it failed" in msg
    assert "Fix the storage" in msg and msg.endswith("with --resume-or-start.")


def enospc(path) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def test_enospc_in_the_final_save_keeps_the_last_checkpoint_and_the_earlier_final_model(finished_run, tmp_path,
                                                                                       monkeypatch):
    import transformers.modeling_utils as mu

    run_dir, config = stopped_copy(finished_run, tmp_path)   # stopped after step 2: a resume saves the final model
    before = (run_dir / "final" / "model.safetensors").read_bytes()

    def full_disk(state, filename, metadata=None):   # the weights file fails half-way, as on a full disk
        Path(filename).write_bytes(b"\0" * 64)
        raise enospc(filename)

    with monkeypatch.context() as m:
        m.setattr(mu, "safe_save_file", full_disk)
        r = train(config, "--resume")
    out, root = flat(r.output), run_dir / "checkpoints"
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit) and "Traceback" not in r.output, r.output
    assert ("could not write the final model: No space left on device (ENOSPC) writing "
            f"{run_dir / '.tmp-final' / 'model.safetensors'}. The run stopped; the last checkpoint, "
            f"{root / 'step-000002'}, is intact and the run continues from it.") in out
    assert "free. Free space there" in out and "then run the same `trainfit train` command with --resume." in out
    assert not (run_dir / ".tmp-final").exists() and not (run_dir / DONE).exists()
    assert (run_dir / "final" / "model.safetensors").read_bytes() == before   # the earlier final model untouched
    assert verify(root / "step-000002").status == "ok"
    resumed = train(config, "--resume")
    assert resumed.exit_code == 0, resumed.output
    assert (run_dir / DONE).is_file() and (run_dir / "final" / "model.safetensors").read_bytes() == before


def test_enospc_appending_a_metrics_row_names_the_file_and_the_checkpoint_a_resume_continues_from(
        finished_run, tmp_path, monkeypatch):
    from trainfit.train import report

    run_dir, _ = stopped_copy(finished_run, tmp_path)
    logger = report.MetricsLogger(run_dir)
    real_open = open
    # The write layer of test_enospc_while_writing_a_checkpoint...: a file with 10 bytes left on its disk.
    monkeypatch.setattr(report, "open", lambda path, mode: contextlib.nullcontext(
        FillingFile(real_open(path, mode), [10])), raising=False)
    with pytest.raises(storage.DiskWriteError) as e:
        logger.log(3, {"loss": 1.0})
    assert isinstance(e.value, ConfigError)   # the CLI's exit 2, one paragraph
    assert str(e.value).startswith(f"could not write a metrics row: No space left on device (ENOSPC) writing "
                                   f"{run_dir / 'metrics.jsonl'}. The run stopped; the last checkpoint, "
                                   f"{run_dir / 'checkpoints' / 'step-000002'}, is intact")
    assert str(e.value).endswith("--resume.")


def test_enospc_writing_the_summary_of_a_finished_run_says_nothing_trained_is_lost(finished_run, tmp_path,
                                                                                   monkeypatch):
    src, cfg = finished_run
    run_dir = shutil.copytree(src, tmp_path / "run")
    config = tmp_path / "c.yaml"
    config.write_text(to_yaml(cfg.model_copy(update={"run_dir": str(run_dir)})))
    real = Path.write_text
    monkeypatch.setattr(Path, "write_text", lambda self, *a, **k: (_ for _ in ()).throw(enospc(self))
                        if self.name == "summary.json" else real(self, *a, **k))
    r = train(config, "--resume")   # every stage done: only the summary is written again
    out = flat(r.output)
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit) and "Traceback" not in r.output, r.output
    assert (f"could not write the run's summary: No space left on device (ENOSPC) writing {run_dir / 'summary.json'}. "
            "The run stopped; every stage finished and its final model is saved") in out
    assert "saved (the summary table's output column). The disk holding" in out and "with --resume." in out
