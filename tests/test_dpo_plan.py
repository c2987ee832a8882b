"""The planner for stage dpo against a real CPU step (train.device=cpu): policy, the reference (frozen
copy under full fine-tuning, adapters off under LoRA), both sides of every pair in a micro-batch."""

from __future__ import annotations

import io
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


def test_plan_has_a_scoring_phase_sized_by_the_reference_forward(tmp_path):
    """The reference's no-grad forward (DPOStage.prepare, memstats phase `scoring`) is a phase of the plan:
    the train phase's resident bytes plus that forward, which holds no activations for backward (below the
    policy's forward/backward at the same micro-batch) and grows with the micro-batch's sequences."""
    from trainfit.plan import plan
    from trainfit.plan.report import render
    from rich.console import Console

    def planned(**over):
        cfg = dpo_config(tmp_path, **{"model.name": "preset:small", "data.max_seq_length": 128, **over})
        return plan(cfg, gpu="h100", suggest=False)

    p = planned()
    ref_fwd, fb = p.substeps["reference forward"], p.substeps["policy forward/backward"]
    scoring, train = p.phases["scoring"], p.phases["train"]
    assert scoring.step == "reference forward" and 0 < ref_fwd < fb
    resident = train.allocated - p.substeps[train.step]
    assert scoring.allocated == resident + ref_fwd
    # With accumulation, the train phase holds the micro-steps' gradients; the reference forward runs in
    # prepare(), before the step's first backward (the last step's gradients freed): the H100's DPO case
    # used 3.12 GiB there, planned 3.77 with them (+20.8%), 3.02 without. Both figures move apart by them.
    acc = planned(**{"train.micro_batch_size": 2})
    grads = sum(i.train for i in acc.items if i.between_steps)
    assert grads > 0 and "gradients (accumulating" in next(i.name for i in acc.items if i.between_steps)
    assert acc.phases["scoring"].allocated == (acc.phases["train"].allocated - acc.substeps[acc.phases["train"].step]
                                               - grads + acc.substeps["reference forward"])
    # Half the micro-batch, half the sequences (2 a pair) through the reference forward.
    assert acc.substeps["reference forward"] == pytest.approx(ref_fwd / 2, rel=0.02)
    # Nothing scored: a reference-free loss, or reference log-probs computed before the first step.
    assert "scoring" not in planned(**{"dpo.loss_type": "simpo"}).phases
    assert "scoring" not in planned(**{"dpo.precompute_reference": "true"}).phases
    # KTO with stored reference log-probs still runs the policy over the step's mismatched rows for z0.
    kto = planned(**{"dpo.loss_type": "kto", "dpo.precompute_reference": "true"})
    assert kto.phases["scoring"].step == "kto z0 forward"
    out = io.StringIO()
    render(p, Console(file=out, width=200))
    assert "scoring peak" in out.getvalue() and "at: reference forward (no grad)" in out.getvalue()


def test_a_dpo_runs_memory_table_names_the_scoring_phase(tmp_path):
    from test_dpo import QUIET
    from trainfit.train.report import read_metrics
    from trainfit.train.run import run_pipeline

    r = run_pipeline(dpo_config(tmp_path), console=QUIET)[0]
    memory, = [m for m in read_metrics(r.stage_dir / "metrics.jsonl") if m["kind"] == "memory"]
    assert memory["planned_scoring_gib"] > 0 and memory["used_scoring_gib"] > 0
    assert memory["planned_scoring_gib"] <= memory["planned_train_gib"]
    # Steps record the scoring phase too (CPU: the process's resident set while it runs).
    train = [m for m in read_metrics(r.stage_dir / "metrics.jsonl") if m["kind"] == "train"]
    assert all(m["cpu_rss_sampled_scoring_gib"] > 0 for m in train)
