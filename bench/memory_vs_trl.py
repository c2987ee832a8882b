"""Live tensor bytes of one GRPO training micro-step, trainfit vs TRL, on the same batch (CPU).

    .venv/bin/python -m bench.memory_vs_trl                       # default shapes, both sides
    .venv/bin/python -m bench.memory_vs_trl --layers 2 4 --batch 4 --prompt 32 --completion 256 \
        --out bench/results/memory_vs_trl_cpu.json

Both sides load one saved model directory (the Qwen2.5-0.5B architecture with `--layers` decoder
layers and vocab 49152, random init, bf16, sdpa), get LoRA r16 / alpha 32 on all linear layers (TRL's
adapters are overwritten with trainfit's, so both compute the same function), and run one micro-step
(forward, loss, backward) on identical token ids and completion masks: trainfit through
`GRPOStage.loss` (sequence_logprobs + grpo_loss), TRL through `GRPOTrainer.compute_loss` (its fused
LM head) and `accelerator.backward`. Each run is counted by trainfit's planner instrument
(`trainfit.plan.tracker.LiveTracker`, a dispatch mode): every storage an op creates, with its birth
and death, the module that made it, and what autograd saved for backward. Parameters are not counted.

Reported per side and layer count: the peak of live bytes over the micro-step, the live bytes at the
end of the forward (what backward will read), the saved-for-backward bytes of each decoder layer per
token, the largest storages live at the peak (op, dtype, shape, owner) and the loss value (the two
sides must agree). The per-layer cost is the slope between two layer counts.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from trainfit.plan.tracker import LiveTracker

QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
                  tie_word_embeddings=True, max_position_embeddings=32768, rope_theta=1000000.0,
                  rms_norm_eps=1e-6, hidden_act="silu", use_sliding_window=False)


def model_dir(layers: int, vocab: int, work: Path) -> Path:
    """The Qwen2.5-0.5B architecture with `layers` layers, random init (seed 0), bf16, saved once."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trainfit.models.tokenizer import build_tokenizer

    out = work / f"qwen2.5-0.5b-L{layers}-v{vocab}"
    if not (out / "config.json").exists():
        cfg = Qwen2Config(num_hidden_layers=layers, vocab_size=vocab, **QWEN25_05B)
        torch.manual_seed(0)
        Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
        build_tokenizer().save_pretrained(out)  # only the pad id is used: the token ids are random
    return out


