"""CPU proxy of decoding speed: trainfit's decoding loop on a preset model, per decode step, host side.

    .venv/bin/python -m bench.decode_proxy                         # -> bench/results/decode_proxy_cpu.json
    .venv/bin/python -m bench.decode_proxy --profile               # + where a step's host time goes (cProfile)
    .venv/bin/python -m bench.decode_proxy --preset small --rows 64 --new 64 --out /tmp/d.json

One random-init preset model (`preset:tiny` by default; the SmolLM2-style tokenizer trained locally), on
CPU, one GRPO-shaped rollout call: `--prompts` distinct prompts x `--group` completions each, up to
`--new` new tokens, temperature 1, per-row seeds, log-probs recorded (as GRPO asks), through
HFEngine's two cache layouts of trainfit's decoding loop:

- `dynamic`: the growing DynamicCache, finished rows leave the batch (rollout.hf_cache=dynamic, the
  CPU default);
- `static`: the preallocated static cache and the one-function decode step that is one CUDA graph on
  a GPU (rollout.hf_cache=static; on CPU the same step runs eagerly).

A tiny model's forward is mostly Python too, so on CPU the loop's own overhead (sampling, syncs,
concatenations, bookkeeping) is a visible share of a step, as it is next to a replayed graph on a GPU.
Per path: tokens/s and ms per decode step (median of `--reps` calls after a warm-up), the share spent
in the model's forward (timed around each call of it), the rest of the step (host overhead: sampling,
log-probs, bookkeeping), and the device-to-host sync points the loop reaches per step (calls of
`.item()`, `.tolist()`, `.cpu()`, `bool()` / `int()` / `float()` of a tensor and `.nonzero()`: free on
CPU, each a stall of the host on a GPU). No timings are asserted anywhere: this is a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import platform
import pstats
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from trainfit.config import ModelConfig, PeftConfig, RolloutConfig
from trainfit.models.policy import load_policy
from trainfit.rollout.hf import HFEngine

ROOT = Path(__file__).resolve().parents[1]
PATHS = {"dynamic": {"decoder": "trainfit", "hf_cache": "dynamic"},
         "static": {"decoder": "trainfit", "hf_cache": "static"}}
# Tensor methods that make the host wait for the device (on a GPU) when the loop calls them.
SYNC_METHODS = ("item", "tolist", "cpu", "__bool__", "__int__", "__float__", "nonzero")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


@contextlib.contextmanager
def count_syncs(counts: dict):
    """Count calls of SYNC_METHODS on tensors while inside (patched on torch.Tensor, restored after)."""
    saved = {m: getattr(torch.Tensor, m) for m in SYNC_METHODS}

    def wrap(name, fn):
        def counted(self, *a, **k):
            counts[name] = counts.get(name, 0) + 1
            return fn(self, *a, **k)
        return counted

    try:
        for m, fn in saved.items():
            setattr(torch.Tensor, m, wrap(m, fn))
        yield counts
    finally:
        for m, fn in saved.items():
            setattr(torch.Tensor, m, fn)


@contextlib.contextmanager
def timed_forward(model, seconds: list):
    """Append (wall, process CPU) seconds of each decode-step forward (one new token per row) of
    `model` to `seconds`."""
    real = model.forward

    def forward(*a, **k):
        t, c = time.perf_counter(), time.process_time()
        out = real(*a, **k)
        if k["input_ids"].shape[1] == 1:
            seconds.append((time.perf_counter() - t, time.process_time() - c))
        return out

    model.forward = forward
    try:
        yield seconds
    finally:
        del model.forward


def setup(preset: str, n_prompts: int, group: int):
    lm = load_policy(ModelConfig(name=f"preset:{preset}", seed=0), PeftConfig(), torch.device("cpu"))
    tok = lm.tokenizer
    # Distinct prompts of different lengths (left padding matters), each `group` times.
    texts = [f"Question {i}: what is {3 * i + 7} plus {11 * i + 2}? Think step by step." + " Please" * (i % 3)
             for i in range(n_prompts)]
    prompts = [tok(t)["input_ids"] for t in texts]
    return lm, [p for p in prompts for _ in range(group)]


def one_call(engine: HFEngine, prompts: list, seeds: list, new: int) -> dict:
    fwd: list = []
    syncs: dict = {}
    with timed_forward(engine.model, fwd), count_syncs(syncs):
        t, c = time.perf_counter(), time.process_time()
        out = engine.generate(prompts, seeds=seeds, max_new_tokens=new, logprobs=True)
        dt, dc = time.perf_counter() - t, time.process_time() - c
    lengths = [len(c.token_ids) for c in out]
    steps = max(lengths)
    per_fwd = [1e3 * sum(f[i] for f in fwd) / max(len(fwd), 1) for i in (0, 1)]
    return {"seconds": dt, "tokens": sum(lengths), "decode_steps": steps, "tokens_per_s": sum(lengths) / dt,
            "ms_per_step": 1e3 * dt / steps, "forward_ms_per_step": per_fwd[0],
            "cpu_ms_per_step": 1e3 * dc / steps, "forward_cpu_ms_per_step": per_fwd[1],
            "forwards": len(fwd), "sync_calls": syncs, "sync_calls_per_step": sum(syncs.values()) / steps}


def measure(lm, prompts: list, new: int, reps: int, paths: dict) -> dict:
    seeds = list(range(len(prompts)))
    rows = {}
    for name, over in paths.items():
        engine = HFEngine(lm.model, lm.tokenizer, RolloutConfig(max_new_tokens=new, **over))
        one_call(engine, prompts, seeds, 8)                                          # warm-up
        calls = [one_call(engine, prompts, seeds, new) for _ in range(reps)]
        med = {k: statistics.median(c[k] for c in calls)
               for k in ("tokens_per_s", "ms_per_step", "forward_ms_per_step", "cpu_ms_per_step",
                         "forward_cpu_ms_per_step", "sync_calls_per_step")}
        # Host overhead: the step's time outside the model's forward (whole call / steps - one forward);
        # also in process CPU time, which other processes on a busy machine disturb less than wall time.
        med["host_overhead_ms_per_step"] = med["ms_per_step"] - med["forward_ms_per_step"]
        med["host_overhead_cpu_ms_per_step"] = med["cpu_ms_per_step"] - med["forward_cpu_ms_per_step"]
        rows[name] = {"config": over, **{k: round(v, 4) for k, v in med.items()}, "calls": calls}
        print(f"{name:8s} {med['tokens_per_s']:8.0f} tok/s  {med['ms_per_step']:7.3f} ms/step  forward "
              f"{med['forward_ms_per_step']:6.3f}  rest {med['host_overhead_ms_per_step']:6.3f}  (CPU time: step "
              f"{med['cpu_ms_per_step']:6.3f}, rest {med['host_overhead_cpu_ms_per_step']:6.3f})  "
              f"syncs/step {med['sync_calls_per_step']:.2f}", flush=True)
    return rows


SYNC_NAMES = tuple(f"<method '{m}' of 'torch._C.TensorBase' objects>" for m in SYNC_METHODS)
LOOP_FILES = ("rollout/decode.py", "rollout/static_step.py", "rollout/sampling.py", "rollout/hf.py")
SAMPLING = ("pick", "gumbel_noise", "gumbel_from_keys", "sample", "row_step_keys", "splitmix64_t", "_hash32")


def _split(stats: dict, names: tuple) -> tuple[float, float, float, float]:
    """(seconds, calls) of the builtins `names` called from trainfit's loop, then from the model."""
    loop_s = loop_n = model_s = model_n = 0.0
    for (f, _, n), v in stats.items():
        if f == "~" and n in names:
            for caller, (_, nc, tt, ct) in v[4].items():
                if caller[0].endswith(LOOP_FILES):
                    loop_s, loop_n = loop_s + ct, loop_n + nc
                else:
                    model_s, model_n = model_s + ct, model_n + nc
    return loop_s, loop_n, model_s, model_n


