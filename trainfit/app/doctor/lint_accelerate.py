"""Lint of accelerate config YAML: distributed_type vs processes vs GPUs vs machines, DeepSpeed file use.

num_processes in accelerate is the total over all machines; gpu_ids applies to each machine, so it
must list num_processes / num_machines GPUs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from trainfit.app.doctor.context import Context
from trainfit.app.doctor.files import Doc
from trainfit.app.doctor.findings import Finding

# Types that start one process per device; DEEPSPEED and FSDP may run as one process (offload on 1 GPU).
MULTI_TYPES = {"MULTI_GPU", "MULTI_CPU", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_HPU", "MULTI_MUSA",
               "MULTI_SDAA", "MULTI_NEURON"}
# accelerate raises ValueError when these sit next to deepspeed_config_file (DeepSpeedPlugin's checks).
DS_FILE_CONFLICTS = ("gradient_accumulation_steps", "gradient_clipping", "zero_stage", "offload_optimizer_device",
                     "offload_param_device", "offload_param_nvme_path", "offload_optimizer_nvme_path",
                     "zero3_save_16bit_model")


def _int(v: Any) -> Optional[int]:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def gpu_id_list(v: Any) -> Optional[list[str]]:
    """gpu_ids as a list, or None for all GPUs."""
    if v is None or str(v).strip().lower() == "all":
        return None
    if isinstance(v, (list, tuple)):
        return [str(x) for x in v]
    return [x.strip() for x in str(v).split(",") if x.strip()]


def resolve_ds_file(doc: Doc, name: str) -> Optional[Path]:
    # accelerate opens it from the launch directory; also try next to the YAML, where people keep it.
    for cand in (Path(name), Path(doc.path).parent / name):
        if cand.is_file():
            return cand
    return None


def lint_accelerate(doc: Doc, ctx: Context) -> list[Finding]:
    if doc.error:
        return [Finding("accel.invalid", "error", f"{doc.path}: {doc.error}.", "Fix the YAML, or regenerate it with "
                        "`accelerate config` / `trainfit export CONFIG -o DIR`.", doc.path)]
    d, p, out = doc.data, doc.path, []
    if "distributed_type" not in d:
        out.append(Finding("accel.invalid", "error", "distributed_type is missing; accelerate refuses the file "
                           "('A `distributed_type` must be specified').", "Add distributed_type: NO (one GPU), "
                           "MULTI_GPU, DEEPSPEED or FSDP.", p))
    dt = str(d.get("distributed_type", "NO")).upper()
    np_ = _int(d.get("num_processes", 1)) or 1
    nm = _int(d.get("num_machines", 1)) or 1
    rank = _int(d.get("machine_rank", 0))
    if dt in MULTI_TYPES and np_ == 1 and nm == 1:
        out.append(Finding("accel.multi_gpu_one_process", "error", f"distributed_type: {dt} with num_processes: 1 "
                           "starts one process, so nothing runs in parallel and the multi-process setup is wasted.",
                           "Set num_processes to the number of GPUs (e.g. 4), or distributed_type: NO for one GPU.", p))
    if dt == "NO" and np_ > 1:
        out.append(Finding("accel.no_with_processes", "error", f"distributed_type: NO with num_processes: {np_}: "
                           f"accelerate will not start {np_} processes (or each one trains alone, unsynchronised).",
                           "Set distributed_type: MULTI_GPU (or DEEPSPEED / FSDP), or num_processes: 1.", p))
    if np_ % nm:
        out.append(Finding("accel.multinode", "error", f"num_processes: {np_} (the total over machines) is not "
                           f"divisible by num_machines: {nm}.", f"Set num_processes to GPUs per machine x {nm}, "
                           f"e.g. {-(-np_ // nm) * nm}.", p))
    per_machine = max(np_ // nm, 1)
    ids = gpu_id_list(d.get("gpu_ids"))
    if ids is not None and len(ids) != per_machine:
        out.append(Finding("accel.gpu_ids_count", "error", f"gpu_ids lists {len(ids)} GPU(s) ({','.join(ids)}) but "
                           f"each machine runs num_processes / num_machines = {per_machine} process(es).",
                           f"List {per_machine} GPU id(s) in gpu_ids, set gpu_ids: all, or set num_processes: "
                           f"{len(ids) * nm}.", p))
    if rank is None or not 0 <= rank < nm:
        out.append(Finding("accel.machine_rank", "error", f"machine_rank: {d.get('machine_rank')} is outside 0.."
                           f"{nm - 1} for num_machines: {nm}.", f"Set machine_rank to this machine's rank, 0 to "
                           f"{nm - 1} (0 on the main machine).", p))
    if nm > 1:
        if not d.get("main_process_ip"):
            out.append(Finding("accel.multinode", "error", f"num_machines: {nm} without main_process_ip: the other "
                               "machines cannot find the main one.", "Set main_process_ip to machine 0's address "
                               "and main_process_port to a port open between the machines.", p))
        if dt == "NO":
            out.append(Finding("accel.multinode", "error", f"num_machines: {nm} with distributed_type: NO.",
                               "Set distributed_type: MULTI_GPU (or DEEPSPEED / FSDP).", p))
    visible = ctx.visible_gpus()
    if visible and per_machine > visible and not d.get("use_cpu"):
        src = f"--num-gpus {ctx.opts.num_gpus}" if ctx.opts.num_gpus else "this machine"
        out.append(Finding("accel.processes_vs_gpus", "error", f"{per_machine} processes per machine but {src} has "
                           f"{visible} GPU(s); the extra processes share or miss a GPU.",
                           f"Set num_processes: {visible * nm}.", p))
    out += _deepspeed_section(doc, d, dt)
    mp = str(d.get("mixed_precision") or "").lower()
    for dtype, src in ctx.precisions():
        if mp in ("fp16", "bf16") and dtype in ("fp16", "bf16") and dtype != mp and not src.startswith(p):
            out.append(Finding("accel.precision_mismatch", "error", f"mixed_precision: {mp} but {src} says {dtype}.",
                               f"Set mixed_precision: {dtype}.", p))
    return out


def _deepspeed_section(doc: Doc, d: dict, dt: str) -> list[Finding]:
    ds = d.get("deepspeed_config") if isinstance(d.get("deepspeed_config"), dict) else {}
    file = ds.get("deepspeed_config_file")
    if dt != "DEEPSPEED" or not file:
        return []
    out = []
    if resolve_ds_file(doc, str(file)) is None:
        out.append(Finding("accel.ds_file_missing", "error", f"deepspeed_config_file: {file} does not exist (from the "
                           f"current directory or next to {doc.path}).", "Point it at the DeepSpeed JSON, relative "
                           "to the directory you run `accelerate launch` in, or give an absolute path.", doc.path))
    clash = [k for k in DS_FILE_CONFLICTS if k in ds] + (["mixed_precision"] if "mixed_precision" in d else [])
    if clash:
        out.append(Finding("accel.ds_file_conflict", "error", f"deepspeed_config_file is set together with "
                           f"{', '.join(clash)}; accelerate refuses to launch (those belong in the DeepSpeed file).",
                           f"Remove {', '.join(clash)} from this YAML and set them in {file} (for mixed precision: "
                           "bf16/fp16 'enabled' there).", doc.path))
    return out