def make_batch(b: int, prompt: int, completion: int, vocab: int, seed: int = 0) -> dict:
    """b samples of `prompt` + `completion` random tokens (no padding, like the H100 run where every
    completion hit max_new_tokens) and alternating-sign advantages."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (b, prompt + completion), generator=g)
    adv = torch.tensor([(1.0 if i % 2 == 0 else -1.0) * (0.5 + i / b) for i in range(b)])
    return {"ids": ids, "prompt": prompt, "completion": completion, "advantages": adv}


class OpTracker(LiveTracker):
    """LiveTracker that also notes, per storage, the op that made it, its dtype and shape."""

    def __init__(self, exclude: set[int]):
        super().__init__(exclude)
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self
        self.func = "input"
        self.meta: dict[int, tuple] = {}

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tracker.func = str(func.overloadpacket.__name__)
                tracker._after_op(out)
                return out

        self.mode = _Mode()

    def register(self, t):
        known = self.live.get(id(t.untyped_storage()))
        entry = super().register(t)
        if entry is not None and entry is not known:
            self.meta[entry[4]] = (self.func, str(t.dtype).replace("torch.", ""), tuple(t.shape))
        return entry

    def top_at_peak(self, k: int = 12) -> tuple[int, list[dict]]:
        """The op index of the peak and the k largest storages live there."""
        events = []
        for nbytes, _o, birth, death, _s in self.records():
            events.append((birth, nbytes))
            if death is not None:
                events.append((death, -nbytes))
        events.sort(key=lambda e: (e[0], e[1]))
        live = best = 0
        at = 0
        for op, delta in events:
            live += delta
            if live > best:
                best, at = live, op
        rows = [(n, o, s) for n, o, b, d, s in self.records() if b <= at and (d is None or d > at)]
        rows.sort(key=lambda r: -r[0])
        out = []
        for n, owner, serial in rows[:k]:
            func, dtype, shape = self.meta.get(serial, ("?", "?", ()))
            out.append({"MiB": round(n / 2**20, 2), "owner": owner, "op": func, "dtype": dtype, "shape": list(shape)})
        return at, out


def _hooks(model, tracker: OpTracker) -> list:
    """Forward pre-hooks naming the owner of what each part of the model creates."""
    from trainfit.models.policy import decoder_layers, unwrap

    base = unwrap(model, peft=True)
    handles = [base.get_input_embeddings().register_forward_pre_hook(lambda *_: setattr(tracker, "owner", "embed"))]
    for i, layer in enumerate(decoder_layers(base)):
        handles.append(layer.register_forward_pre_hook(lambda *_, i=i: setattr(tracker, "owner", f"layer{i}")))
    handles.append(base.model.norm.register_forward_pre_hook(lambda *_: setattr(tracker, "owner", "head")))
    return handles


def measure(model, micro_step) -> dict:
    """Run `micro_step()` (forward + loss, returns the loss tensor) and its backward under the tracker."""
    exclude = {id(p.untyped_storage()) for p in model.parameters()}
    exclude |= {id(b.untyped_storage()) for b in model.buffers()}
    tracker = OpTracker(exclude)
    handles = _hooks(model, tracker)
    gc.collect()
    gc.disable()  # a tensor dies when its last reference goes, as CUDA memory is freed
    try:
        with tracker.mode, torch.autograd.graph.saved_tensors_hooks(tracker.pack, lambda t: t):
            loss = micro_step()
            tracker.owner = "backward"
            tracker.mark("forward_end")
            forward_live = sum(tracker.live_at(tracker.op).values())
            loss.backward()
            value = float(loss.detach())
            tracker.owner = "after"
            del loss
    finally:
        gc.enable()
        for h in handles:
            h.remove()
    at, top = tracker.top_at_peak()
    fwd_peak = tracker.peak(0, tracker.marks["forward_end"])
    saved = defaultdict(int)
    layer_ops = defaultdict(int)  # what layer0 saves for backward, by (op, dtype, last dim)
    for serial, (n, owner) in tracker.saved.items():
        saved[owner] += n
        if owner == "layer0":
            func, dtype, shape = tracker.meta.get(serial, ("?", "?", ()))
            layer_ops[f"{func} {dtype} [..., {shape[-1] if shape else ''}]"] += n
    return {"peak_bytes": tracker.peak(), "forward_peak_bytes": fwd_peak, "forward_end_live_bytes": forward_live,
            "peak_in": "forward" if at <= tracker.marks["forward_end"] else "backward",
            "saved_bytes_by_owner": dict(sorted(saved.items())),
            "layer0_saved_by_op": dict(sorted(layer_ops.items(), key=lambda kv: -kv[1])), "top_at_peak": top,
            "loss": value}


def trainfit_side(path: Path, batch: dict, lora: dict, adapter_compute: str = "model") -> tuple:
    """trainfit's model (load_policy, `peft.adapter_compute`) and a micro-step through GRPOStage.loss.
    The LoRA B matrices (zero at init) are filled with small seeded values so the adapters change
    the loss and both factors get gradients."""
    from trainfit.config import load_config
    from trainfit.models.policy import load_policy
    from trainfit.tasks import build_task
    from trainfit.train.grpo import GRPOStage

    b, P, C = batch["ids"].shape[0], batch["prompt"], batch["completion"]
    base = {"stage": "grpo", "run_dir": tempfile.mkdtemp(prefix="memtrl-"),
            "model": {"name": str(path), "dtype": "bf16", "attn_implementation": "sdpa"},
            "peft": {"method": "lora", "r": lora["r"], "alpha": lora["alpha"], "dropout": 0.0,
                     "target_modules": "all-linear", "adapter_compute": adapter_compute},
            "task": {"name": "arithmetic", "num_eval": 0},
            "grpo": {"num_generations": 2, "loss_type": "dapo", "beta": 0.0, "num_iterations": 1},
            "rollout": {"engine": "hf", "max_new_tokens": C, "temperature": 1.0},
            "train": {"device": "cpu", "global_batch_size": b, "micro_batch_size": b}}
    cfg = load_config(None, [], base=base)
    loaded = load_policy(cfg.model, cfg.peft, torch.device("cpu"), seed=0)
    model = loaded.model.train()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    stage = GRPOStage(cfg, model, loaded.tokenizer, torch.device("cpu"), build_task(cfg.task), None, True,
                      Path(cfg.run_dir))
    micro = [{"input_ids": row.tolist(), "loss_mask": [0] * P + [1] * C, "advantage": float(a)}
             for row, a in zip(batch["ids"], batch["advantages"])]
    totals = {"total_seqs": b, "total_tokens": float(b * C), "max_len": C}
    return model, lambda: stage.loss(model, micro, totals)[0]


def trl_side(path: Path, batch: dict, lora: dict, adapters: dict, autocast: bool = False) -> tuple:
    """TRL's GRPOTrainer (peft_config; bf16=False as the benchmark runs it, or with `autocast` TRL's
    default bf16=True: accelerate's bf16 autocast) and a micro-step through compute_loss; its adapters
    are set to `adapters` (trainfit's) so both sides compute one function."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    b, P, C = batch["ids"].shape[0], batch["prompt"], batch["completion"]
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="sdpa")
    args = GRPOConfig(output_dir=tempfile.mkdtemp(prefix="memtrl-trl-"), per_device_train_batch_size=b,
                      gradient_accumulation_steps=1, num_generations=2, max_completion_length=C, beta=0.0,
                      loss_type="dapo", temperature=1.0, bf16=autocast, fp16=False, gradient_checkpointing=False,
                      use_cpu=True, report_to=[], disable_tqdm=True, logging_steps=1, save_strategy="no")
    trainer = GRPOTrainer(model=model, reward_funcs=[lambda completions, **_: [0.0] * len(completions)], args=args,
                          train_dataset=Dataset.from_list([{"prompt": "x"}] * b), processing_class=tok,
                          peft_config=LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=0.0,
                                                 target_modules="all-linear", task_type="CAUSAL_LM"))
    pm = trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's training loop
    with torch.no_grad():
        own = dict(pm.named_parameters())
        for name, value in adapters.items():
            own[name].copy_(value)
    ids = batch["ids"]
    inputs = {"prompt_ids": ids[:, :P], "prompt_mask": torch.ones(b, P, dtype=torch.long),
              "completion_ids": ids[:, P:], "completion_mask": torch.ones(b, C, dtype=torch.long),
              "advantages": batch["advantages"], "num_items_in_batch": torch.tensor(float(b * C))}

    def step():
        with trainer.compute_loss_context_manager():  # what Trainer.training_step wraps compute_loss in
            return trainer.compute_loss(pm, inputs)

    return pm, step


