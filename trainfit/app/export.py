"""Other tools' files from ONE trainfit config: DeepSpeed JSON, accelerate YAML, and a launch script.

Every batch number comes from `cfg.batch_plan()`, so the files agree with each other and with
`trainfit train` by construction (train_batch_size = micro x accumulation x world). Nothing is
left as "auto": only the HF Trainer / accelerate integration fills "auto", and DeepSpeed launched
any other way fails on it.

    from trainfit.config import load_config
    from trainfit.app.export import export_all
    export_all(load_config("examples/sft_7b_zero2_offload.yaml"), "out/")
    # -> {"config": out/config.yaml, "deepspeed": out/ds_config.json, "accelerate": ..., "launch": ...}
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Optional

import yaml

from trainfit.config import Config, to_yaml
from trainfit.core.ports import DEFAULT_PORT
from trainfit.train.ds_config import deepspeed_config, resolve_strategy

__all__ = ["accelerate_config", "accelerate_yaml", "deepspeed_config", "export_all", "launch_commands",
           "launch_script", "resolve_strategy"]


def accelerate_config(cfg: Config, deepspeed_file: Optional[str] = None) -> dict:
    """An accelerate config with distributed_type consistent with num_processes = world size."""
    strategy, world, nodes = resolve_strategy(cfg), cfg.world_size, cfg.distributed.num_nodes
    out: dict = {"compute_environment": "LOCAL_MACHINE", "debug": False}
    if strategy == "deepspeed":
        out["distributed_type"] = "DEEPSPEED"
        # Only the file: accelerate refuses zero_stage, gradient_accumulation_steps, gradient_clipping,
        # offload devices or mixed_precision next to a deepspeed_config_file.
        out["deepspeed_config"] = {"deepspeed_config_file": deepspeed_file or "ds_config.json",
                                   "zero3_init_flag": cfg.distributed.zero_stage == 3}
        if nodes > 1:
            out["deepspeed_config"]["deepspeed_multinode_launcher"] = "standard"
    elif strategy == "fsdp":
        out["distributed_type"] = "FSDP"
        out["fsdp_config"] = {"fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                              "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_reshard_after_forward": True,
                              "fsdp_offload_params": cfg.distributed.offload_params,
                              "fsdp_cpu_ram_efficient_loading": True,
                              "fsdp_activation_checkpointing": cfg.model.gradient_checkpointing}
    else:
        out["distributed_type"] = "MULTI_GPU" if world > 1 else "NO"
    if strategy != "deepspeed":
        out["mixed_precision"] = {"bf16": "bf16", "fp16": "fp16"}.get(cfg.model.dtype, "no")
    out.update(num_processes=world, num_machines=nodes, machine_rank=0, gpu_ids="all", use_cpu=False,
               downcast_bf16="no", main_training_function="main", rdzv_backend="static", same_network=True)
    if nodes > 1:
        out.update(main_process_ip="MASTER_ADDR_OF_NODE_0", main_process_port=DEFAULT_PORT)
    return out


def accelerate_yaml(cfg: Config, deepspeed_file: Optional[str] = None) -> str:
    acc = accelerate_config(cfg, deepspeed_file)
    head = [f"# accelerate config for {cfg.stage} of {cfg.model.name}, written by `trainfit export`.",
            f"# {cfg.batch_plan().describe()}"]
    if acc["distributed_type"] == "DEEPSPEED":
        head.append("# Precision, ZeRO stage, offload and batch numbers live in the DeepSpeed file; "
                    "deepspeed_config_file is resolved from the directory you launch in.")
    if acc["num_machines"] > 1:
        head.append("# Multi-node: set main_process_ip to node 0's address, and machine_rank to each node's rank "
                    "(or pass --machine_rank N to accelerate launch).")
    return "\n".join(head) + "\n" + yaml.safe_dump(acc, sort_keys=False)


def launch_commands(cfg: Config, config_path: str = "config.yaml", *, master_addr: str = "$MASTER_ADDR",
                    port: str = f"${{MASTER_PORT:-{DEFAULT_PORT}}}", node_rank: Optional[str] = None) -> list[str]:
    """The command(s) that run this config: one per node for multi-node jobs (node_rank filled in for
    each, or `node_rank` for all; master_addr a placeholder to replace)."""
    n, nodes, strategy = cfg.distributed.num_gpus, cfg.distributed.num_nodes, resolve_strategy(cfg)
    if cfg.world_size == 1:
        return [f"trainfit train {config_path}"]
    if nodes == 1 and strategy == "deepspeed":
        # --no_local_rank: the DeepSpeed launcher would append --local_rank=N, which trainfit's CLI does not
        # take; ranks come from the LOCAL_RANK/RANK environment it sets anyway.
        return [f"deepspeed --num_gpus {n} --master_port {port} --no_local_rank --module trainfit.app.cli train "
                f"{config_path}"]
    if nodes == 1:
        # --standalone: a private rendezvous on a free port, so a busy 29500 does not stop the job.
        return [f"torchrun --standalone --nproc_per_node {n} -m trainfit.app.cli train {config_path}"]
    # Several nodes: torchrun on each (DeepSpeed reads torchrun's environment, so this serves every
    # strategy and needs no ssh between nodes).
    return [f"torchrun --nnodes {nodes} --nproc_per_node {n} --node_rank {node_rank or r} --master_addr {master_addr} "
            f"--master_port {port} -m trainfit.app.cli train {config_path}" for r in range(nodes)]


def launch_script(cfg: Config, config_path: str = "config.yaml") -> str:
    """A bash script that runs the config; extra arguments become key=value overrides."""
    nodes = cfg.distributed.num_nodes
    lines = ["#!/usr/bin/env bash",
             f"# Run {cfg.stage} of {cfg.model.name} on {cfg.distributed.num_gpus} GPU(s) x {nodes} node(s); "
             "written by `trainfit export`.",
             f"# {cfg.batch_plan().describe()}",
             "# Extra arguments are passed on as overrides, e.g. ./launch.sh train.max_steps=10"]
    if nodes > 1:
        lines.append("# Run it on every node with that node's rank and node 0's address, i.e. on node r:")
        lines += [f"#   {c}" for c in launch_commands(cfg, config_path, master_addr="<node-0 address>")]
    lines += ["set -euo pipefail", 'HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"',
              f"CONFIG={_quote_config(config_path)}"]
    if nodes > 1:
        lines += [f': "${{NODE_RANK:?set NODE_RANK to this node\'s rank, 0..{nodes - 1}}}"',
                  ': "${MASTER_ADDR:?set MASTER_ADDR to node 0\'s address}"']
    cmd = launch_commands(cfg, '"$CONFIG"', master_addr='"$MASTER_ADDR"', node_rank='"$NODE_RANK"',
                          port=f'"${{MASTER_PORT:-{DEFAULT_PORT}}}"')[0]
    lines.append(f'exec {cmd} "$@"')
    return "\n".join(lines) + "\n"


def _quote_config(config_path: str) -> str:
    # A bare file name is the one written next to the script: find it from the script's own folder.
    if "/" not in config_path:
        return f'"$HERE/{config_path}"'
    return shlex.quote(config_path)


def export_all(cfg: Config, out_dir: "str | Path", config_path: Optional[str] = None) -> dict[str, Path]:
    """Write config.yaml (unless `config_path` names an existing one), ds_config.json (DeepSpeed
    strategies only), accelerate.yaml and launch.sh into `out_dir`; return {kind: path}. Refuses
    (ConfigError, nothing written) a config that `trainfit train` would refuse."""
    from trainfit.models.runnable import require_trainable

    require_trainable(cfg)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    if config_path is None:
        files["config"] = out / "config.yaml"
        files["config"].write_text(to_yaml(cfg))
        script_cfg = "config.yaml"
    else:
        script_cfg = str(config_path)
    ds_file = None
    if resolve_strategy(cfg) == "deepspeed":
        files["deepspeed"] = out / "ds_config.json"
        files["deepspeed"].write_text(json.dumps(deepspeed_config(cfg), indent=2) + "\n")
        ds_file = str(files["deepspeed"])
    files["accelerate"] = out / "accelerate.yaml"
    files["accelerate"].write_text(accelerate_yaml(cfg, ds_file))
    files["launch"] = out / "launch.sh"
    files["launch"].write_text(launch_script(cfg, script_cfg))
    files["launch"].chmod(0o755)
    return files
