"""Host memory traffic of torch AdamW stepping CPU tensors: the optimizer of FSDP2's CPU offload (its for-loop
path, one tensor at a time), for plan/steptime.py's HOST_OPTIM_BPS.

    PYTHONPATH=$PWD .venv/bin/python bench/cpu_adamw.py [--threads 1 2] [--numel 20000000]

The traffic counted is steptime.fsdp_offload_work's: AdamW reads weights, gradients and moments and writes the
weights and moments, and writes and reads two temporaries the size of a moment; bytes / the fastest of 3 steps.
-> bench/results/cpu_adamw.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"


def step_bytes_per_s(numel: int, dtype: torch.dtype, threads: int) -> dict:
    torch.set_num_threads(threads)
    p = torch.nn.Parameter(torch.randn(numel, dtype=dtype))
    p.grad = torch.randn(numel, dtype=dtype)
    opt = torch.optim.AdamW([p], lr=1e-3, foreach=False)   # the path torch takes for CPU DTensor shards
    opt.step()   # the moments exist from here on
    times = []
    for _ in range(3):
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    b = numel * p.element_size()
    grads, moments = b, 2 * b
    traffic = 2 * (grads + moments) + grads + 2 * moments
    return {"dtype": str(dtype).removeprefix("torch."), "threads": threads, "numel": numel,
            "step_s": round(min(times), 4), "bytes": traffic, "gb_per_s": round(traffic / min(times) / 1e9, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--numel", type=int, default=20_000_000)
    a = ap.parse_args()
    rows = [step_bytes_per_s(a.numel, dt, n) for n in a.threads for dt in (torch.float32, torch.bfloat16)]
    out = {"what": "torch AdamW (foreach=False) on CPU tensors: host memory traffic per second",
           "machine": f"{platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}, "
                      f"torch {torch.__version__}", "rows": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "cpu_adamw.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