def adapter_dtypes(model) -> dict:
    out: dict[str, int] = defaultdict(int)
    for n, p in model.named_parameters():
        if p.requires_grad:
            out[str(p.dtype).replace("torch.", "")] += p.numel()
    return dict(out)


SIDES = {"trainfit-fp32": "trainfit, peft.adapter_compute=fp32 (peft's input cast; trainfit before this change)",
         "trainfit": "trainfit, peft.adapter_compute=model (the default: LoRA matmuls in bf16)",
         "trl": "TRL GRPOTrainer, bf16=False (as bench/sides.py runs it)",
         "trl-bf16": "TRL GRPOTrainer, bf16=True (TRL's default: accelerate bf16 autocast)"}


def rel_err(grads: dict, ref: dict) -> float:
    """Relative L2 difference of two sides' adapter gradients (same parameter names)."""
    num = sum(float((grads[k] - ref[k]).float().pow(2).sum()) for k in ref)
    den = sum(float(ref[k].float().pow(2).sum()) for k in ref)
    return (num / max(den, 1e-30)) ** 0.5


def run(layers: list[int], b: int, prompt: int, completion: int, vocab: int, lora: dict, sides: list[str]) -> dict:
    work = Path(tempfile.gettempdir()) / "trainfit-memory-vs-trl"
    batch = make_batch(b, prompt, completion, vocab)
    tokens = b * (prompt + completion)
    runs = []
    for L in layers:
        path = model_dir(L, vocab, work)
        adapters, ref = None, None
        for side in sides:
            if side.startswith("trainfit"):
                model, step = trainfit_side(path, batch, lora, "fp32" if side.endswith("fp32") else "model")
                if adapters is None:
                    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
            else:
                model, step = trl_side(path, batch, lora, adapters, autocast=side.endswith("bf16"))
            t0 = time.perf_counter()
            r = measure(model, step)
            grads = {n.replace("base_model.model.", ""): p.grad.detach().clone()
                     for n, p in model.named_parameters() if p.requires_grad}
            ref = ref or grads
            r.update(side=side, layers=L, seconds=round(time.perf_counter() - t0, 1),
                     trainable_dtypes=adapter_dtypes(model), grad_rel_err_vs_first=float(f"{rel_err(grads, ref):.3g}"))
            per_layer = [v for k, v in r["saved_bytes_by_owner"].items() if k.startswith("layer")]
            r["saved_bytes_per_token_per_layer"] = round(sum(per_layer) / len(per_layer) / tokens)
            r["layer0_saved_by_op"] = {k: round(v / tokens) for k, v in r["layer0_saved_by_op"].items()}
            runs.append(r)
            print(f"{side:13s} L={L}: peak {r['peak_bytes'] / 2**20:7.1f} MiB ({r['peak_in']}), forward peak "
                  f"{r['forward_peak_bytes'] / 2**20:7.1f}, end of forward {r['forward_end_live_bytes'] / 2**20:7.1f} "
                  f"MiB, saved/token/layer {r['saved_bytes_per_token_per_layer']} B, loss {r['loss']:.6f}, "
                  f"grad rel err {r['grad_rel_err_vs_first']:.2e}, trainable {r['trainable_dtypes']}", flush=True)
            del model, step, grads
            gc.collect()
    slopes = {}
    if len(layers) >= 2:
        lo, hi = min(layers), max(layers)
        for side in sides:
            a = next(r for r in runs if r["side"] == side and r["layers"] == lo)
            z = next(r for r in runs if r["side"] == side and r["layers"] == hi)
            slopes[side] = {k: round((z[k] - a[k]) / (hi - lo) / tokens)
                            for k in ("peak_bytes", "forward_peak_bytes", "forward_end_live_bytes")}
        print("bytes per token per layer (slope between layer counts):", json.dumps(slopes), flush=True)
    return {"shapes": {"layers": layers, "micro_batch": b, "prompt_tokens": prompt, "completion_tokens": completion,
                       "tokens": tokens, "vocab": vocab, "lora": lora, "dtype": "bf16", "attn": "sdpa"},
            "sides": {s: SIDES[s] for s in sides}, "runs": runs, "per_token_per_layer": slopes}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--completion", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--sides", nargs="+", default=list(SIDES), choices=list(SIDES))
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    result = run(a.layers, a.batch, a.prompt, a.completion, a.vocab, {"r": 16, "alpha": 32}, a.sides)
    result.update(device="cpu", command="python -m bench.memory_vs_trl " + " ".join(argv or sys.argv[1:]),
                  torch=torch.__version__, machine=platform.machine())
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
