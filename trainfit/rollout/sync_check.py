"""Prove the rollout engine samples from the weights being trained (TRL #5312, OpenRLHF #1081).

After every sync the engine completes a fixed probe batch at temperature 1 and reports its log-probs;
the trainer scores the same tokens with its own weights. If the mean absolute difference per token is
above `rollout.sync_tolerance`, the engine holds other weights (a stale copy, an adapter that never
loaded, a wrong base) and training stops instead of learning from another policy's samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainfit.rollout.base import StaleEngineError
from trainfit.models.logprobs import sequence_logprobs, single_turn_sample

PROBE_TEXTS = ["What is 12 + 7?", "Write one sentence about the sea.", "The capital of France is",
               "def add(a, b):", "List three colours:", "Translate to French: good morning",
               "Q: How many legs has a cat?\nA:", "Once upon a time"]
PROBE_TOKENS = 16


@dataclass
class SyncReport:
    mean_abs_diff: float   # mean |engine - trainer| log-prob per probe token
    max_abs_diff: float
    tokens: int


def probe_prompts(tokenizer, n: int) -> list[list[int]]:
    texts = [PROBE_TEXTS[i % len(PROBE_TEXTS)] + " " * (i // len(PROBE_TEXTS)) for i in range(n)]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


@torch.no_grad()
def check_sync(engine, model, tokenizer, device, *, n_prompts: int, tolerance: float, what: str = "") -> SyncReport:
    """Compare the engine's and the trainer's log-probs on the probe batch; raise StaleEngineError."""
    samples, eng = probe_engine(engine, tokenizer, n_prompts)
    return compare_probe(engine.name, samples, eng, model, tokenizer, device, tolerance=tolerance, what=what)


@torch.no_grad()
def probe_engine(engine, tokenizer, n_prompts: int) -> tuple[list[dict], torch.Tensor]:
    """The engine's half of the check: the probe batch completed, and its log-probs of the tokens it chose
    (fp32, one per generated token). Split from `compare_probe` so the engine may run in another process."""
    prompts = probe_prompts(tokenizer, n_prompts)
    outs = engine.generate(prompts, seeds=list(range(len(prompts))), max_new_tokens=PROBE_TOKENS,
                           logprobs=True, temperature=1.0)
    samples = [single_turn_sample(p, o.token_ids) for p, o in zip(prompts, outs) if o.token_ids]
    if not samples:
        raise StaleEngineError(f"the {engine.name} engine returned no tokens for the sync probe batch.")
    return samples, torch.tensor([x for o in outs if o.token_ids for x in (o.logprobs or [])], dtype=torch.float32)


@torch.no_grad()
def compare_probe(name: str, samples: list[dict], eng: torch.Tensor, model, tokenizer, device, *,
                  tolerance: float, what: str = "") -> SyncReport:
    """The trainer's half: score the engine `name`'s probe `samples` with `model` and compare with its
    log-probs `eng`; raise StaleEngineError above `tolerance`."""
    was_training = model.training
    model.eval()
    try:
        logp, mask, _ = sequence_logprobs(model, samples, tokenizer.pad_token_id, device, 1.0)   # [b, T-1]
    finally:
        model.train(was_training)
    trainer = logp[mask].float().cpu()                                                         # [n]
    if eng.numel() != trainer.numel():
        raise StaleEngineError(f"the {name} engine returned {eng.numel()} log-probs for "
                               f"{trainer.numel()} probe tokens; it must report one per generated token.")
    diff = (eng - trainer).abs()
    report = SyncReport(float(diff.mean()), float(diff.max()), int(diff.numel()))
    if report.mean_abs_diff > tolerance:
        raise StaleEngineError(
            f"the {name} engine does not sample from the trained weights{what}: on the probe batch its "
            f"log-probs differ from the trainer's by {report.mean_abs_diff:.4f} per token on average (max "
            f"{report.max_abs_diff:.4f}, {report.tokens} tokens), above rollout.sync_tolerance={tolerance}. "
            "The weight sync did not reach the engine (stale weights, an adapter that was not loaded, or a "
            "different base model); training stopped rather than learn from another policy's samples.")
    return report
