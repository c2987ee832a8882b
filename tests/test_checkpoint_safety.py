"""Resuming never runs pickled code: a checkpoint file holding an object whose unpickling calls a
function is refused with a clear error, before anything is loaded, and the function never runs."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from conftest import tiny_config
from trainfit.config import ConfigError, to_yaml
from trainfit.train import checkpoint as ckpt
from trainfit.train.ckpt_manifest import write_manifest
from trainfit.train.loop import make_optimizer
from trainfit.train.run import DONE, build_stage, run_pipeline

QUIET = Console(file=open("/dev/null", "w"))


class WritesMarker:
    """Unpickling this calls io.open(marker, "w"): the file appears only if the loader ran the call."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def sft_cfg(tmp_path):
    return tiny_config(tmp_path, "sft", **{"train.max_steps": 2, "train.save_every": 1,
                                           "train.global_batch_size": 4, "train.micro_batch_size": 2})


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished 2-step SFT run with checkpoints at steps 1 and 2 (copied per test before poisoning)."""
    tmp = tmp_path_factory.mktemp("safety")
    cfg = sft_cfg(tmp)
    run_pipeline(cfg, console=QUIET)
    return tmp, cfg


def poison(file: Path, marker: Path) -> None:
    """Replace a checkpoint file with one that keeps its structure but hides the marker-writing object."""
    torch.save({"state": {}, "payload": WritesMarker(marker)}, file)


def fresh_model_and_optimizer(cfg, where: Path):
    loaded, _, _ = build_stage(cfg, where)
    opt = make_optimizer([p for p in loaded.model.parameters() if p.requires_grad], cfg.train)
    return loaded.model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)


@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt", "rng.pt", "stage-rank0.pt"])
def test_poisoned_file_is_refused_and_its_code_never_runs(tmp_path, finished_run, name):
    src, cfg = finished_run
    latest = ckpt.latest_checkpoint(src / "run" / "checkpoints")
    copy = shutil.copytree(latest, tmp_path / latest.name)
    marker = tmp_path / "ran.txt"
    poison(copy / name, marker)
    model, opt, sched = fresh_model_and_optimizer(cfg, tmp_path / "probe")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ConfigError) as err:
        ckpt.load_checkpoint(copy, model=model, is_peft=False, optimizer=opt, scheduler=sched)
    msg = str(err.value)
    assert str(copy / name) in msg and "refuses to load" in msg and "run code" in msg
    assert "io.open" in msg  # names what the file asked to call
    assert not marker.exists()
    # Nothing was half-restored: the refused checkpoint left the weights and optimizer untouched.
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and not opt.state
    # The premise holds: an unrestricted load of the same file does run the call.
    torch.load(copy / name, weights_only=False)
    assert marker.exists()


def test_train_resume_from_a_poisoned_checkpoint_exits_2_without_running_it(tmp_path, finished_run):
    src, cfg = finished_run
    run_dir = tmp_path / "run"
    shutil.copytree(src / "run", run_dir)
    (run_dir / DONE).unlink()  # as if the run had stopped after its last checkpoint
    latest = ckpt.latest_checkpoint(run_dir / "checkpoints")
    marker = tmp_path / "ran.txt"
    poison(latest / "stage-rank0.pt", marker)
    # A checksum is no defence against whoever can write the files: the manifest is rewritten to match the
    # poisoned file, so the resume verifies it and the weights-only loader is what refuses it.
    write_manifest(latest, {})
    config = tmp_path / "c.yaml"
    config.write_text(to_yaml(cfg.model_copy(update={"run_dir": str(run_dir)})))
    r = subprocess.run([sys.executable, "-m", "trainfit.app.cli", "train", str(config), "--resume"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "refuses to load" in r.stderr
    assert "stage-rank0.pt" in r.stderr.replace("\n", "")
    assert not marker.exists()


def test_an_unmodified_checkpoint_loads_without_running_anything(tmp_path, finished_run):
    # Every file trainfit writes (optimizer, scheduler, RNG, stage state) passes the weights-only
    # loader as it is, so checkpoints written before the loader was restricted resume too.
    src, cfg = finished_run
    latest = ckpt.latest_checkpoint(src / "run" / "checkpoints")
    for f in sorted(latest.glob("*.pt")):
        assert torch.serialization.get_unsafe_globals_in_checkpoint(f) == [], f.name
    model, opt, sched = fresh_model_and_optimizer(cfg, tmp_path / "probe")
    step, state = ckpt.load_checkpoint(latest, model=model, is_peft=False, optimizer=opt, scheduler=sched)
    assert step == 2 and "stage" in state and len(opt.state) > 0


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs the deepspeed extra")
def test_deepspeed_files_are_checked_before_deepspeed_reads_them(tmp_path):
    # DeepSpeed's own loader uses torch.load(weights_only=False); trainfit reads its files first.
    from deepspeed.runtime.zero.config import ZeroStageEnum

    ds = tmp_path / "deepspeed" / "state"
    ds.mkdir(parents=True)
    torch.save({"zero_stage": ZeroStageEnum.gradients, "w": torch.ones(2)}, ds / "optim_states.pt")
    ckpt.check_deepspeed_files(tmp_path / "deepspeed")  # DeepSpeed's own classes pass
    marker = tmp_path / "ran.txt"
    poison(ds / "model_states.pt", marker)
    with pytest.raises(ConfigError, match="refuses to load"):
        ckpt.check_deepspeed_files(tmp_path / "deepspeed")
    assert not marker.exists()
