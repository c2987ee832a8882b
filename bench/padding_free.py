"""Training tokens/s of a GRPO micro-batch padded vs packed (train.padding_free) on CPU, at skewed lengths.

    .venv/bin/python -m bench.padding_free                          # preset:small, sdpa, 16 sequences
    .venv/bin/python -m bench.padding_free --size 20m --attn eager --reps 5

One micro-batch as GRPO trains it: `models.logprobs.sequence_logprobs` (the policy's forward, the LM
head at the policy tokens, log-probs at the rollout temperature), a loss on the log-probs and its
backward, padded (right-padded to the longest sequence) and packed (one row, position ids restarting
per sequence). The lengths are skewed as a rollout's often are: 16 prompts of 32 tokens, completions
mostly short (16-64 tokens) and two running to max_new_tokens (256). Tokens/s counts the real tokens
(no padding) over the median seconds of `--reps` steps after a warm-up, alternating the two paths.
Prints a JSON line; one thread (trainfit's CPU default for models under 100M parameters).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from bench.cpu_threads import SIZES
from trainfit.config import load_config
from trainfit.models.logprobs import sequence_logprobs
from trainfit.models.policy import load_policy


def samples(vocab: int, n: int = 16, prompt: int = 32, seed: int = 0) -> list[dict]:
    g = random.Random(seed)
    lens = [256, 256] + [g.randint(16, 64) for _ in range(n - 2)]
    return [{"input_ids": [g.randrange(3, vocab) for _ in range(prompt + c)], "loss_mask": [0] * prompt + [1] * c}
            for c in lens]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="small", choices=list(SIZES))
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    over = {"model.name": "preset:tiny", "model.dtype": "fp32", "model.attn_implementation": a.attn,
            "stage": "grpo", "task.name": "arithmetic", "train.device": "cpu"}
    over.update({f"model.config_overrides.{k}": v for k, v in SIZES[a.size][0].items()})
    cfg = load_config(None, [f"{k}={v}" for k, v in over.items()])
    model = load_policy(cfg.model, cfg.peft, torch.device("cpu"), seed=0).model.train()
    batch = samples(model.config.vocab_size)
    real = sum(len(s["input_ids"]) for s in batch)
    padded = len(batch) * max(len(s["input_ids"]) for s in batch)

    def step(packed: bool) -> float:
        t = time.perf_counter()
        logp, mask, _ = sequence_logprobs(model, batch, 0, "cpu", packed=packed)
        (-(logp * mask).sum() / mask.sum()).backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t

    step(False), step(True)   # warm-up
    times = {False: [], True: []}
    for _ in range(a.reps):
        for packed in (False, True):
            times[packed].append(step(packed))
    med = {k: statistics.median(v) for k, v in times.items()}
    params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"size": a.size, "params": params, "attn": a.attn, "sequences": len(batch),
                      "real_tokens": real, "padded_tokens": padded,
                      "padded_s": round(med[False], 4), "packed_s": round(med[True], 4),
                      "padded_tok_s": round(real / med[False]), "packed_tok_s": round(real / med[True]),
                      "speedup": round(med[False] / med[True], 2), "torch": torch.__version__}))


if __name__ == "__main__":
    main()
