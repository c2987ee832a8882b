"""`train --overwrite` discards the whole previous run before the first step (issue 21): a re-run
stopped early leaves nothing of the old run, so `serve` on the run dir refuses instead of serving the
old model; and it never deletes a directory holding files a run does not write. CPU (train.device=cpu)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import tiny_config
from trainfit.app.cli import app
from trainfit.config import ConfigError, load_config, to_yaml
from trainfit.core.ports import free_port
from trainfit.train import rundir

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "demo.yaml"
# The demo pipeline (SFT then GRPO) cut to a few steps: SFT checkpoints at steps 2 and 4.
SHORT = ["train.device=cpu", "task.num_eval=8", "logging.plot=false",
         "stages.0.train.max_steps=4", "stages.0.train.save_every=2", "stages.0.train.eval_every=2",
         "stages.1.train.max_steps=1", "stages.1.train.global_batch_size=16", "stages.1.train.micro_batch_size=16",
         "stages.1.train.save_every=1"]


def _train(run: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainfit.app.cli", "train", str(DEMO), *SHORT, f"run_dir={run}", *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def _files(run: Path) -> list[Path]:
    return sorted(p for p in run.rglob("*") if p.is_file())


@pytest.mark.multiprocess
def test_overwrite_stopped_after_the_first_checkpoint_leaves_nothing_of_the_old_run(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    run = tmp_path / "run"
    first = CliRunner().invoke(app, ["train", str(DEMO), *SHORT, f"run_dir={run}"])  # in process: faster
    assert first.exit_code == 0, first.output
    assert (run / "1-grpo" / "final" / "model.safetensors").is_file() and (run / "summary.json").is_file()
    started = time.time()
    time.sleep(0.05)  # every file of the new run is written after this
    again = _train(run, "--overwrite", "--fault", "kill_after_step:2")
    assert again.returncode == -signal.SIGKILL, again.stderr[-2000:]
    now = _files(run)
    # The old run's results are gone, not waiting to be replaced: no final model, summary or marker,
    # no GRPO stage, no step-4 checkpoint; what is there was written by the new run.
    for gone in ("summary.json", "0-sft/DONE", "0-sft/final", "1-grpo", "0-sft/checkpoints/step-000004"):
        assert not (run / gone).exists(), gone
    assert all(p.stat().st_mtime >= started for p in now), [p for p in now if p.stat().st_mtime < started]
    assert (run / "0-sft" / "checkpoints" / "step-000002" / "model.safetensors").is_file()
    assert not list(tmp_path.glob("run.overwritten-*"))  # the renamed old run was deleted too
    # serve on the run dir refuses (exit 2) and names the new run's checkpoint rather than serving the old model.
    served = CliRunner().invoke(app, ["serve", str(run), "--device", "cpu"])
    assert served.exit_code == 2, served.output
    text = " ".join(served.output.split())
    assert "without a final model" in text and "step-000002" in text and "Traceback" not in text


def test_overwrite_refuses_a_dir_with_files_a_run_does_not_write(tmp_path, monkeypatch):
    run = tmp_path / "mine"
    (run / "0-sft" / "checkpoints").mkdir(parents=True)
    (run / "summary.json").write_text("{}")
    (run / "notes.txt").write_text("my notes")
    (run / "0-sft" / "data.jsonl").write_text("{}\n")
    cfg = load_config(DEMO, [f"run_dir={run}"])
    with pytest.raises(ConfigError) as e:
        rundir.check_run_dir(cfg.run_dir, resume=False, overwrite=True)
    assert "notes.txt" in str(e.value) and "0-sft/data.jsonl" in str(e.value) and "run_dir=" in str(e.value)
    with pytest.raises(ConfigError):
        rundir.discard_previous_run(run)
    assert (run / "notes.txt").read_text() == "my notes" and (run / "summary.json").exists()
    # The working directory (or one above it) is never a run dir to delete, even when empty.
    monkeypatch.chdir(run / "0-sft")
    (run / "notes.txt").unlink()
    (run / "0-sft" / "data.jsonl").unlink()
    for where in (run / "0-sft", run):
        with pytest.raises(ConfigError) as e:
            rundir.check_discardable(where)
        assert "working directory" in str(e.value)


def test_discard_is_one_rename_and_clears_what_an_interrupted_discard_left(tmp_path, monkeypatch):
    run = tmp_path / "run"
    (run / "0-sft" / "final").mkdir(parents=True)
    (run / "0-sft" / "final" / "config.json").write_text("{}")
    (run / "summary.json").write_text("{}")
    left = tmp_path / "run.overwritten-20240101-000000-7"  # a discard killed between rename and delete
    (left / "0-sft").mkdir(parents=True)
    renamed = []
    real_rename = Path.rename
    monkeypatch.setattr(Path, "rename", lambda self, target: renamed.append((self, target)) or real_rename(self, target))
    moved = rundir.discard_previous_run(run)
    assert renamed == [(run, moved)] and moved.parent == tmp_path
    assert not run.exists() and not moved.exists() and not left.exists()
    assert rundir.discard_previous_run(run) is None  # nothing there: nothing to do


def test_symlinked_run_dir_is_refused(tmp_path):
    target = tmp_path / "real"
    target.mkdir()
    os.symlink(target, tmp_path / "link")
    with pytest.raises(ConfigError) as e:
        rundir.check_discardable(tmp_path / "link")
    assert "symbolic link" in str(e.value)


def _torchrun_case(tmp_path):
    """An old single-stage run in run_dir and the by-hand torchrun command that trains over it with --overwrite."""
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "final" / "config.json").write_text("{}")  # an old run's final model, and its marker
    (run / "summary.json").write_text("{}")
    config = tmp_path / "c.yaml"
    config.write_text(to_yaml(tiny_config(tmp_path, "sft", **{"run_dir": str(run), "train.max_steps": 1,
                                                              "train.micro_batch_size": 2,
                                                              "distributed.num_gpus": 2})))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "trainfit.app.cli", "train", str(config), "--overwrite"]
    return run, cmd


@pytest.mark.multiprocess
def test_under_torchrun_rank_0_discards_before_the_ranks_train(tmp_path):
    run, cmd = _torchrun_case(tmp_path)
    ok = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert ok.stdout.count("discarded the previous run") == 1  # rank 0 only
    assert (run / "summary.json").stat().st_size > 2 and (run / "final" / "config.json").read_text() != "{}"


@pytest.mark.slow  # the refusal itself is tested fast above (test_overwrite_refuses_a_dir_...)
def test_under_torchrun_a_refusal_stops_every_rank(tmp_path):
    """Where rank 0 refuses, the run stops with its paragraph and deletes nothing (no rank waits forever)."""
    run, cmd = _torchrun_case(tmp_path)
    (run / "notes.txt").write_text("mine")
    refused = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert refused.returncode != 0 and "notes.txt" in refused.stderr, refused.stderr[-3000:]
    assert (run / "final" / "config.json").exists() and (run / "notes.txt").exists()
