"""train.cpu_threads (issue 21): a CPU run chooses its torch thread count from the cores it may use and
the model's size, says so at start, and takes an explicit count or the user's OMP_NUM_THREADS over `auto`.
CPU (train.device=cpu)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from trainfit.core import threads
from trainfit.app.cli import app

ROOT = Path(__file__).resolve().parents[1]
TINY = [str(ROOT / "examples" / "pretrain.yaml"), "model.name=preset:tiny", "train.device=cpu", "train.max_steps=1",
        "logging.plot=false"]


def test_auto_gives_a_tiny_model_one_thread_and_a_large_one_the_cores_per_rank():
    # 0.16M parameters = preset:tiny; 200M is over threads.SMALL_MODEL (bench/results/cpu_threads.json).
    assert threads.auto_threads(cores=2, params=160_000) == 1
    assert threads.auto_threads(cores=16, params=160_000) == 1
    assert threads.auto_threads(cores=16, params=threads.SMALL_MODEL - 1) == 1
    assert threads.auto_threads(cores=2, params=200_000_000) == 2
    assert threads.auto_threads(cores=16, params=200_000_000, local_ranks=4) == 4   # 16 cores / 4 ranks
    assert threads.auto_threads(cores=2, params=200_000_000, local_ranks=4) == 1    # never below one


def test_explicit_count_beats_the_environment_which_beats_auto():
    env = {"OMP_NUM_THREADS": "3"}
    assert threads.choose(2, params=160_000, cores=2, env=env) == (2, "train.cpu_threads=2")
    n, why = threads.choose("auto", params=160_000, cores=2, env=env)
    assert n == 3 and "OMP_NUM_THREADS=3" in why
    # torchrun sets OMP_NUM_THREADS=1 for the ranks trainfit launches: that is not the user's choice.
    n, why = threads.choose("auto", params=200_000_000, cores=2, env={**env, threads.NOT_FROM_USER: "1"})
    assert n == 2 and why == "auto: 2 cores available, 200.00M-parameter model"
    assert threads.choose("auto", params=160_000, cores=2, env={"OMP_NUM_THREADS": "0"})[0] == 1
    assert threads.launch_env({})[threads.NOT_FROM_USER] == "1"
    assert threads.NOT_FROM_USER not in threads.launch_env({"OMP_NUM_THREADS": "4"})


def test_cores_are_capped_by_the_cgroup_quota(tmp_path):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("150000 100000\n")   # 1.5 CPUs
    assert threads.cgroup_cpus(v2) == 1.5
    assert threads.available_cores(v2) == 1
    (v2 / "cpu.max").write_text("max 100000\n")
    assert threads.cgroup_cpus(v2) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("400000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert threads.cgroup_cpus(v1) == 4.0
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert threads.cgroup_cpus(v1) is None
    assert threads.cgroup_cpus(tmp_path / "none") is None


def test_a_cpu_run_says_and_sets_its_thread_count(tmp_path, monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        torch.set_num_threads(2)
        auto = CliRunner().invoke(app, ["train", *TINY, f"run_dir={tmp_path / 'a'}"])
        assert auto.exit_code == 0, auto.output
        cores = threads.available_cores()
        assert f"CPU threads: 1 (auto: {cores} cores available, 0.16M-parameter model)" in auto.output
        assert torch.get_num_threads() == 1
        fixed = CliRunner().invoke(app, ["train", *TINY, f"run_dir={tmp_path / 'b'}", "train.cpu_threads=2"])
        assert fixed.exit_code == 0, fixed.output
        assert "CPU threads: 2 (train.cpu_threads=2)" in fixed.output and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_rollout_worker_process_takes_half_the_threads(monkeypatch):
    # rollout.worker=process: trainer and worker split the count, at least one each (1 + 1 on 2 cores).
    assert [threads.split_for_worker(n) for n in (1, 2, 4, 5)] == [(1, 1), (1, 1), (2, 2), (3, 2)]
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        line = threads.apply(4, params=10, device=torch.device("cpu"), worker_process=True)
        assert torch.get_num_threads() == 2
        assert line.startswith("CPU threads: 2 for training + 2 for the rollout worker process")
        assert threads.worker_threads(4, params=10) == 2 and threads.worker_threads("auto", params=10) == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("value,words", [("0", "train.cpu_threads=0"), ("many", "'auto' or an integer")])
def test_a_bad_thread_count_is_one_paragraph(value, words):
    r = CliRunner().invoke(app, ["config", *TINY, f"train.cpu_threads={value}"])
    assert r.exit_code == 2 and words in " ".join(r.output.split()) and "Traceback" not in r.output
