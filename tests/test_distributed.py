"""Data parallel on CPU (gloo through torchrun): 2 ranks compute what 1 rank computes with the same
global batch; a 2-rank checkpoint resumes on 1 rank; ports and rank counts fail clearly."""

from __future__ import annotations

import importlib.util
import io
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_config
from rich.console import Console

from trainfit.config import load_config, to_yaml
from trainfit.train.report import read_metrics
from trainfit.train.run import run_pipeline

REWARD = str(Path(__file__).parent / "data" / "rewards_for_tests.py") + ":length_reward"


def train(config: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainfit.app.cli", "train", str(config), *overrides],
                          capture_output=True, text=True, timeout=600)


def train_here(config: Path, *overrides: str) -> None:
    """The 1-rank reference run, in this process (the 2-rank run is the one that needs the launcher):
    the same pipeline `trainfit train` runs, without a second interpreter's ~10 s of imports."""
    run_pipeline(load_config(config, list(overrides)), console=Console(file=io.StringIO()))


def write(cfg, path: Path) -> Path:
    path.write_text(to_yaml(cfg))
    return path


def final_params(run_dir: Path) -> torch.Tensor:
    sd = load_file(str(run_dir / "final" / "model.safetensors"))
    return torch.cat([sd[k].flatten() for k in sorted(sd)])


def losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"}


def stage_cfg(tmp_path, stage: str, name: str, **kw):
    extra = {"task.rewards": f"[{REWARD}]", "rollout.max_new_tokens": 5} if stage == "grpo" else {}
    return tiny_config(tmp_path, stage, **{"run_dir": str(tmp_path / name), "train.max_steps": 3,
                                           "train.micro_batch_size": 2, "grpo.beta": 0.05, **extra, **kw})


# DeepSpeed runs on CPU (its `cpu` accelerator) but builds a small op on first use: slow, and an extra.
NEEDS_DS = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                                 reason="needs the deepspeed extra")]
STRATEGY_ARGS = {"ddp": ["distributed.strategy=ddp"], "fsdp": ["distributed.strategy=fsdp"],
                 "deepspeed": ["distributed.strategy=deepspeed", "distributed.zero_stage=2"]}


@pytest.mark.parametrize("stage,strategy", [
    # SFT under FSDP on 2 ranks also runs (and is compared with 1 rank) in
    # test_two_rank_checkpoint_resumes_on_one_rank[fsdp]; GRPO under FSDP (with LoRA) in
    # test_fsdp_adapters.py::test_grpo_with_lora_on_two_fsdp_ranks_equals_one_rank; GRPO under
    # DDP in test_grpo_variants.py::test_reinforce_pp_batch_statistics_span_ranks (its advantages span ranks).
    ("sft", "ddp"), pytest.param("grpo", "ddp", marks=pytest.mark.slow),
    pytest.param("sft", "fsdp", marks=pytest.mark.slow), pytest.param("grpo", "fsdp", marks=pytest.mark.slow),
    pytest.param("sft", "deepspeed", marks=NEEDS_DS), pytest.param("grpo", "deepspeed", marks=NEEDS_DS)])
def test_two_ranks_equal_one_rank(tmp_path, stage, strategy):
    config = write(stage_cfg(tmp_path, stage, "x"), tmp_path / "c.yaml")
    train_here(config, f"run_dir={tmp_path / 'one'}")
    two = train(config, f"run_dir={tmp_path / 'two'}", "distributed.num_gpus=2", *STRATEGY_ARGS[strategy])
    assert two.returncode == 0, two.stderr[-3000:]
    assert "2 ranks" in two.stdout and "x devices 2" in two.stdout.replace("\n", " ")
    a, b = final_params(tmp_path / "one"), final_params(tmp_path / "two")
    assert (a - b).norm() / a.norm() < 1e-5
    for step, loss in losses(tmp_path / "one").items():
        assert losses(tmp_path / "two")[step] == pytest.approx(loss, rel=1e-5, abs=1e-7)
    # ...and the comparison is not vacuous: three steps moved the weights away from the init.
    from trainfit.config import ModelConfig, PeftConfig
    from trainfit.models.policy import load_policy
    init = load_policy(ModelConfig(name="preset:tiny"), PeftConfig(), torch.device("cpu")).model.state_dict()
    sd = load_file(str(tmp_path / "one" / "final" / "model.safetensors"))
    assert (torch.cat([init[k].flatten() for k in sorted(sd)]) - a).norm() > 1e-3


