"""How a plan's config spreads over machines, for the plan's pictures (plan/chart.py): the device it trains on,
nodes and GPUs, the data-parallel engine with its ZeRO / FSDP stage and offload, vLLM's tensor parallelism,
and the models it holds. Read from the config once, when the plan is made, so a picture needs only the plan."""

from __future__ import annotations

from trainfit.config.stages import stage_spec
from trainfit.plan.states import parallel_of

ENGINE_NAMES = {"single": "one process", "ddp": "DDP", "fsdp": "FSDP2", "deepspeed": "DeepSpeed"}


def topology(cfg) -> dict:
    d, par, split = cfg.distributed, parallel_of(cfg), cfg.device_split()
    offload = [k for k, on in (("optimizer", par.offload_optimizer), ("parameters", par.offload_params)) if on]
    rl = cfg.rl_models
    return {"device": cfg.train.device, "nodes": d.num_nodes, "gpus_per_node": d.num_gpus,
            "processes_per_node": cfg.world_size // d.num_nodes, "data_parallel": par.world,
            "rollout_gpus": len(split.rollout) if split.separate else 0,
            "engine": par.engine, "zero_stage": par.zero_stage, "offload": offload,
            "rollout_engine": cfg.rollout.engine if stage_spec(cfg.stage).rollout else None,
            "rollout_tensor_parallel": cfg.rollout.tensor_parallel_size if cfg.rollout.engine == "vllm" else 1,
            "models": {"policy": cfg.model.name, "reference": cfg.model.name,
                       "value": rl.value_model or cfg.model.name, "reward": rl.reward_model}}


def describe_parallelism(t: dict, on_cpu: bool = False) -> str:
    """'8 GPUs on 1 node; DeepSpeed ZeRO-3, data parallel 8, tensor parallel 1 (training); offload: optimizer'.
    `on_cpu`: the config trains on the CPU (train.device=cpu, or auto without a GPU)."""
    if not t:
        return ""
    if on_cpu or t["device"] == "cpu":
        n = t["processes_per_node"]
        where = "CPU" + (f", {n} processes (gloo)" if n > 1 else "")
    else:
        gpus = t["gpus_per_node"]
        where = (f"{t['nodes']} nodes x {gpus} GPU{'s' if gpus > 1 else ''}" if t["nodes"] > 1
                 else f"{gpus} GPU{'s' if gpus > 1 else ''} on 1 node")
        where += f" ({t['rollout_gpus']} for the rollout worker)" if t["rollout_gpus"] else ""
    eng = ENGINE_NAMES.get(t["engine"], t["engine"])
    if t["engine"] == "deepspeed":
        eng += f" ZeRO-{t['zero_stage']}"
    elif t["engine"] == "fsdp":
        eng += " full shard (as ZeRO-3)"
    out = f"{where}; {eng}, data parallel {t['data_parallel']}, tensor parallel 1 (training)"
    if t["rollout_engine"] == "vllm":
        out += f", vLLM tensor parallel {t['rollout_tensor_parallel']}"
    return out + (f"; offload: {' and '.join(t['offload'])}" if t["offload"] else "")
