"""Training step time on CPU at 1 vs 2 (or more) torch threads, by model size: the measurement behind
`train.cpu_threads: auto` (trainfit/core/threads.py).

    .venv/bin/python -m bench.cpu_threads                      # adds a run to bench/results/cpu_threads.json
    .venv/bin/python -m bench.cpu_threads --threads 1 2 4 --sizes tiny 20m

One fresh process per (size, threads), so each starts with its own thread pools: a full SFT step
(forward, backward, AdamW) of a random-init Qwen3-style model from trainfit's presets on the demo's
batch shape (64 sequences x 16 tokens), median seconds per step after one warm-up step. Recorded
beside each measurement: the 1-minute load average before it and the CPU seconds other processes
used while it ran (from /proc/stat), since on a shared machine a second thread competes with them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# preset:tiny with these config_overrides; parameters are counted on the built model.
SIZES = {
    "tiny": ({}, 40),
    "small": ({"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 8,
               "num_key_value_heads": 4, "head_dim": 32}, 20),
    "20m": ({"hidden_size": 384, "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 6,
             "num_key_value_heads": 2, "head_dim": 64}, 6),
    "100m": ({"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
              "num_key_value_heads": 4, "head_dim": 64}, 3),
}
BATCH, SEQ = 64, 16


def _busy_jiffies() -> int:
    """Non-idle CPU time of the whole machine so far, in clock ticks (/proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4]  # minus idle and iowait


def measure(size: str, threads: int) -> dict:
    """Run in the child: seconds per SFT step of `size` at `threads` torch threads."""
    import torch

    from trainfit.config import ModelConfig, PeftConfig
    from trainfit.models.policy import count_parameters, load_policy

    torch.set_num_threads(threads)
    torch.set_num_interop_threads(threads)
    overrides, steps = SIZES[size]
    loaded = load_policy(ModelConfig(name="preset:tiny", config_overrides=overrides), PeftConfig(),
                         torch.device("cpu"))
    model = loaded.model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ), generator=gen)
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return {"size": size, "threads": threads, "params": count_parameters(model)[0], "steps": steps,
            "s_per_step": statistics.median(times[1:]), "min_s": min(times[1:]), "max_s": max(times[1:])}


def run_child(size: str, threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    load = os.getloadavg()[0]
    busy0, own0 = _busy_jiffies(), os.times()
    out = subprocess.run([sys.executable, "-m", "bench.cpu_threads", "--child", size, str(threads)], cwd=ROOT,
                         env=env, capture_output=True, text=True, check=True)
    busy1, own1 = _busy_jiffies(), os.times()
    tick = os.sysconf("SC_CLK_TCK")
    own = (own1.children_user + own1.children_system) - (own0.children_user + own0.children_system)
    rec = json.loads(out.stdout.strip().splitlines()[-1])
    rec.update(load_before=load, other_cpu_s=round((busy1 - busy0) / tick - own, 1), cpu_s=round(own, 1))
    return rec


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cpu_threads.json")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child[0], int(args.child[1]))))
        return
    import torch
    import transformers

    rows = []
    for size in args.sizes:
        for threads in args.threads:
            rows.append(run_child(size, threads))
            r = rows[-1]
            print(f"{size:>5} {r['params'] / 1e6:7.2f}M params  {threads} thread(s): {r['s_per_step'] * 1e3:9.1f} ms/step "
                  f"(min {r['min_s'] * 1e3:.1f}, max {r['max_s'] * 1e3:.1f}; load {r['load_before']:.1f}, other "
                  f"processes {r['other_cpu_s']} CPU s while it ran)", flush=True)
    run = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.node(),
           "cores": len(os.sched_getaffinity(0)), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
           "torch": torch.__version__, "transformers": transformers.__version__, "batch": [BATCH, SEQ],
           "rows": rows}
    # Each invocation adds one run: measurements at different loads stand side by side.
    old = json.loads(args.out.read_text())["runs"] if args.out.is_file() else []
    args.out.write_text(json.dumps({"runs": [*old, run]}, indent=2) + "\n")
    print(f"added a run to {args.out}")


if __name__ == "__main__":
    main()
