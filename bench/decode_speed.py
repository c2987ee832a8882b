"""Decoding speed: trainfit's CUDA-graph decoding against plain Hugging Face `generate`, same model and prompts.

    python -m bench.decode_speed --out /tmp/decode.json              # on a GPU (grpo-gpu-0.5b's shapes)
    python -m bench.decode_speed --quick --out /tmp/decode.json      # CPU rehearsal, toy shapes

One policy as the grpo-gpu-0.5b workload loads it (the Qwen2.5-0.5B architecture with random weights
and the SmolLM2 tokenizer, bf16, sdpa, LoRA r=16 on every linear layer, unmerged as on a GPU), one
rollout batch of that workload (16 chat arithmetic prompts x G=8 = 128 rows, up to 256 new tokens,
temperature 1, per-row seeds), through three HFEngine configurations:

- `cuda-graphs`: trainfit's decoding loop, static KV cache, the whole decode step (forward, seeded
  sampling, log-prob, finished-row bookkeeping; rollout/static_step.py) compiled with
  torch.compile(mode="reduce-overhead") (rollout.hf_cache=static, hf_cuda_graphs=true; on CPU the
  static cache without graphs);
- `cuda-graphs-nocodegen`: the same step captured with torch.compile(backend="cudagraphs"), the eager
  kernels without inductor's code generation (a shorter warm-up: its `warmup_s` against
  `cuda-graphs`' is what code generation costs the first step);
- `trainfit-dynamic`: trainfit's loop with the growing cache (rollout.hf_cache=dynamic);
- `hf-generate`: transformers' `generate` with the same sampling (rollout.decoder=generate).

Each engine makes one warm-up call first (for CUDA graphs a full one: capture and compilation happen
there; its seconds are kept as `warmup_s`), then `--reps` timed calls. tokens/s = completion tokens (through the first
eos) / seconds of the call; `s_per_decode_step` = seconds / the longest completion of the call
(bench/calibrate.py's decode constants are per decode step).

Against the card: a decode step reads every weight once and every row's KV cache so far, so
`bytes_per_step` = weight bytes + rows x layers x 2 (K, V) x kv_heads x head_dim x 2 bytes x the mean
context (prompt + half the new tokens); `bandwidth_fraction` = bytes_per_step / s_per_decode_step / the
card's memory bandwidth (trainfit's GPU catalog), per engine (the top-level one is `cuda-graphs`').
The partial file written after each engine carries the card's figures too, so a run stopped at its
time limit still says how far from the bandwidth limit the engines it measured are. `profile`: one
more call of the CUDA-graph engine (32 new tokens) under torch.profiler: wall seconds per decode step,
the GPU's busy share of it (kernel time / wall), and the ops with the most self CUDA and self CPU time:
where a step's time goes (host, kernels, syncs, sampling).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.workloads import WORKLOADS, catalog_model_dir, quick
from trainfit.config import ModelConfig, PeftConfig, RolloutConfig, TaskConfig
from trainfit.data.text import encode_prompt
from trainfit.models.policy import load_policy
from trainfit.rollout.decode import StaticDecoder
from trainfit.rollout.hf import HFEngine
from trainfit.tasks import build_task

ENGINES = {
    "cuda-graphs": {"decoder": "trainfit", "hf_cache": "static", "hf_cuda_graphs": True},
    # The same step captured without inductor's code generation (StaticDecoder backend="cudagraphs"):
    # what the first call's compile costs against what fused kernels gain.
    "cuda-graphs-nocodegen": {"decoder": "trainfit", "hf_cache": "static", "hf_cuda_graphs": True},
    "trainfit-dynamic": {"decoder": "trainfit", "hf_cache": "dynamic"},
    "hf-generate": {"decoder": "generate"},
}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(engine: HFEngine, prompts: list, seeds: list, device: torch.device, max_new: int | None = None) -> dict:
    _sync(device)
    t = time.perf_counter()
    out = engine.generate(prompts, seeds=seeds, max_new_tokens=max_new)
    _sync(device)
    dt = time.perf_counter() - t
    lengths = [len(c.token_ids) for c in out]
    return {"seconds": dt, "tokens": sum(lengths), "longest": max(lengths), "tokens_per_s": sum(lengths) / dt,
            "s_per_decode_step": dt / max(max(lengths), 1)}


def against_the_card(model, prompts: list, max_new: int, device: torch.device) -> dict:
    """Bytes a decode step must read (weights + the rows' KV cache at the mean context) and, on a card
    of the GPU catalog, the fastest such a step can be (bandwidth_floor_s_per_step)."""
    text = model.config.get_text_config()
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    context = sum(len(p) for p in prompts) / len(prompts) + max_new / 2
    kv = len(prompts) * text.num_hidden_layers * 2 * kv_heads * head_dim * 2 * context
    out = {"weight_bytes": weights, "kv_bytes_per_step": int(kv), "bytes_per_step": int(weights + kv)}
    if device.type == "cuda":
        from trainfit.plan.hardware import from_device_name

        card = from_device_name(torch.cuda.get_device_name())
        if card is None:
            return out
        bw = card.bandwidth_gbs * 1e9
        floor = (weights + kv) / bw
        out.update(bandwidth_gbs=bw / 1e9, bandwidth_floor_s_per_step=floor,
                   bandwidth_limit_tokens_per_s=len(prompts) / floor)
    return out


def profile(engine: HFEngine, prompts: list, seeds: list, device: torch.device, new: int = 32) -> dict:
    """One call of `new` tokens under torch.profiler: wall time per step, the GPU's busy share, top ops."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=acts) as prof:
        r = timed(engine, prompts, seeds, device, new)
    avg = prof.key_averages()
    steps = max(r["longest"], 1)

    def top(key: str) -> list:
        rows = sorted(avg, key=lambda e: -getattr(e, key, 0))[:12]
        return [{"op": e.key, "ms_per_step": round(getattr(e, key, 0) / 1e3 / steps, 4), "calls": e.count}
                for e in rows if getattr(e, key, 0) > 0]

    kernel_us = sum(getattr(e, "self_device_time_total", 0) for e in avg)
    return {"new_tokens": steps, "wall_ms_per_step": round(1e3 * r["seconds"] / steps, 3),
            "gpu_busy_fraction": round(kernel_us / 1e6 / r["seconds"], 3) if device.type == "cuda" else None,
            "top_cuda": top("self_device_time_total"), "top_cpu": top("self_cpu_time_total")}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="toy shapes on CPU (the rehearsal)")
    ap.add_argument("--reps", type=int, default=1, help="timed calls per engine after the warm-up")
    ap.add_argument("--work", default="/tmp/trainfit-decode-speed", help="scratch directory (shrunk model)")
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, of {', '.join(ENGINES)}")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    engines = {k: ENGINES[k] for k in args.engines.split(",") if k}
    spec = WORKLOADS["grpo-gpu-0.5b"]
    if args.quick:
        spec = quick(spec)
    device = torch.device("cuda" if spec.device == "cuda" else "cpu")
    model_dir = catalog_model_dir(spec.model.split(":", 1)[1], spec.dtype, spec.shrink, Path(args.work))
    lm = load_policy(ModelConfig(name=str(model_dir), dtype=spec.dtype, attn_implementation="sdpa"),
                     PeftConfig(method="lora", r=spec.lora_r, alpha=spec.lora_alpha), device)
    task = build_task(TaskConfig(**spec.task))
    n_prompts = spec.prompts_per_step if not args.quick else 2
    prompts = [encode_prompt(lm.tokenizer, task.train_example(i), True) for i in range(n_prompts)]
    prompts = [p for p in prompts for _ in range(spec.num_generations)]          # G rows per prompt
    seeds = list(range(len(prompts)))
    card = against_the_card(lm.model, prompts, spec.max_new_tokens, device)
    floor = card.get("bandwidth_floor_s_per_step")
    rows = {}
    for name, over in engines.items():
        cfg = RolloutConfig(max_new_tokens=spec.max_new_tokens, temperature=spec.temperature, **over)
        engine = HFEngine(lm.model, lm.tokenizer, cfg)
        graphs = name.startswith("cuda-graphs")
        if name == "cuda-graphs-nocodegen" and device.type == "cuda":
            engine._static = StaticDecoder(lm.model, compiled=True, backend="cudagraphs")
        # The graphs are captured for the call's cache length: their warm-up is a full call; the
        # others only need kernels loaded and the allocator warm.
        warm = timed(engine, prompts, seeds, device, None if graphs else 8)
        calls = [timed(engine, prompts, seeds, device) for _ in range(args.reps)]
        static = engine._static
        rows[name] = {"config": over, "warmup_s": round(warm["seconds"], 3), "calls": calls,
                      "tokens_per_s": statistics.median(c["tokens_per_s"] for c in calls),
                      "s_per_decode_step": statistics.median(c["s_per_decode_step"] for c in calls),
                      "cuda_graphs": bool(static is not None and static.compiled),
                      "backend": static.backend if static is not None and static.compiled else None}
        rows[name]["bandwidth_fraction"] = floor / rows[name]["s_per_decode_step"] if floor else None
        if name == "cuda-graphs":
            rows[name]["profile"] = profile(engine, prompts, seeds, device)
        engine.close()
        print(f"{name:17s} {rows[name]['tokens_per_s']:9.0f} tok/s  {1e3 * rows[name]['s_per_decode_step']:7.2f} "
              f"ms/decode step  (warm-up {warm['seconds']:.1f} s, graphs {rows[name]['cuda_graphs']})", flush=True)
        # After every engine: a run stopped at its time limit keeps the engines it measured.
        Path(args.out).write_text(json.dumps({"partial": True, "engines": rows, "rows_per_call": len(prompts),
                                              "max_new_tokens": spec.max_new_tokens, **card}, indent=1))
    if "cuda-graphs" in rows and "hf-generate" in rows:
        ratio = rows["cuda-graphs"]["tokens_per_s"] / rows["hf-generate"]["tokens_per_s"]
    else:
        ratio = None
    if "cuda-graphs" in rows:
        card["bandwidth_fraction"] = rows["cuda-graphs"]["bandwidth_fraction"]
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "rehearsal": args.quick, "model_dir": str(model_dir), "rows_per_call": len(prompts),
              "max_new_tokens": spec.max_new_tokens, "layers": lm.model.config.num_hidden_layers,
              "lora_r": spec.lora_r, "engines": rows, "graphs_over_generate": ratio, "goal": 2.0,
              **card}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"cuda-graphs / hf-generate tokens/s: {ratio if ratio is None else round(ratio, 2)}x -> {args.out}")
    return result


if __name__ == "__main__":
    main()
