"""Padding-free packed SFT (data.packing, train/packing.py) trains what the padded batch trains.

A micro-batch's sequences go back to back in one row with position ids restarting per sequence; the
attention must keep them apart, so the loss and every gradient equal the padded path's (fp32).
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_config
from trainfit.config import ConfigError
from trainfit.train.packing import pack

ROWS = [  # prompt/completion pairs of quite different lengths (the padded batch is mostly padding)
    {"prompt": "What is two plus two?", "completion": " Four."},
    {"prompt": "Name a colour.", "completion": " The sky over the sea on a clear summer day is blue, mostly."},
    {"prompt": "Say hi.", "completion": " hi"},
    {"prompt": "Count to five, please, slowly and with commas.", "completion": " one, two, three, four, five"},
    {"prompt": "A long question about foxes, dogs, and what the quick brown fox did to the lazy dog?",
     "completion": " It jumped over it."},
    {"prompt": "Yes?", "completion": " No."},
]


def stage_for(tmp_path, packing: bool):
    from trainfit.train.run import build_stage

    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS * 2))
    cfg = tiny_config(tmp_path, "sft", **{"task.name": "null", "data.path": str(data), "data.eval_fraction": 0,
                                          "data.packing": packing, "model.dtype": "fp32",
                                          "train.global_batch_size": 6, "train.micro_batch_size": 3})
    loaded, stage, _ = build_stage(cfg, tmp_path / f"stage-{packing}")
    return loaded.model, stage


def loss_and_grads(model, stage, micro: int):
    """The step's loss and gradients, micro-batch by micro-batch as the trainer accumulates them."""
    model.zero_grad(set_to_none=True)
    batch = stage.prepare(0)
    total = 0.0
    for i in range(0, len(batch.samples), micro):
        loss, metrics = stage.loss(model, batch.samples[i:i + micro], batch.totals)
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, batch


def test_pack_restarts_positions_and_masks_each_first_label():
    items = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8, 9], "labels": [8, 9]}]
    row = pack(items)
    assert row["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert row["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    # 8 is labelled in its own row but scored by nothing unpacked (a row's first label never is): masked.
    assert row["labels"].tolist() == [[-100, 6, 7, -100, 9]]


@pytest.mark.parametrize("micro", [3, 6])
def test_packed_sft_equals_padded(tmp_path, micro):
    model, padded = stage_for(tmp_path, packing=False)
    _, packed = stage_for(tmp_path, packing=True)
    want, want_g, batch = loss_and_grads(model, padded, micro)
    lengths = [len(s["input_ids"]) for s in batch.samples]
    assert len(set(lengths)) > 2  # real padding in the padded batch
    seen = []
    real_forward = model.forward

    def spy(*a, **k):
        seen.append(tuple(k["input_ids"].shape))
        return real_forward(*a, **k)

    model.forward = spy
    try:
        got, got_g, _ = loss_and_grads(model, packed, micro)
    finally:
        del model.forward
    # One row per micro-batch, exactly its tokens (no padding).
    assert seen == [(1, sum(lengths[i:i + micro])) for i in range(0, len(lengths), micro)]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert want_g.keys() == got_g.keys() and want_g
    for n in want_g:
        assert torch.allclose(got_g[n], want_g[n], rtol=1e-4, atol=1e-6), n


def test_unrestarted_positions_would_differ(tmp_path):
    """The equality above depends on the restarts: one row without them (a single long sequence)
    gives another loss, so the test can tell a packed row that leaks across sequences."""
    model, stage = stage_for(tmp_path, packing=True)
    batch = stage.prepare(0)
    from trainfit.train import packing

    real_pack = packing.pack
    good = packing.packed_loss(model, batch.samples, batch.totals, torch.device("cpu"))[0].item()

    def leaky(items):
        row = real_pack(items)
        row["position_ids"] = torch.arange(row["input_ids"].shape[1])[None]
        return row

    packing.pack = leaky
    try:
        bad = packing.packed_loss(model, batch.samples, batch.totals, torch.device("cpu"))[0].item()
    finally:
        packing.pack = real_pack
    assert abs(bad - good) > 1e-3


def test_packing_is_for_sft_only(tmp_path):
    with pytest.raises(ConfigError, match="data.packing"):
        tiny_config(tmp_path, "pretrain", **{"task.name": "null", "data.path": str(tmp_path), "data.packing": True})
    with pytest.raises(ConfigError, match="data.packing"):
        tiny_config(tmp_path, "grpo", **{"data.packing": True})


def test_packed_step_is_planned_within_6_percent_of_a_real_cpu_step():
    """The planner counts one packed row of micro x max_seq_length tokens (its block-diagonal mask
    included); measured on the trainer's packed loss with every sequence at max_seq_length."""
    from trainfit.config import validate
    from trainfit.models.policy import load_policy
    from trainfit.plan import plan
    from trainfit.plan.tracker import step_peak
    from trainfit.train.packing import packed_loss

    mb, seq = 8, 256
    raw = {"stage": "sft", "task": {"name": "arithmetic"}, "model": {"name": "preset:small", "dtype": "fp32"},
           "data": {"max_seq_length": seq, "packing": True},
           "train": {"global_batch_size": mb, "micro_batch_size": mb, "device": "cpu"}}
    cfg = validate(raw)
    planned = plan(cfg, gpu="h100", suggest=False, from_data=False)
    unpacked = plan(validate({**raw, "data": {"max_seq_length": seq}}), gpu="h100", suggest=False, from_data=False)
    assert any(f"{mb} x {seq} = {mb * seq} tokens" in n for n in planned.notes) and planned.seq_len == seq
    torch.manual_seed(0)
    loaded = load_policy(cfg.model, cfg.peft, torch.device("cpu"))
    model = loaded.model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    gen = torch.Generator().manual_seed(0)
    items = [{"input_ids": ids, "labels": ids}
             for ids in torch.randint(3, len(loaded.tokenizer), (mb, seq), generator=gen).tolist()]

    def step():
        loss, _ = packed_loss(model, items, {"tokens": mb * (seq - 1)}, torch.device("cpu"))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # optimizer state exists from here on
    measured = step_peak(step, model, opt)
    got = planned.phases["train"].allocated
    padded = unpacked.phases["train"].allocated
    assert got / measured - 1 == pytest.approx(0.0, abs=0.06), (got, measured, padded)
    # The packed row's [N, N] block-diagonal mask and [1, N] shapes matter here: the padded plan is ~14% under.
    assert padded < 0.9 * measured, (got, measured, padded)
