"""What doctor reports: findings (code, severity, reason, exact fix) and the report that holds them.

Every code doctor can emit is listed in CODES with one line saying what it means, so the codes are
a stable interface for CI filters and for the test corpus (tests/data/doctor/README.md).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal, Optional

Severity = Literal["error", "warning", "info"]
SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}

CODES: dict[str, str] = {
    # machine
    "machine.no_gpu": "no NVIDIA GPU is usable (NVML library missing, no device, or NVML failed)",
    "machine.torch_missing": "torch is not installed in this environment",
    "machine.torch_cpu_build": "GPUs are present but torch is a CPU-only build",
    "machine.driver_old": "the driver supports an older CUDA than the one torch was built with",
    "machine.gpu_busy": "other processes hold memory on a GPU",
    "machine.port_busy": "the rendezvous port (MASTER_PORT or 29500) is already in use",
    "machine.alloc_conf": "PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF has an option torch rejects",
    # trainfit YAML
    "tf.schema": "the file fails the trainfit schema (unknown key, bad value, not YAML)",
    "tf.batch_world": "train.global_batch_size is not divisible by the device count",
    "tf.batch_micro": "train.micro_batch_size does not divide the per-device batch",
    "tf.grpo_groups": "GRPO global batch is not a multiple of grpo.num_generations",
    "tf.grpo_groups_per_device": "GRPO completions per device are not whole groups",
    "tf.grpo_task": "stage grpo without a task (prompts and rewards)",
    "tf.data_missing": "stage pretrain/sft without data.path or a task",
    "tf.pretrain_data": "stage pretrain with a task but no raw-text data.path",
    "tf.data_and_task": "stage pretrain/sft with both data.path and task.name (the task is trained on, the file ignored)",
    "tf.node_rank": "distributed.node_rank is not below distributed.num_nodes",
    "tf.lr_scaling_base": "distributed.lr_scaling without base_global_batch_size",
    "tf.jsonl_path": "task.name=jsonl without task.path",
    "tf.quantization_peft": "a quantized base without adapters to train",
    "tf.reward_weights": "task.reward_weights does not give one weight per reward",
    "tf.operations": "task.operations is not a subset of '+-*'",
    "tf.cross_field": "another cross-field rule of trainfit.config failed",
    "tf.stages": "a stage of a pipeline config is invalid",
    "tf.plan_over_card": "the planned peak is over the card (error) or over the margin (warning)",
    "tf.plan_unavailable": "the planner could not plan this config, so memory was not checked",
    "tf.offload_cpu_ram": "offloaded states need more CPU RAM than the machine has",
    "tf.fp16_on_bf16_card": "fp16 weights on a card that supports bf16",
    "tf.extra_missing": "the config needs an optional package that does not import here",
    "tf.more_gpus_than_visible": "distributed.num_gpus is more than the GPUs this machine shows",
    # learning-rate scaling (any file with a global batch and a learning rate)
    "lr.not_scaled": "the global batch differs from its reference but the learning rate was not rescaled",
    # DeepSpeed JSON
    "ds.invalid": "the DeepSpeed config is not valid JSON/HJSON or not a mapping",
    "ds.batch_missing": "neither train_batch_size nor train_micro_batch_size_per_gpu is given",
    "ds.batch_mismatch": "train_batch_size != micro x accumulation x world size",
    "ds.batch_world": "train_batch_size is not divisible by the world size (or by micro x accumulation)",
    "ds.batch_unchecked": "the world size is unknown (no --num-gpus, config or launch line), so the batch was not checked",
    "ds.auto_unfilled": "'auto' values where no HF Trainer/accelerate integration fills them",
    "ds.fp16_and_bf16": "fp16 and bf16 are both enabled",
    "ds.precision_mismatch": "DeepSpeed precision contradicts the trainfit/accelerate precision",
    "ds.fp16_on_bf16_card": "fp16 (loss scaling) on a card that supports bf16",
    "ds.offload_param_stage": "offload_param is set but ZeRO stage is not 3 (DeepSpeed ignores it)",
    "ds.offload_cpu_ram": "ZeRO offload needs more CPU RAM than the machine has",
    "ds.trainfit_mismatch": "the DeepSpeed file disagrees with the trainfit config given with it",
    "ds.rejected": "DeepSpeed's own config classes reject the file (unknown key, bad value, a rule of theirs)",
    "ds.deprecated": "DeepSpeed accepts a key but warns that it is deprecated",
    "ds.unvalidated": "DeepSpeed does not import here, so its own config validation was skipped",
    "ds.offload_client_optimizer": "ZeRO-Offload without an optimizer block under a plain deepspeed.initialize launch",
    "ds.nvme_path_missing": "NVMe offload without nvme_path: the engine fails building its swap folder",
    # accelerate YAML
    "accel.invalid": "the accelerate config is not YAML or not a mapping",
    "accel.multi_gpu_one_process": "distributed_type MULTI_GPU (or another multi-process type) with num_processes 1",
    "accel.no_with_processes": "distributed_type NO with num_processes > 1",
    "accel.gpu_ids_count": "gpu_ids lists a different number of GPUs than processes per machine",
    "accel.machine_rank": "machine_rank is outside 0..num_machines-1",
    "accel.multinode": "num_machines / num_processes / main_process_ip do not make a multi-node job",
    "accel.ds_file_missing": "deepspeed_config_file does not exist",
    "accel.ds_file_conflict": "settings accelerate refuses next to a deepspeed_config_file",
    "accel.precision_mismatch": "mixed_precision contradicts the trainfit model dtype",
    "accel.processes_vs_gpus": "more processes per machine than GPUs given or visible",
    # vLLM engine arguments
    "vllm.invalid": "the vLLM arguments could not be read",
    "vllm.gpu_mem_range": "gpu_memory_utilization is not in (0, 1]",
    "vllm.max_model_len": "max_model_len is above the model's max_position_embeddings",
    "vllm.model_unknown": "the model's context limit is unknown, so max_model_len was not checked",
    "vllm.over_card": "trainer plan + vLLM's share of the card is over the card",
    "vllm.no_kv_room": "vLLM's share of the card leaves no room for a KV cache after the weights",
    "vllm.unchecked": "the trainer's share is unknown, so vLLM + trainer memory was not checked",
    "vllm.tp_over_gpus": "tensor x pipeline parallel size is more than the GPUs given or visible",
    # python / launcher arguments
    "args.device_map_auto": "device_map='auto' in a training process while several GPUs are visible",
    "args.grpo_groups": "TRL GRPO generation batch is not a multiple of num_generations",
    "args.invalid": "a launch/arguments file could not be read",
}


@dataclass
class Finding:
    code: str
    severity: Severity
    message: str            # the reason, with the numbers involved
    fix: str                # the exact change that removes it
    file: Optional[str] = None

    def __post_init__(self) -> None:
        # An unlisted code is a bug in doctor, not in the user's files: fail loudly in tests.
        if self.code not in CODES:
            raise ValueError(f"unknown finding code {self.code!r}; add it to trainfit.app.doctor.findings.CODES")
        if self.severity not in SEVERITY_ORDER:
            raise ValueError(f"unknown severity {self.severity!r}")


@dataclass
class Report:
    machine: dict = field(default_factory=dict)     # facts: versions, GPUs, RAM, ports, extras
    files: list[dict] = field(default_factory=list)  # each file read: path and the kind it was read as
    findings: list[Finding] = field(default_factory=list)

    def add(self, *findings: Finding) -> None:
        self.findings.extend(findings)

    def sorted(self) -> list[Finding]:
        return sorted(self.findings, key=lambda f: (SEVERITY_ORDER[f.severity], f.file or "", f.code))

    def count(self, severity: Severity) -> int:
        return sum(1 for f in self.findings if f.severity == severity)

    @property
    def exit_code(self) -> int:
        """1 when any error-level finding exists (for CI), else 0."""
        return 1 if self.count("error") else 0

    def to_dict(self) -> dict:
        return {"machine": self.machine, "files": self.files,
                "findings": [asdict(f) for f in self.sorted()],
                "summary": {s: self.count(s) for s in SEVERITY_ORDER}, "exit_code": self.exit_code}