def profile_call(lm, prompts: list, new: int, paths: dict) -> dict:
    """One call per path under cProfile: CPU ms per decode step of each part of the step and the calls
    per step of the sync points and concatenations, split between the loop and the model's forward."""
    seeds = list(range(len(prompts)))
    out = {}
    for name, over in paths.items():
        engine = HFEngine(lm.model, lm.tokenizer, RolloutConfig(max_new_tokens=new, **over))
        engine.generate(prompts, seeds=seeds, max_new_tokens=8, logprobs=True)            # warm-up
        fwd: list = []
        # Process CPU time, not wall: other processes on a busy machine then shift the split less.
        prof = cProfile.Profile(time.process_time)
        with timed_forward(engine.model, fwd):     # its wrapper marks the forward's share below
            prof.enable()
            t = time.process_time()
            res = engine.generate(prompts, seeds=seeds, max_new_tokens=new, logprobs=True)
            dt = time.process_time() - t
            prof.disable()
        steps = max(len(c.token_ids) for c in res)
        st = pstats.Stats(prof).stats
        ms = lambda s, steps=steps: 1e3 * s / steps                                       # noqa: E731
        forward = sum(v[3] for (f, _, n), v in st.items() if n == "forward" and f.endswith("decode_proxy.py"))
        sampling = sum(v[3] for (f, _, n), v in st.items() if f.endswith(LOOP_FILES) and n in SAMPLING
                       and not any(c[0].endswith(LOOP_FILES) and c[2] in SAMPLING for c in v[4]))
        lsm = _split(st, ("<built-in method torch.log_softmax>", "<method 'log_softmax' of 'torch._C.TensorBase' objects>"))
        syncs = _split(st, SYNC_NAMES)
        cats = _split(st, ("<built-in method torch.cat>",))
        parts = {"model forward (HF modules: Python + kernels)": ms(forward),
                 "  of which torch.cat in the model (rotary; dynamic: cache growth)": ms(cats[2]),
                 "  of which sync points in the model": ms(syncs[2]),
                 "sampling (warpers, Gumbel noise, argmax)": ms(sampling),
                 "log-softmax of the step's logits": ms(lsm[0]),
                 "sync points in the loop (.item/.tolist/.cpu/bool/nonzero)": ms(syncs[0]),
                 "torch.cat in the loop (growing ids / mask)": ms(cats[0])}
        top = [k for k in parts if not k.startswith("  ")]
        parts["rest of the loop (Python, indexing, allocations, masks)"] = ms(dt) - sum(parts[k] for k in top)
        calls = {"sync points in the loop": syncs[1] / steps, "sync points in the model": syncs[3] / steps,
                 "torch.cat in the loop": cats[1] / steps, "torch.cat in the model": cats[3] / steps}
        out[name] = {"cpu_ms_per_step_profiled": round(ms(dt), 4), "decode_steps": steps,
                     "parts_ms_per_step": {k.strip(): round(v, 4) for k, v in parts.items()},
                     "calls_per_step": {k: round(v, 2) for k, v in calls.items()}}
        print(f"\n{name}: {ms(dt):.3f} CPU ms per decode step under cProfile ({steps} steps)")
        for k, v in parts.items():
            print(f"  {k:62s} {v:7.3f} ms  {v / ms(dt):6.1%}")
        print("  calls per step: " + ", ".join(f"{k} {v:.1f}" for k, v in calls.items()))
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny", choices=("tiny", "small"))
    ap.add_argument("--prompts", type=int, default=4, help="distinct prompts")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt")
    ap.add_argument("--new", type=int, default=64, help="max new tokens")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: the host overhead, not the cores)")
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--profile", action="store_true", help="also one cProfile'd call per path, split by part")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "decode_proxy_cpu.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    paths = {k: PATHS[k] for k in args.paths.split(",") if k}
    lm, prompts = setup(args.preset, args.prompts, args.group)
    result = {"device": cpu_name(), "torch_threads": args.threads, "preset": args.preset,
              "rows": len(prompts), "distinct_prompts": args.prompts, "max_new_tokens": args.new,
              "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "command": "python -m bench.decode_proxy " + " ".join(sys.argv[1:] if argv is None else argv).replace(
                  f"{ROOT}/", ""),
              "torch": torch.__version__, "loadavg_before": os.getloadavg(),
              "paths": measure(lm, prompts, args.new, args.reps, paths)}
    if args.profile:
        result["profile"] = profile_call(lm, prompts, args.new, paths)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"-> {args.out}")
    return result


if __name__ == "__main__":
    main()
