"""The trainer cases of bench/gpu_cases.py: what each runs, and the memory each is admitted with
when cases share the card.

`recorded` = the trainer runs of bench/results/gpu_h100_2026-11-22.json (`trainer_runs.cases`), rebuilt
as that file says; `new` = the paths no GPU had run before 2026-11-27 (NEW); `oom` = real out-of-memory
errors to recover from (OOM). Model names are catalog stems ("catalog:<stem>") or a preset;
bench/gpu_cases.py materialises them (model directories, data files, services).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORDED = ROOT / "bench" / "results" / "gpu_h100_2026-11-22.json"
REWARD = "bench.workloads:distinct_chars"

# A mid-size model of Qwen3-VL's modules: 12 text layers of 1024, an 8-block vision tower.
VLM_MID = {"text_config": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 12,
                           "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64,
                           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                               "mrope_section": [8, 12, 12], "mrope_interleaved": True}},
           "vision_config": {"depth": 8, "hidden_size": 512, "intermediate_size": 1536, "num_heads": 8,
                             "out_hidden_size": 1024}}
# Paths no GPU had run before 2026-11-27.
NEW = [
    {"case": "ppo-q05-lora-rm-128", "admit_gib": 10.4, "why": "PPO with its four models: a LoRA policy and a critic on the shared base, "
     "the reference (adapters off, kl_coef 0.05) and a separate reward model",
     "config": {"stage": "ppo", "model": {"name": "catalog:qwen2.5-0.5b", "dtype": "bf16"},
                "peft": {"method": "lora", "r": 16, "alpha": 32},
                "task": {"name": "arithmetic", "chat": True, "num_eval": 0},
                "rl_models": {"reward_model": "catalog:qwen2.5-0.5b", "reward_dtype": "bf16"},
                "ppo": {"kl_coef": 0.05},
                "rollout": {"max_new_tokens": 128},
                "train": {"global_batch_size": 64, "micro_batch_size": 16, "max_steps": 3, "lr": 1e-6}}},
    {"case": "dpo-q05-full-m8", "admit_gib": 5.1, "why": "DPO in full: the policy and a frozen reference copy, chosen and rejected "
     "of 8 pairs in one micro-batch",
     "config": {"stage": "dpo", "model": {"name": "catalog:qwen2.5-0.5b", "dtype": "bf16"},
                "task": {"name": "arithmetic", "chat": True, "num_eval": 0},
                "dpo": {"loss_type": "sigmoid", "beta": 0.1},
                "train": {"global_batch_size": 16, "micro_batch_size": 8, "max_steps": 3, "lr": 1e-6}}},
    {"case": "pre-q05-full-2k-m4-zero3", "admit_gib": 22.8, "why": "DeepSpeed ZeRO-3 on one GPU (one rank under torchrun)",
     "config": {"stage": "pretrain", "model": {"name": "catalog:qwen2.5-0.5b", "dtype": "bf16"},
                "data": {"max_seq_length": 2048, "eval_fraction": 0.0},
                "train": {"global_batch_size": 8, "micro_batch_size": 4, "max_steps": 3, "lr": 1e-5},
                "distributed": {"strategy": "deepspeed", "zero_stage": 3, "num_gpus": 1}}},
    {"case": "sft-vlm-shapes-512px-m8", "admit_gib": 4.2, "why": "a vision-language SFT step (Qwen3-VL modules, 256 image tokens)",
     "config": {"stage": "sft", "model": {
         "name": "preset:vlm-tiny", "dtype": "bf16", "freeze_vision_tower": False, "freeze_projector": False,
         "min_pixels": 512 * 512, "max_pixels": 512 * 512,
         "config_overrides": VLM_MID},
         "task": {"name": "shapes", "chat": True, "num_eval": 0},
         "train": {"global_batch_size": 32, "micro_batch_size": 8, "max_steps": 3, "lr": 1e-5}}},
    {"case": "cua-vlm-grpo-1080p-4screens", "admit_gib": 20.0, "why": "the computer-use GRPO step at "
     "examples/cua_grpo_single_gpu.yaml's screenshot shapes (1920 x 1080, 4 kept, LoRA r32, checkpointing, "
     "micro 1, log-prob chunks of 2048 rows) on a mid-size Qwen3-VL-module model, 4 turns of 32 tokens "
     "against a screenshot service (bench/screens_service.py)",
     "config": {"stage": "grpo", "model": {
         "name": "preset:vlm-tiny", "dtype": "bf16", "gradient_checkpointing": True, "max_pixels": 1920 * 1080,
         "config_overrides": VLM_MID},
         "peft": {"method": "lora", "r": 32, "alpha": 64, "target_modules": "all-linear"},
         "task": {"name": "jsonl", "path": "examples/data/cua_tasks.jsonl", "chat": True, "num_eval": 0},
         "grpo": {"num_generations": 8, "beta": 0.0, "loss_type": "dapo"},
         "rollout": {"engine": "hf", "max_prompt_length": 2048, "max_new_tokens": 32, "max_turns": 4,
                     "max_images_per_episode": 4, "max_episode_tokens": 16384, "temperature": 1.0},
         "env": {"type": "http", "url": "screens:1920x1080", "max_observation_tokens": 1024, "timeout_s": 60},
         "train": {"global_batch_size": 16, "micro_batch_size": 1, "max_steps": 2, "lr": 1e-5,
                   "logits_chunk_rows": 2048}}},
]
# Real CUDA OOMs from oversized micro-batches. Each case runs under an allocator capped at its admission
# share (admission_gib: 1.1 x admit_gib + 1 GiB; bench/gpu_snapshot.py --memory-fraction), so its OOM is
# PyTorch's own torch.OutOfMemoryError while other cases share the card. Both plan within an 80 GB card
# (the trainer starts) and over their share (it runs out): the trainer must catch the error and redo the
# same step at a smaller micro-batch, keeping the batch (GRPO: whole groups in every optimizer step).
OOM = [{"case": "oom-q05-pre-4k-m8", "why": "pretraining, 8 x 4096 tokens in one micro-batch (~50 GiB) in a "
        "~34 GiB share", "expect": "oom", "admit_gib": 30.0,
        "config": {"stage": "pretrain", "model": {"name": "catalog:qwen2.5-0.5b", "dtype": "bf16"},
                   "data": {"max_seq_length": 4096, "eval_fraction": 0.0},
                   "train": {"global_batch_size": 8, "micro_batch_size": 8, "max_steps": 2, "lr": 1e-5}}},
       {"case": "oom-q05-grpo-g8-m64", "why": "GRPO in full, 64 completions (8 groups of 8) in one micro-batch "
        "(~30-40 GiB) in a ~16 GiB share", "expect": "oom", "admit_gib": 14.0,
        "config": {"stage": "grpo", "model": {"name": "catalog:qwen2.5-0.5b", "dtype": "bf16"},
                   "task": {"name": "arithmetic", "chat": True, "num_eval": 0},
                   "grpo": {"num_generations": 8}, "rollout": {"max_new_tokens": 256, "hf_cache": "dynamic"},
                   "train": {"global_batch_size": 64, "micro_batch_size": 64, "max_steps": 2, "lr": 1e-6}}}]
# The rehearsal's toy VLM: the same overrides at preset-like sizes (rotary sections sum to head_dim / 2).
QUICK_VLM = {"text_config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                             "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                             "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                 "mrope_section": [4, 6, 6], "mrope_interleaved": True}},
             "vision_config": {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                               "out_hidden_size": 64}}


def cases(which: str) -> list[dict]:
    return [{**c, "passed_before": c["case"] in PASSED_BEFORE, "snapshot_first": c["case"] in SNAPSHOT_FIRST}
            for c in _cases(which)]


def _cases(which: str) -> list[dict]:
    if which in ("new", "oom"):
        return copy.deepcopy(NEW if which == "new" else OOM)
    recorded = json.loads(RECORDED.read_text())["trainer_runs"]["cases"]
    # The case planned furthest under (QLoRA, 16%) first: its snapshot is the measurement most wanted.
    recorded.sort(key=lambda c: "qlora" not in c["case"])
    return [{"case": c["case"], "why": "recorded 2026-11-22", "config": copy.deepcopy(c["config"]),
             "recorded_GiB": c["measured_max_memory_allocated_GiB"]} for c in recorded]


# max_memory_allocated of the cases on the H100 on 2026-11-27 (bench/results/gpu-check-h100-2026-11-27/; with
# Liger's fused head: less than the 2026-11-22 figures where it applies). For admission only.
LAST_USED_GIB = {"pre-smol17-full-2k-m4": 34.4, "pre-smol17-full-2k-m8-ckpt": 16.8, "pre-l1b-full-4k-m2": 21.9,
                 "pre-q05-full-4k-m4": 24.5, "sft-smol17-lora-2k-m4-ckpt": 5.4, "sft-q4b-lora-2k-m2": 28.4,
                 "sft-q4b-qlora-2k-m2-ckpt": 8.6, "ppo-q05-lora-rm-128": 10.3, "dpo-q05-full-m8": 4.8,
                 "sft-vlm-shapes-512px-m8": 4.3}
# Within the targets on both 2026-11-27 runs: started after the cases still to be measured.
PASSED_BEFORE = {"pre-smol17-full-2k-m4", "pre-q05-full-4k-m4", "sft-smol17-lora-2k-m4-ckpt", "sft-q4b-lora-2k-m2"}
# Planned under on 2026-11-27 (QLoRA -24.3%; PPO's scoring phase -13.0%): their first run records the
# CUDA memory history (bench/gpu_snapshot.py).
SNAPSHOT_FIRST = {"sft-q4b-qlora-2k-m2-ckpt", "ppo-q05-lora-rm-128"}


def admission_gib(case: dict) -> float:
    """The GPU memory a case is admitted with when cases share the card: its last measured peak, else
    the one recorded with the case, else the planner's figure written next to it; plus a tenth and the
    ~1 GiB a CUDA context and the caching allocator's slack take outside max_memory_allocated."""
    base = LAST_USED_GIB.get(case["case"]) or case.get("recorded_GiB") or case.get("admit_gib") or 40.0
    return 1.1 * base + 1.0
