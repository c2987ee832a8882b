"""Planner accuracy: predicted training-step memory against what real training steps use.

    .venv/bin/python bench/plan_accuracy.py            # GPU when there is one, else the CPU grid
    .venv/bin/python bench/plan_accuracy.py --cpu      # force the CPU grid

On a GPU: random-init 0.5B-1.5B models (Qwen2.5-0.5B / 1.5B architectures from the catalog, no
download) over a grid of full / LoRA / QLoRA, checkpointing on and off, sequences 512-4096 and
micro-batches 1-4. Each config runs two real SFT steps the way trainfit's trainer does (model in
`model.dtype`, peft adapters, AdamW, accumulation, clipping, zero_grad(set_to_none=True)); the second
step is measured with torch.cuda.max_memory_allocated, against the plan's `allocated` figure of the
training phase (CUDA context and allocator slack excluded on both sides).

On CPU (no GPU lent): the same step on small models (preset:small, SmolLM2-135M) at 128-512 tokens;
"measured" is the peak of live tensor bytes of the real step, followed with trainfit's LiveTracker
(every storage's birth and death), which is what max_memory_allocated counts on a GPU, minus
allocator rounding. QLoRA needs bitsandbytes and a GPU: skipped on CPU.

Writes bench/results/plan_accuracy_{gpu,cpu}.json: per config, predicted, measured, error, and
the summary (median |error|, worst, worst under-prediction). Targets: median <= 5%, worst <= 10%,
never under-predicting by more than 5%.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainfit import algos  # noqa: E402
from trainfit.config import validate  # noqa: E402
from trainfit.plan import plan  # noqa: E402
from trainfit.models.lora_compute import lora_compute_in_input_dtype  # noqa: E402
from trainfit.models.lora_rules import lora_in_model_dtype  # noqa: E402
from trainfit.models.shapes import hf_config, instantiate, locate  # noqa: E402

DT = {"fp32": torch.float32, "bf16": torch.bfloat16}
RESULTS = Path(__file__).parent / "results"
TARGETS = {"median_abs_error": 0.05, "worst_abs_error": 0.10, "worst_under_prediction": -0.05}


def grid(gpu: bool) -> list[dict]:
    out = []
    if gpu:
        models = ["Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-1.5B"]
        for model, method, ckpt, (seq, micro) in itertools.product(
                models, ("none", "lora", "qlora"), (False, True), ((512, 4), (2048, 2), (4096, 1))):
            out.append(dict(model=model, dtype="bf16", method=method, ckpt=ckpt, seq=seq, micro=micro, accum=2))
        return out
    for model, method, ckpt, (seq, micro) in itertools.product(
            ("preset:small", "HuggingFaceTB/SmolLM2-135M"), ("none", "lora"), (False, True), ((128, 4), (512, 1))):
        dtype = "fp32" if model.startswith("preset") else "bf16"
        out.append(dict(model=model, dtype=dtype, method=method, ckpt=ckpt, seq=seq, micro=micro, accum=2))
    return out


def config_of(c: dict) -> dict:
    peft = "none" if c["method"] == "none" else "lora"
    return {"stage": "sft", "task": {"name": "arithmetic"},
            "model": {"name": c["model"], "dtype": c["dtype"], "gradient_checkpointing": c["ckpt"],
                      "quantization": "4bit" if c["method"] == "qlora" else "none"},
            "peft": {"method": peft, "r": 16, "alpha": 32},
            "data": {"max_seq_length": c["seq"]},
            "train": {"global_batch_size": c["micro"] * c["accum"], "micro_batch_size": c["micro"]}}


def build(c: dict, device):
    """The model as trainfit.models.policy.load_policy builds it (random init from the architecture)."""
    cfg = hf_config(locate(c["model"]))
    if c["method"] == "qlora":
        # bitsandbytes quantizes while loading weights (from_config takes no quantization_config):
        # random weights saved once per model, then loaded quantized as trainfit loads a QLoRA base.
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig

        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=DT[c["dtype"]])
        model = AutoModelForCausalLM.from_pretrained(str(saved_weights(c["model"], cfg, c["dtype"])), dtype=DT[c["dtype"]],
                                                     attn_implementation="sdpa", quantization_config=q,
                                                     device_map={"": device})
    else:
        model = instantiate(cfg, DT[c["dtype"]], attn_implementation="sdpa").to(device)
    if c["ckpt"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if c["method"] != "none":
        from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

        if c["method"] == "qlora":
            model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=c["ckpt"])
        elif c["ckpt"]:
            model.enable_input_require_grads()
        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
        # As load_policy does (peft.adapter_compute=model): LoRA's matmuls in the base's dtype, not on fp32 input copies.
        if lora_in_model_dtype("lora", "model", c["dtype"], "4bit" if c["method"] == "qlora" else "none"):
            lora_compute_in_input_dtype(model)
    return model, cfg.get_text_config().vocab_size


def saved_weights(model: str, cfg, dtype: str) -> Path:
    """`model`'s architecture with random weights, saved once under a temporary directory."""
    out = Path(tempfile.gettempdir()) / "trainfit-plan-accuracy" / f"{model.replace('/', '--')}-{dtype}"
    if not (out / "config.json").exists():
        instantiate(cfg, DT[dtype], attn_implementation="sdpa").save_pretrained(str(out))
    return out


