"""Step-time estimate: the roofline corrected by efficiency constants measured on real GPUs.

The roofline (hardware.roofline_step) assumes data-sheet peaks. On one H100 a 24-layer 0.5B LoRA
model's HF decode step took ~57 ms against the roofline's 0.33 ms, and training ran at 23-38% of
peak FLOP/s (counting 6 x params x tokens plus attention).
This model keeps the roofline's inputs (the planner's work summary) and adds what the measurements
show, with constants kept as data in plan/data/efficiency.json (recomputed from measurement files by
bench/calibrate.py):

  train  = [train_flops / (peak x mm_efficiency)
            + pass_tokens x (units_base x elem_bytes + units_lora x lora_bytes) / bandwidth]
           x (qlora_factor with a 4-bit/8-bit base), at least the roofline's weight reads
  optim  = optimizer bytes / (bandwidth x optimizer_bw_efficiency)
  prefill = prefill_flops / (peak x mm_efficiency) + prefill_tokens x (units ...) / bandwidth
  decode = decode_steps x max(roofline per step, layers x per_layer_s + lora_modules x per_lora_module_s)
  comm   = the roofline's (all-reduce over the link, offload over PCIe: ZeRO-Offload's optimizer, and
           with distributed.offload_train_states_during_rollout the train states to CPU RAM and back
           around each rollout's generation, 2 x their bytes at 25 GB/s)

- matmuls run at mm_efficiency of peak (cuBLAS on large bf16 GEMMs);
- the elementwise kernels of eager PyTorch (norms, rotary, activations, residual adds, dropout) are
  memory-bound: per token, per pass (forward 1, backward 2, checkpoint recompute 1) and per unit of
  layers x (hidden + intermediate) they move `elem_bytes`; each LoRA-adapted linear (dropout, A, B,
  scale, add) moves `lora_bytes` per unit of (in + out) features. This is why the 0.5B model (hidden
  896) reached 23% of peak where the 1-2B models (hidden 2048) reached 34-38%, and why LoRA steps
  took longer than the FLOP count says;
- a decode step is bound by Python and kernel launches per layer (and per unadapted LoRA module), not
  by the GPU, so its constants are seconds, the same on any card driven by a similar host;
- a quantized base (QLoRA) keeps the non-quantized parts in fp32 (models.kbit.kbit_upcast), falls back to
  the math attention kernel and dequantizes every weight in forward, recompute and backward: one
  measured factor on the LoRA estimate.

Fitted on the 9 trainer runs of bench/results/gpu_h100_2026-11-22.json (bench/calibrate.py, weighted
least squares on relative error; plan/data/efficiency.json keeps each value with its source and date):
mm_efficiency 0.76, elem_bytes 71, lora_bytes 26, qlora_factor 2.6 (one QLoRA run), decode 1.32 ms
per layer + 0.15 ms per LoRA module (trainfit's loop; TRL's `generate` on the same run 3% more), the
optimizer at 50% of bandwidth (assumed). Every run is then within 8% of its median step; leaving one
training run out of the fit moves its error to at most 12%. E.g. the 0.5B GRPO step (LoRA, 128 rows,
256 tokens): 256 x (24 x 1.32 + 168 x 0.15) ms = 14.6 s decoding + ~1 s training = 15.6 s, measured
13.6-20.3 s (median 15.6). CUDA-graph and vLLM decoding are not measured yet: placeholders, said
so in the label. A GPU never measured gets the H100's constants applied to its own data-sheet peaks
(launch overheads unchanged), labelled uncalibrated.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from trainfit.plan.hardware import GPU, StepTime, roofline_step

EFFICIENCY_FILE = Path(__file__).parent / "data" / "efficiency.json"
PCIE_BPS = 25e9
# Host memory traffic per second of torch AdamW stepping CPU tensors (FSDP offload: its for-loop path, one
# tensor at a time), per training process. bench/cpu_adamw.py measured 1.7 GB/s (fp32) and 1.1 GB/s (bf16) on
# one thread of a 2-core machine under load (bench/results/cpu_adamw.json); a GPU server gives each of its ranks
# several cores, so 8 GB/s is assumed (a few threads' worth), not measured on one.
HOST_OPTIM_BPS = 8e9
ENGINES = ("hf-trainfit", "hf-generate", "hf-cudagraph", "vllm")


@lru_cache(maxsize=1)
def load(path: str = str(EFFICIENCY_FILE)) -> dict:
    return json.loads(Path(path).read_text())


def calibration(gpu: GPU) -> tuple[dict, str]:
    """(constants, basis label) for a card: its own measurements, else the reference card's, labelled."""
    data = load()
    gpus = data["gpus"]
    if gpu.key in gpus:
        c = gpus[gpu.key]
        return c, f"calibrated on {c['gpu_name']}, {c['date']}"
    ref = gpus[data["default"]["from_gpu"]]
    return ref, f"uncalibrated on {gpu.name}: {ref['gpu_name']} efficiencies applied to the card's data-sheet peaks"


