"""The planner for stage dpo against a real CPU step (train.device=cpu): policy, the reference (frozen
copy under full fine-tuning, adapters off under LoRA), both sides of every pair in a micro-batch."""

from __future__ import annotations

import json
import random

import pytest
import torch

from test_dpo import dpo_config


def _plan_and_real_step(cfg) -> tuple:
    """(the plan of `cfg`, the peak live tensor bytes of one real optimizer step of stage dpo on CPU, the
    stage), as tests/test_rm.py measures stage rm."""
    from trainfit.models.policy import load_policy, trainable_parameters
    from trainfit.plan import plan
    from trainfit.plan.tracker import step_peak
    from trainfit.train.dpo import DPOStage
    from trainfit.train.loop import accumulate, make_optimizer

    torch.manual_seed(0)
    loaded = load_policy(cfg.model, cfg.peft, torch.device("cpu"))
    stage = DPOStage(cfg, loaded, torch.device("cpu"))
    loaded.model.train()   # as train_stage does (LoRA dropout saves its masks)
    params = trainable_parameters(loaded.model)
    opt = make_optimizer(params, cfg.train)

    def one_step():
        accumulate(loaded.model, stage.prepare(0), cfg.train.micro_batch_size, stage.loss)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    one_step()  # optimizer state exists from here on
    # The frozen copy is the stage's, not the policy's: resident beside the policy's tensors.
    held = torch.nn.ModuleList([loaded.model] + ([stage.ref_model] if stage.ref_model is not None else []))
    return plan(cfg, gpu="h100", suggest=False), step_peak(one_step, held, opt), stage


@pytest.mark.parametrize("peft", ["none", "lora"])
def test_plan_matches_a_real_dpo_step(tmp_path, peft):
    long = tmp_path / "long.jsonl"
    words = "one two three four five six seven eight nine ten".split()
    # Chosen answers longer than data.max_seq_length (cut to 128 tokens); every other rejected answer short,
    # so each micro-batch is padded as real pairs of unequal sides are (the planner plans padded rows; with
    # every row full, transformers drops the attention mask and the step is ~6% smaller again).
    rows = [{"prompt": "q", "chosen": "yes " + " ".join(random.Random(i).choices(words, k=150)),
             "rejected": "no " + " ".join(random.Random(i).choices(words, k=150 if i % 2 else 20))}
            for i in range(8)]
    long.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = dpo_config(tmp_path, **{"model.name": "preset:small", "model.dtype": "fp32", "data.path": str(long),
                                  "data.max_seq_length": 128, "data.eval_fraction": 0.0, "peft.method": peft,
                                  "train.global_batch_size": 8, "train.micro_batch_size": 4})
    p, measured, stage = _plan_and_real_step(cfg)
    assert all(len(q["prompt"]) + len(q["chosen"]) == 128 for q in stage.pairs)  # every side at the length planned
    assert (p.counts[-1].model == "reference") == (peft == "none")
    assert p.phases["train"].allocated / measured - 1 == pytest.approx(0.0, abs=0.10)