# FSDP (sharded state gathered to a full checkpoint) stays in the default suite; DDP's checkpoint is
# rank 0's whole state, the simpler case (slow-only, ~20 s on 2 cores).
@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.slow), "fsdp"])
def test_two_rank_checkpoint_resumes_on_one_rank(tmp_path, strategy):
    cfg = stage_cfg(tmp_path, "sft", "x", **{"train.max_steps": 4, "train.save_every": 2,
                                             "distributed.strategy": strategy})
    config = write(cfg, tmp_path / "c.yaml")
    # The uninterrupted run is the 1-rank one (2 ranks train what 1 rank trains: the equality tests above),
    # so the 2-rank steps 1-3 before the kill are compared with it too.
    train_here(config, f"run_dir={tmp_path / 'full'}")
    cut = train(config, f"run_dir={tmp_path / 'cut'}", "distributed.num_gpus=2", "--fault", "kill_after_step:3")
    assert cut.returncode != 0  # the ranks were killed
    resumed = train(config, f"run_dir={tmp_path / 'cut'}", "--resume")  # 1 rank now
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    want, got = losses(tmp_path / "full"), losses(tmp_path / "cut")
    assert sorted(got) == [1, 2, 3, 4]
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-7), step


@pytest.mark.parametrize("strategy", [pytest.param("deepspeed", marks=NEEDS_DS)])
def test_deepspeed_checkpoint_resumes_on_the_same_ranks(tmp_path, strategy):
    cfg = stage_cfg(tmp_path, "sft", "x", **{"train.max_steps": 4, "train.save_every": 2})
    config = write(cfg, tmp_path / "c.yaml")
    args = ["distributed.num_gpus=2", *STRATEGY_ARGS[strategy]]
    full = train(config, f"run_dir={tmp_path / 'full'}", *args)
    assert full.returncode == 0, full.stderr[-3000:]
    cut = train(config, f"run_dir={tmp_path / 'cut'}", *args, "--fault", "kill_after_step:3")
    assert cut.returncode != 0
    resumed = train(config, f"run_dir={tmp_path / 'cut'}", *args, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    want, got = losses(tmp_path / "full"), losses(tmp_path / "cut")
    assert sorted(got) == [1, 2, 3, 4]
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-7), step


@pytest.mark.slow  # ~15 s of two-rank start-up for the port choice alone (make test's time budget)
def test_master_port_auto_avoids_a_busy_default_port(tmp_path):
    config = write(stage_cfg(tmp_path, "sft", "x", **{"train.max_steps": 1}), tmp_path / "c.yaml")
    first = int(os.environ.get("MASTER_PORT") or 29500)  # the port `auto` tries first
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            busy.bind(("127.0.0.1", first))
        except OSError:
            pass  # already taken by something else: the test's premise holds anyway
        busy.listen()
        ok = train(config, f"run_dir={tmp_path / 'auto'}", "distributed.num_gpus=2")
        assert ok.returncode == 0, ok.stderr[-3000:]
        assert f"--master_port={first}" not in ok.stdout
        taken = train(config, f"run_dir={tmp_path / 'fixed'}", "distributed.num_gpus=2",
                      f"distributed.master_port={first}")
        assert taken.returncode == 2 and "already in use" in taken.stderr and "master_port=auto" in taken.stderr


def test_master_port_auto_tries_the_master_port_variable_first(tmp_path, monkeypatch):
    from trainfit.core import dist

    cfg = stage_cfg(tmp_path, "sft", "x", **{"distributed.num_gpus": 2})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    monkeypatch.setenv("MASTER_PORT", str(free))
    assert dist.resolve_port(cfg.distributed) == free
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", free))
        busy.listen()
        other = dist.resolve_port(cfg.distributed)
        assert other != free and other > 0


def test_rank_count_must_divide_the_batch_and_match_the_launcher(tmp_path):
    config = write(stage_cfg(tmp_path, "sft", "x"), tmp_path / "c.yaml")
    bad = train(config, "distributed.num_gpus=3")
    assert bad.returncode == 2 and "not divisible by the device count 3" in bad.stderr
    from trainfit.config import ConfigError
    from trainfit.train.run import run_pipeline
    with pytest.raises(ConfigError, match="asks for 2 ranks"):
        run_pipeline(stage_cfg(tmp_path, "sft", "y", **{"distributed.num_gpus": 2}))


