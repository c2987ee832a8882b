"""trainfit.app.export: DeepSpeed JSON, accelerate YAML and launch scripts from one config, consistent by
construction (train_batch_size = micro x accumulation x world) and accepted by doctor's checker and,
when installed, by DeepSpeed's own config parser."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from trainfit.config import load_config
from trainfit.app.doctor.lint_deepspeed import batch_findings, find_auto
from trainfit.app.export import (accelerate_config, deepspeed_config, export_all, launch_commands, launch_script,
                             resolve_strategy)

ROOT = Path(__file__).parent.parent
BASE = {"stage": "sft", "task": {"name": "arithmetic"}, "model": {"name": "preset:tiny"},
        "train": {"global_batch_size": 32, "micro_batch_size": 1}}


def cfg_of(**dotted):
    return load_config(None, [f"{k}={v}" for k, v in dotted.items()], base=BASE)


# (global, micro, gpus per node, nodes, zero stage, offload optimizer, offload params, dtype)
GRID = [(32, 8, 1, 1, 0, False, False, "fp32"), (64, 2, 8, 1, 3, False, False, "bf16"),
        (48, 3, 4, 1, 2, True, False, "bf16"), (128, 4, 8, 2, 3, True, True, "fp16"),
        (96, 6, 2, 1, 1, False, False, "bf16"), (16, 1, 16, 1, 3, False, True, "bf16")]


@pytest.mark.parametrize("gb,mb,gpus,nodes,stage,oo,op,dtype", GRID)
def test_deepspeed_numbers_come_from_the_config(gb, mb, gpus, nodes, stage, oo, op, dtype):
    cfg = cfg_of(**{"train.global_batch_size": gb, "train.micro_batch_size": mb, "distributed.num_gpus": gpus,
                    "distributed.num_nodes": nodes, "distributed.zero_stage": stage, "distributed.strategy": "deepspeed",
                    "distributed.offload_optimizer": oo, "distributed.offload_params": op, "model.dtype": dtype,
                    "train.grad_clip": 0.5})
    ds, world = deepspeed_config(cfg), gpus * nodes
    # e.g. (48, 3, 4 GPUs): per GPU 12 = micro 3 x accumulation 4; 3 x 4 x 4 = 48.
    assert ds["train_batch_size"] == gb == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * world
    assert ds["train_micro_batch_size_per_gpu"] == mb
    assert find_auto(ds) == []
    assert batch_findings(ds, world, "test", "ds.json") == []
    z = ds["zero_optimization"]
    assert z["stage"] == stage
    assert ("offload_optimizer" in z) == (oo and stage > 0)
    assert ("offload_param" in z) == (op and stage == 3)
    assert ds["bf16"]["enabled"] == (dtype == "bf16") and ds["fp16"]["enabled"] == (dtype == "fp16")
    assert ds["gradient_clipping"] == 0.5
    json.dumps(ds)  # plain JSON types only


@pytest.mark.parametrize("gb,mb,gpus,nodes,stage,oo,op,dtype", GRID)
def test_deepspeed_accepts_the_exported_config(tmp_path, monkeypatch, deepspeed_config_parser, gb, mb, gpus, nodes, stage, oo, op, dtype):
    parse = deepspeed_config_parser()
    cfg = cfg_of(**{"train.global_batch_size": gb, "train.micro_batch_size": mb, "distributed.num_gpus": gpus,
                    "distributed.num_nodes": nodes, "distributed.zero_stage": stage, "distributed.strategy": "deepspeed",
                    "distributed.offload_optimizer": oo, "distributed.offload_params": op, "model.dtype": dtype})
    # The JSON generator itself, for every ZeRO/offload setting (export_all writes only what train runs).
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(deepspeed_config(cfg)))
    parsed = parse(path, gpus * nodes)
    bp = cfg.batch_plan()
    assert (parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps) == \
        (bp.global_batch, bp.micro_batch, bp.accumulation)
    assert parsed.zero_optimization_stage == stage


# Corpus DeepSpeed files at a world size: doctor's error-level findings are the ones DeepSpeed refuses.
DS_CORPUS = [("ds_batch_mismatch.json", 2, True), ("ds_batch_world.json", 4, True), ("ds_auto_native/ds_config.json", 4, True),
             ("ds_fp16_and_bf16.json", 1, True), ("ds_missing_batch.json", 1, True),
             ("ds_offload_param_stage2.json", 1, False), ("ds_lr_not_scaled.json", 8, False),
             ("valid/ds_config.json", 8, False)]


@pytest.mark.parametrize("name,world,refused", DS_CORPUS)
def test_deepspeed_and_doctor_agree(monkeypatch, deepspeed_config_parser, name, world, refused):
    from trainfit.app.doctor import Options, run

    parse = deepspeed_config_parser()
    path = ROOT / "tests" / "data" / "doctor" / name
    # A file is linted with its folder's launch line, which says who reads it (for "auto").
    job = [str(p) for p in path.parent.iterdir()] if path.parent.name.startswith("ds_") else [str(path)]
    report = run(job, Options(num_gpus=world, plan=False), machine=False)
    assert (report.exit_code == 1) == refused, [f.code for f in report.findings]
    if refused:
        with pytest.raises((AssertionError, TypeError, ValueError)):
            parse(path, world)
    else:
        parse(path, world)  # hjson: the comment lines and trailing commas are accepted


def test_accelerate_matches_world_size():
    one = accelerate_config(cfg_of())
    assert one["distributed_type"] == "NO" and one["num_processes"] == 1 and one["mixed_precision"] == "no"
    ddp = accelerate_config(cfg_of(**{"distributed.num_gpus": 4, "train.global_batch_size": 32, "model.dtype": "bf16"}))
    assert ddp["distributed_type"] == "MULTI_GPU" and ddp["num_processes"] == 4 and ddp["mixed_precision"] == "bf16"
    ds = accelerate_config(cfg_of(**{"distributed.num_gpus": 8, "train.global_batch_size": 64,
                                     "distributed.zero_stage": 2}), "out/ds_config.json")
    assert ds["distributed_type"] == "DEEPSPEED" and ds["num_processes"] == 8
    assert ds["deepspeed_config"] == {"deepspeed_config_file": "out/ds_config.json", "zero3_init_flag": False}
    assert "mixed_precision" not in ds  # accelerate refuses it next to deepspeed_config_file
    fsdp = accelerate_config(cfg_of(**{"distributed.strategy": "fsdp", "distributed.num_gpus": 2}))
    assert fsdp["distributed_type"] == "FSDP" and fsdp["fsdp_config"]["fsdp_version"] == 2
    multi = accelerate_config(cfg_of(**{"distributed.num_gpus": 8, "distributed.num_nodes": 2,
                                        "train.global_batch_size": 64}))
    assert multi["num_processes"] == 16 and multi["num_machines"] == 2 and multi["main_process_ip"]


def test_launch_commands():
    assert launch_commands(cfg_of()) == ["trainfit train config.yaml"]
    ddp = launch_commands(cfg_of(**{"distributed.num_gpus": 4, "train.global_batch_size": 32}))
    assert ddp == ["torchrun --standalone --nproc_per_node 4 -m trainfit.app.cli train config.yaml"]
    ds = launch_commands(cfg_of(**{"distributed.num_gpus": 4, "train.global_batch_size": 32,
                                   "distributed.strategy": "deepspeed", "distributed.zero_stage": 2}))
    assert ds[0].startswith("deepspeed --num_gpus 4 ") and "--no_local_rank --module trainfit.app.cli train" in ds[0]
    multi = launch_commands(cfg_of(**{"distributed.num_gpus": 8, "distributed.num_nodes": 3,
                                      "train.global_batch_size": 48}))
    assert len(multi) == 3
    for rank, cmd in enumerate(multi):
        assert f"--nnodes 3 --nproc_per_node 8 --node_rank {rank} --master_addr $MASTER_ADDR" in cmd


@pytest.mark.parametrize("over", [{}, {"distributed.num_gpus": 4, "train.global_batch_size": 32},
                                  {"distributed.num_gpus": 2, "distributed.num_nodes": 2, "train.global_batch_size": 32},
                                  {"distributed.num_gpus": 4, "train.global_batch_size": 32,
                                   "distributed.strategy": "deepspeed", "distributed.zero_stage": 3}])
def test_launch_script_is_valid_bash(tmp_path, over):
    script = tmp_path / "launch.sh"
    script.write_text(launch_script(cfg_of(**over)))
    if shutil.which("bash"):
        subprocess.run(["bash", "-n", str(script)], check=True)
    assert script.read_text().count("exec ") == 1


def test_export_all_writes_consistent_files(tmp_path):
    cfg = load_config(ROOT / "examples" / "sft_7b_zero2_offload.yaml",
                      ["distributed.num_gpus=8", "distributed.offload_optimizer=false"])
    files = export_all(cfg, tmp_path)
    assert set(files) == {"config", "deepspeed", "accelerate", "launch"}
    ds = json.loads(files["deepspeed"].read_text())
    acc = yaml.safe_load(files["accelerate"].read_text())
    bp = cfg.batch_plan()
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == \
        (bp.global_batch, bp.micro_batch, bp.accumulation)
    assert acc["num_processes"] == cfg.world_size == 8
    assert Path(acc["deepspeed_config"]["deepspeed_config_file"]) == files["deepspeed"]
    assert load_config(files["config"]).model_dump() == cfg.model_dump()
    assert files["launch"].stat().st_mode & 0o111
    # No DeepSpeed file for a DDP job.
    assert "deepspeed" not in export_all(cfg_of(**{"distributed.num_gpus": 2}), tmp_path / "ddp")


@pytest.mark.parametrize("example,overrides", [
    ("sft_7b_zero2_offload.yaml", ["distributed.offload_params=true"]),  # parameter offload below ZeRO-3
    ("sft_7b_zero2_offload.yaml", ["train.optimizer=adamw_8bit"]),       # CPU Adam cannot step 8-bit states
])
def test_export_refuses_what_train_refuses(tmp_path, example, overrides):
    from trainfit.app.cli import app
    from trainfit.models.runnable import not_trainable

    cfg = load_config(ROOT / "examples" / example, overrides)
    reason = not_trainable(cfg)
    assert reason
    out = CliRunner().invoke(app, ["export", str(ROOT / "examples" / example), "-o", str(tmp_path / "x"), *overrides])
    assert out.exit_code == 2 and "Traceback" not in out.output
    assert reason.split(";")[0] in " ".join(out.output.split())
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").iterdir())


def test_strategy_agrees_with_the_planner():
    states = pytest.importorskip("trainfit.plan.states")
    for over in ({}, {"distributed.num_gpus": 2}, {"distributed.zero_stage": 2}, {"distributed.strategy": "fsdp"},
                 {"distributed.offload_optimizer": True}, {"distributed.strategy": "ddp"}):
        cfg = cfg_of(**over)
        assert resolve_strategy(cfg) == states.parallel_of(cfg).engine, over


def test_export_command(tmp_path):
    from trainfit.app.cli import app

    out = CliRunner().invoke(app, ["export", str(ROOT / "examples" / "sft_7b_zero2_offload.yaml"), "-o",
                                   str(tmp_path), "distributed.num_gpus=2", "distributed.offload_optimizer=false"])
    assert out.exit_code == 0, out.output
    ds = json.loads((tmp_path / "ds_config.json").read_text())
    assert ds["train_batch_size"] == 32 and ds["gradient_accumulation_steps"] == 8
    assert "deepspeed --num_gpus 2" in (tmp_path / "launch.sh").read_text()


@pytest.mark.parametrize("over", [{"distributed.num_gpus": 4, "train.global_batch_size": 32},
                                  {"distributed.num_gpus": 2, "distributed.num_nodes": 2, "train.global_batch_size": 32},
                                  {"distributed.num_gpus": 4, "train.global_batch_size": 32,
                                   "distributed.strategy": "deepspeed", "distributed.zero_stage": 2}])
def test_launch_script_starts_world_size_processes(tmp_path, over):
    # Read back with doctor's command-line parser: processes per node x nodes == the config's world size.
    from trainfit.app.doctor.files import load_doc

    cfg = cfg_of(**over)
    cmds = [c for c in load_doc(str(export_all(cfg, tmp_path)["launch"])).commands if c.script]
    assert len(cmds) == 1 and cmds[0].procs_per_node() * cmds[0].nodes() == cfg.world_size
    assert cmds[0].launcher == ("deepspeed" if resolve_strategy(cfg) == "deepspeed" and cfg.distributed.num_nodes == 1
                                else "torchrun")