def step(model, params, opt, c: dict, vocab: int, device) -> None:
    """One optimizer step as trainfit/train/loop.py + sft.py do it (padded batches, token-mean loss)."""
    total = c["micro"] * c["accum"] * (c["seq"] - 1)
    for _ in range(c["accum"]):
        ids = torch.randint(3, vocab, (c["micro"], c["seq"]), device=device)
        mask = torch.ones_like(ids)
        mask[0, :4] = 0  # padded batches: the attention mask is materialized, as in training
        logits = model(input_ids=ids, attention_mask=mask).logits
        loss, _ = algos.sft_loss(logits, ids.masked_fill(mask == 0, -100), total_tokens=total)
        del logits
        loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def measure(c: dict, device) -> int:
    torch.manual_seed(0)
    model, vocab = build(c, device)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    step(model, params, opt, c, vocab, device)  # warm-up: optimizer state exists from here on
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step(model, params, opt, c, vocab, device)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        from functools import partial

        from trainfit.plan.tracker import step_peak

        peak = step_peak(partial(step, model, params, opt, c, vocab, device), model, opt)
    del model, opt, params
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return peak


def summarise(rows: list[dict], gpu: bool) -> dict:
    done = [r for r in rows if "error" in r]
    errs = [abs(r["error"]) for r in done]
    return {"device": torch.cuda.get_device_name() if gpu else "cpu (LiveTracker peak of live tensor bytes)",
            "configs": len(done), "failed": sum("failed" in r for r in rows),
            "median_abs_error": round(statistics.median(errs), 4) if errs else None,
            "worst_abs_error": round(max(errs), 4) if errs else None,
            "worst_under_prediction": round(min(0.0, *[r["error"] for r in done]), 4) if done else None,
            "targets": TARGETS}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cpu", action="store_true", help="run the CPU grid even when a GPU is present")
    ap.add_argument("--limit", type=int, default=0, help="only the first N configs")
    ap.add_argument("--out", default="", help="output JSON (default bench/results/plan_accuracy_{gpu,cpu}.json)")
    ap.add_argument("--deadline", type=float, default=0.0, help="unix time after which no new config starts")
    args = ap.parse_args(argv)
    gpu = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda" if gpu else "cpu")
    if not gpu:
        torch.set_num_threads(max(1, os.cpu_count() or 1))
    out = Path(args.out) if args.out else RESULTS / f"plan_accuracy_{'gpu' if gpu else 'cpu'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for c in grid(gpu)[: args.limit or None]:
        if c["method"] == "qlora" and not gpu:
            continue
        if args.deadline and time.time() > args.deadline:
            rows.append(dict(config=c, failed="not started: the deadline (--deadline) passed"))
            continue
        raw = config_of(c)
        if not gpu:  # measured on CPU: planned for the CPU's attention kernel (plan/trace.py math_sdpa)
            raw.setdefault("train", {})["device"] = "cpu"
        t0 = time.time()
        try:
            p = plan(validate(raw), gpu="h100" if not gpu else None, suggest=False, from_data=False)  # fixed-length ids
            measured = measure(c, device)
        except Exception as e:  # noqa: BLE001 - one config's failure (an OOM, a missing kernel) is a result
            rows.append(dict(config=c, yaml=config_of(c), failed=f"{type(e).__name__}: {str(e)[:300]}",
                             seconds=round(time.time() - t0, 1)))
            print(f"{c['model']:28s} {c['method']:5s} ckpt={int(c['ckpt'])} T={c['seq']:5d} failed: {rows[-1]['failed']}",
                  flush=True)
            gc.collect()
            if gpu:
                torch.cuda.empty_cache()
        else:
            pred = p.phases["train"].allocated
            row = dict(config=c, yaml=config_of(c), predicted=pred, measured=measured,
                       error=round(pred / measured - 1, 4), seconds=round(time.time() - t0, 1))
            rows.append(row)
            print(f"{c['model']:28s} {c['method']:5s} ckpt={int(c['ckpt'])} T={c['seq']:5d} micro={c['micro']} "
                  f"predicted {pred / 2**20:9.1f} MiB  measured {measured / 2**20:9.1f} MiB  {row['error']:+.1%}",
                  flush=True)
        # After every config: a run cut off by a time limit keeps what it measured.
        out.write_text(json.dumps({"summary": summarise(rows, gpu), "rows": rows}, indent=1) + "\n")
    print(json.dumps(summarise(rows, gpu), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