def test_more_gpus_than_are_visible_are_refused_before_launch(tmp_path, monkeypatch):
    # On a CUDA machine (train.device=auto) the launcher counts the visible devices; CPU ranks need none.
    from trainfit.config import ConfigError
    from trainfit.train.launch import check_launch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    two = stage_cfg(tmp_path, "sft", "g", **{"train.device": "auto", "distributed.num_gpus": 2})
    with pytest.raises(ConfigError, match=r"distributed.num_gpus=2 but only 1 CUDA device\(s\) are visible "
                                          r"\(CUDA_VISIBLE_DEVICES=3\); set distributed.num_gpus=1"):
        check_launch(two)
    check_launch(stage_cfg(tmp_path, "sft", "c", **{"distributed.num_gpus": 2}))  # train.device=cpu: gloo ranks
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_launch(two)  # both visible: it launches


def test_deepspeed_without_the_extra_says_how_to_install(tmp_path, monkeypatch):
    from trainfit.config import ConfigError
    from trainfit.train.launch import check_launch

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    cfg = stage_cfg(tmp_path, "sft", "z", **{"distributed.num_gpus": 2, "distributed.zero_stage": 2})  # auto + ZeRO
    with pytest.raises(ConfigError, match=r"trainfit\[deepspeed\]"):
        check_launch(cfg)


@pytest.mark.parametrize("strategy", [pytest.param("deepspeed", marks=NEEDS_DS)])
def test_single_process_deepspeed_matches_plain(tmp_path, strategy):
    # One GPU + ZeRO is a common set-up: trainfit launches it through torchrun with one process.
    config = write(stage_cfg(tmp_path, "sft", "x"), tmp_path / "c.yaml")
    plain = train(config, f"run_dir={tmp_path / 'plain'}")
    ds = train(config, f"run_dir={tmp_path / 'ds'}", *STRATEGY_ARGS[strategy])
    assert plain.returncode == 0 and ds.returncode == 0, ds.stderr[-3000:]
    assert "launching 1 ranks" in ds.stdout
    a, b = final_params(tmp_path / "plain"), final_params(tmp_path / "ds")
    assert (a - b).norm() / a.norm() < 1e-5


def test_deepspeed_settings_the_trainer_does_not_run_are_refused(tmp_path):
    from trainfit.config import ConfigError
    from trainfit.train.launch import check_launch
    # ZeRO 1-3 and offload run (tests/test_deepspeed_offload.py); parameter offload below ZeRO-3 does not.
    for extra in ({"distributed.zero_stage": 2, "distributed.offload_params": True},
                  {"distributed.zero_stage": 1, "distributed.offload_params": True, "distributed.offload_optimizer": True}):
        with pytest.raises(ConfigError, match="offload_params=true needs zero_stage=3"):
            check_launch(stage_cfg(tmp_path, "sft", "q", **{"distributed.strategy": "deepspeed", **extra}))


def test_multi_node_prints_one_command_per_node(tmp_path, monkeypatch):
    from trainfit.core.dist import node_commands
    monkeypatch.delenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raising=False)
    cfg = stage_cfg(tmp_path, "sft", "n", **{"distributed.num_nodes": 2, "distributed.num_gpus": 4,
                                             "distributed.master_addr": "10.0.0.5", "train.global_batch_size": 16})
    lines = node_commands(cfg.distributed, ["train", "c.yaml"], port=29511)
    assert len(lines) == 2
    for rank, line in enumerate(lines):
        assert f"--node_rank={rank}" in line and "--nnodes=2" in line and "--nproc_per_node=4" in line
        assert "--master_addr=10.0.0.5" in line and "--master_port=29511" in line
        # torchrun gives the ranks 15 minutes, not its 30 s, to checkpoint after a Ctrl-C before it kills them
        assert "--shutdown-timeout=900" in line
        assert line.endswith("-m trainfit.app.cli train c.yaml")


def test_cpu_runs_stay_on_gloo_when_a_gpu_is_visible(tmp_path, monkeypatch):
    # train.device=cpu means CPU processes on gloo (the tests above), whatever the machine has.
    from trainfit.core.dist import uses_cuda
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not uses_cuda(stage_cfg(tmp_path, "sft", "c").train)
    assert uses_cuda(stage_cfg(tmp_path, "sft", "a", **{"train.device": "auto"}).train)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not uses_cuda(stage_cfg(tmp_path, "sft", "a", **{"train.device": "auto"}).train)
