"""How long `trainfit plan` takes: Llama-3.1-70B GRPO with LoRA, cold (empty cache) and warm.

    .venv/bin/python bench/plan_speed.py [--repeat 3] [--out bench/results/plan_speed.json]

Each timing is a fresh Python process running the whole command (imports included), as a user
would: `trainfit plan CONFIG --gpu h100 --num-gpus 8 --json`. Cold: an empty TRAINFIT_CACHE (the
architecture is built on the meta device and the body traced under FakeTensorMode). Warm: the cache
from the cold run (no torch import at all when every figure is cached). Target: <= 10 s cold and
<= 1 s warm on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIG = """\
stage: grpo
model: {name: meta-llama/Llama-3.1-70B-Instruct, dtype: bf16, gradient_checkpointing: true}
peft: {method: lora, r: 16, alpha: 32}
task: {name: arithmetic, chat: true}
data: {max_seq_length: 1024}
train: {global_batch_size: 64, micro_batch_size: 1}
grpo: {num_generations: 8, beta: 0.04}
rollout: {engine: hf, max_new_tokens: 1024, batch_size: 16}
distributed: {num_gpus: 8, strategy: deepspeed, zero_stage: 3}
"""


def run(cmd: list[str], env: dict) -> float:
    t = time.perf_counter()
    rc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
    if rc not in (0, 1):  # 0 fits, 1 does not fit: both are a whole plan; 2 is an error
        raise SystemExit(f"{' '.join(cmd)} exited {rc}")
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "plan_speed.json"))
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="trainfit-speed-"))
    cfg = work / "llama70b_grpo_lora.yaml"
    cfg.write_text(CONFIG)
    trainfit = str(Path(sys.executable).parent / "trainfit")
    cmd = [trainfit, "plan", str(cfg), "--gpu", "h100", "--json"]
    cold, warm = [], []
    for i in range(args.repeat):
        env = dict(os.environ, TRAINFIT_CACHE=str(work / f"cache{i}"), HF_HUB_OFFLINE="1")
        cold.append(run(cmd, env))
        warm.append(run(cmd, env))
    api = [sys.executable, "-c", "import sys; from trainfit.config import load_config; from trainfit.plan import plan; "
           f"plan(load_config({str(cfg)!r}), gpu='h100')"]
    env = dict(os.environ, TRAINFIT_CACHE=str(work / "cache0"), HF_HUB_OFFLINE="1")
    warm_api = [run(api, env) for _ in range(args.repeat)]
    res = {"command": " ".join(["trainfit", "plan", "<llama70b_grpo_lora.yaml>", "--gpu", "h100", "--json"]),
           "config": CONFIG, "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
           "cold_s": [round(x, 2) for x in cold], "warm_s": [round(x, 2) for x in warm],
           "warm_api_s": [round(x, 2) for x in warm_api],
           "cold_median_s": round(sorted(cold)[len(cold) // 2], 2), "warm_median_s": round(sorted(warm)[len(warm) // 2], 2)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