def value(c: dict, *path: str) -> float:
    node = c
    for p in path:
        node = node[p]
    return float(node["value"])


def _per_token_bytes(work: dict, c: dict) -> float:
    return work.get("units_base", 0) * value(c, "train", "elem_bytes") + \
        work.get("units_lora", 0) * value(c, "train", "lora_bytes")


def phase_seconds(work: dict, gpu: GPU, c: dict) -> dict:
    """Seconds per phase (train, optimizer, prefill, decode) with constants `c` (one GPU's entry)."""
    flops, bw = gpu.bf16_tflops * 1e12, gpu.bandwidth_gbs * 1e9
    mm = value(c, "train", "mm_efficiency")
    per_tok = _per_token_bytes(work, c) / bw
    train = work.get("train_flops", 0.0) / (flops * mm) + work.get("pass_tokens", 0) * per_tok
    if work.get("quantized"):
        train *= value(c, "train", "qlora_factor")
    # Never under the roofline's weight reads (3 per micro-step): what makes tiny micro-batches slow.
    train = max(train, work.get("train_bytes", 0.0) / bw)
    optim = work.get("optimizer_bytes", 0.0) / (bw * value(c, "optimizer", "bw_efficiency"))
    optim += work.get("cpu_optimizer_bytes", 0.0) / HOST_OPTIM_BPS   # an optimizer stepping in CPU RAM
    out = {"train": train, "optimizer": optim, "prefill": 0.0, "decode": 0.0}
    steps = work.get("decode_steps", 0)
    if steps:
        eng = c["decode"][work.get("decode_engine", "hf-trainfit")]
        launch = work.get("layers", 0) * float(eng["per_layer_s"]["value"]) + \
            work.get("lora_modules", 0) * float(eng["per_lora_module_s"]["value"])
        roof = max(work["decode_flops_per_step"] / flops, work["decode_bytes_per_step"] / bw)
        out["decode"] = steps * (max(roof, launch) + work.get("decode_sync_s", 0.0))
        # One forward over the prompts (its launches are one decode step's worth: left out).
        out["prefill"] = work.get("prefill_flops", 0.0) / (flops * mm) + work.get("prefill_tokens", 0) * per_tok
    return out


def estimate(work: dict, gpu: GPU, n_gpus: int) -> StepTime:
    """The calibrated estimate of one optimizer step (see the module docstring), with its basis label.
    A work summary without the calibration counts (older callers) gets the plain roofline."""
    if "pass_tokens" not in work:
        roof = roofline_step(work, gpu, n_gpus)
        return StepTime(roof.rollout, roof.train, roof.comm, basis="roofline, uncalibrated", overlapped=roof.overlapped)
    c, basis = calibration(gpu)
    return estimate_with(work, gpu, n_gpus, c, basis)


def estimate_with(work: dict, gpu: GPU, n_gpus: int, c: dict, basis: str = "") -> StepTime:
    """`estimate` with the constants `c` given (bench/calibrate.py checks a fit before writing it)."""
    roof = roofline_step(work, gpu, n_gpus)
    ph = phase_seconds(work, gpu, c)
    eng = work.get("decode_engine")
    if work.get("decode_steps") and c["decode"][eng].get("placeholder"):
        basis += f"; {eng} decoding not measured (placeholder)"
    return StepTime(ph["prefill"] + ph["decode"], ph["train"] + ph["optimizer"], roof.comm, basis=basis,
                    overlapped=roof.overlapped)


def fsdp_offload_work(pol, accumulation: int) -> dict:
    """What FSDP2's CPU offload adds to a step's work, per GPU (`pol`: plan/states.States under offload). Over PCIe,
    counted with the roofline's offload term: each micro-step copies every layer's parameter shards to the GPU
    for its forward and again for its backward (they are freed after each), and its gradients' shards back to
    CPU RAM (reduce-scattered at every micro-step). In CPU RAM, at HOST_OPTIM_BPS: AdamW reads the weights,
    gradients and moments and writes the weights and moments (as work.work_terms counts it on a GPU), and its
    for-loop path writes and reads two temporaries the size of a moment."""
    shards, grads, moments = pol.cpu_weights + pol.cpu_adapters, pol.cpu_grads, pol.cpu_optimizer
    return {"offload_bytes": float(accumulation * (2 * shards + grads)),
            "cpu_optimizer_bytes": float(2 * (grads + moments) + grads + 2 * moments)}
