"""Crash safety: SIGKILL after a checkpoint then --resume equals an uninterrupted run, and a kill
in the middle of writing a checkpoint leaves the previous one as `latest`, loadable."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from conftest import tiny_config
from trainfit.config import to_yaml
from trainfit.train import checkpoint as ckpt
from trainfit.train.run import build_stage, run_pipeline
from trainfit.train.loop import make_optimizer
from trainfit.train.report import read_metrics

QUIET = Console(file=open("/dev/null", "w"))


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"}


def write_config(cfg, path: Path) -> Path:
    path.write_text(to_yaml(cfg))
    return path


def run_cli(config: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainfit.app.cli", "train", str(config), *args],
                          capture_output=True, text=True, timeout=300)


def _cli_child(argv: list[str], log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)
    from trainfit.app.cli import app

    app(argv, prog_name="trainfit")


def killed_run(config: Path, *args: str) -> subprocess.CompletedProcess:
    """`trainfit train <config> <args>` (a --fault that kills) in a forked child of this process:
    a process of its own that dies mid-run as a fresh one would, without a fresh interpreter's ~10 s of
    imports. The resume that follows is a fresh process (run_cli), so it carries nothing from this one."""
    import torch

    if torch.cuda.is_initialized():  # a forked child cannot use CUDA again: a fresh process then
        return run_cli(config, *args)
    log = str(config.with_suffix(".killed.log"))
    child = multiprocessing.get_context("fork").Process(target=_cli_child, args=(["train", str(config), *args], log))
    child.start()
    child.join(300)
    if child.exitcode is None:
        child.kill()
        child.join()
    text = Path(log).read_text()
    return subprocess.CompletedProcess(child.pid, child.exitcode, text, text)


def kill_then_resume(config: Path, run_dir: Path, expected: dict[int, float]) -> None:
    """SIGKILL after step 4 (checkpoints every 3 steps), then --resume: the same per-step losses."""
    killed = killed_run(config, "--fault", "kill_after_step:4")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert ckpt.latest_checkpoint(run_dir / "checkpoints").name == "step-000003"
    assert max(train_losses(run_dir)) == 4  # step 4 was logged, then lost with the kill
    resumed = run_cli(config, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout
    got = train_losses(run_dir)
    assert sorted(got) == sorted(expected)
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-7), f"step {step}"


def grpo_cfg(tmp_path, name: str):
    # num_iterations=2: the rollout buffer must survive the kill too (checkpoint at odd/even steps).
    return tiny_config(tmp_path, "grpo", **{"run_dir": str(tmp_path / name), "train.max_steps": 6,
                                            "train.save_every": 3, "grpo.num_iterations": 2,
                                            "grpo.beta": 0.05, "rollout.max_new_tokens": 5})


@pytest.mark.parametrize("stage", ["sft", "grpo"])
def test_sigkill_then_resume_matches_uninterrupted(tmp_path, stage):
    if stage == "grpo":
        ref_cfg, cut_cfg = grpo_cfg(tmp_path, "ref"), grpo_cfg(tmp_path, "cut")
    else:
        common = {"train.max_steps": 6, "train.save_every": 3, "train.global_batch_size": 4,
                  "train.micro_batch_size": 2}
        ref_cfg = tiny_config(tmp_path, "sft", run_dir=str(tmp_path / "ref"), **common)
        cut_cfg = tiny_config(tmp_path, "sft", run_dir=str(tmp_path / "cut"), **common)
    run_pipeline(ref_cfg, console=QUIET)
    expected = train_losses(tmp_path / "ref")
    assert sorted(expected) == [1, 2, 3, 4, 5, 6]

    kill_then_resume(write_config(cut_cfg, tmp_path / "cut.yaml"), tmp_path / "cut", expected)


def test_kill_during_checkpoint_write_keeps_previous(tmp_path):
    cfg = grpo_cfg(tmp_path, "run")
    config = write_config(cfg, tmp_path / "run.yaml")
    killed = killed_run(config, "--fault", "kill_in_checkpoint:6")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    root = tmp_path / "run" / "checkpoints"
    assert (root / ".tmp-step-000006").is_dir()           # the half-written one
    latest = ckpt.latest_checkpoint(root)
    assert latest is not None and latest.name == "step-000003"

    # The previous checkpoint loads into a fresh model and optimizer.
    loaded, stage, _ = build_stage(cfg, tmp_path / "probe")
    opt = make_optimizer([p for p in loaded.model.parameters() if p.requires_grad], cfg.train)
    sched = __import__("torch").optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    step, state = ckpt.load_checkpoint(latest, model=loaded.model, is_peft=False, optimizer=opt, scheduler=sched)
    assert step == 3 and state["stage"]["buffer_round"] == 1
    assert len(opt.state) > 0

    resumed = run_cli(config, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert not (root / ".tmp-step-000006").exists()
    assert ckpt.latest_checkpoint(root).name == "step-000006"
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()


def interrupted_run(config: Path, run_dir: Path, signum: int) -> subprocess.CompletedProcess:
    """`trainfit train <config>` in a forked child (as killed_run), sent `signum` once metrics.jsonl shows a
    training step; (exit code, its output)."""
    import time

    log = str(config.with_suffix(".signal.log"))
    child = multiprocessing.get_context("fork").Process(target=_cli_child, args=(["train", str(config)], log))
    child.start()
    metrics = run_dir / "metrics.jsonl"
    while child.is_alive() and not (metrics.is_file() and any(
            json.loads(line).get("kind") == "train" for line in metrics.read_text().splitlines() if line.strip())):
        time.sleep(0.02)
    os.kill(child.pid, signum)
    child.join(120)
    text = Path(log).read_text()
    return subprocess.CompletedProcess(child.pid, child.exitcode, text, text)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_checkpoints_the_step_reached_and_resume_continues(tmp_path, signum):
    """CPU: SIGINT / SIGTERM finish the step, checkpoint it, print the resume command and exit 130 / 143;
    --resume continues from that checkpoint to the stage's step count."""
    import torch
    from typer.testing import CliRunner

    from trainfit.app.cli import app

    if torch.cuda.is_initialized():
        pytest.skip("a forked child cannot use CUDA again")
    # A constant schedule: the resume below may shorten the stage (train.max_steps may change on resume there).
    cfg = tiny_config(tmp_path, "sft", **{"train.max_steps": 1000, "train.save_every": 0, "train.schedule": "constant"})
    run_dir = Path(cfg.run_dir)
    config = write_config(cfg, tmp_path / "sft.yaml")
    stopped = interrupted_run(config, run_dir, signum)
    assert stopped.returncode == 128 + signum, stopped.stdout[-2000:]
    reached = max(train_losses(run_dir))
    assert 1 <= reached < 1000
    latest = ckpt.latest_checkpoint(run_dir / "checkpoints")
    assert latest is not None and latest.name == f"step-{reached:06d}"   # save_every=0: written for the signal
    text = " ".join(stopped.stdout.split())
    assert f"{signal.Signals(signum).name}: stage sft stopped after step {reached}, checkpointed in {latest}" in text
    assert f"Continue with: trainfit train {config} --resume" in text
    assert "Traceback" not in text

    end = reached + 2
    resumed = CliRunner().invoke(app, ["train", str(config), "--resume", f"train.max_steps={end}"])
    assert resumed.exit_code == 0, resumed.output
    assert f"resumed from {latest} at step {reached}" in " ".join(resumed.output.split())
    assert sorted(train_losses(run_dir)) == list(range(1, end + 1))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stages"][0]["steps"] == end   # the stage's steps, not the resumed process's 2
    assert "max_steps: 1000" in (run_dir / "config.yaml").read_text()   # the run's own config is kept
    assert "train.max_steps 1000 -> " in resumed.output


def test_a_signal_in_a_stages_last_step_ends_the_pipeline_before_the_next_stage(tmp_path, monkeypatch):
    """CPU: the stage asked to stop in its last step finishes (evaluated, saved, DONE); the next one does not
    start, and --resume trains it."""
    from trainfit.train.faults import Faults
    from trainfit.train.interrupt import Interrupted

    cfg = tiny_config(tmp_path, "sft", **{"stages": "[{stage: sft}, {stage: sft}]", "train.max_steps": 2})
    run_dir = Path(cfg.run_dir)
    # The signal comes from outside as a real one would, during stage 0's last step.
    monkeypatch.setattr(Faults, "after_step", lambda self, step: os.kill(os.getpid(), signal.SIGTERM)
                        if not (run_dir / "0-sft" / "final").exists() and step == 2 else None)
    with pytest.raises(Interrupted) as e:
        run_pipeline(cfg, console=QUIET)
    assert e.value.exit_code == 143 and e.value.stage == "1-sft" and e.value.checkpoint is None
    assert (run_dir / "0-sft" / "DONE").is_file() and not (run_dir / "1-sft").exists()
    results = run_pipeline(cfg, resume=True, console=QUIET)
    assert [r.steps for r in results] == [2, 2] and (run_dir / "1-sft" / "DONE").is_file()
