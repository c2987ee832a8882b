"""Partial activation checkpointing (`model.gradient_checkpointing: k` or a fraction): the trainer
recomputes exactly the first k decoder layers, the planner plans that memory within 5% of a real CPU
step, and `trainfit fit` picks a partial setting where it is the fastest plan that fits."""

from __future__ import annotations


import pytest
import torch

from trainfit import algos
from trainfit.config import ConfigError, validate
from trainfit.models.policy import decoder_layers, load_policy
from trainfit.plan import plan
from trainfit.plan.tracker import step_peak

CPU = torch.device("cpu")


def sft_cfg(ckpt, **over):
    raw = {"stage": "sft", "task": {"name": "arithmetic"},
           "model": {"name": "preset:small", "dtype": "fp32", "gradient_checkpointing": ckpt},
           "data": {"max_seq_length": 256},
           "train": {"global_batch_size": 8, "micro_batch_size": 8, "device": "cpu"}}
    for k, v in over.items():
        sec, key = k.split(".")
        raw.setdefault(sec, {})[key] = v
    return validate(raw)


@pytest.mark.parametrize("value,expected", [(True, 4), (False, 0), (0, 0), (1, 1), (3, 3), (9, 4), (0.5, 2), (0.3, 2)])
def test_checkpointed_layer_count(value, expected):
    # preset:small has 4 layers; a fraction rounds up (0.3 x 4 = 1.2 -> 2), a count caps at the layers.
    assert sft_cfg(value).model.checkpointed_layers(4) == expected


@pytest.mark.parametrize("value", [-1, 1.0, 1.5])
def test_bad_checkpointing_values_are_config_errors(value):
    with pytest.raises(ConfigError, match="model.gradient_checkpointing"):
        sft_cfg(value)


def recomputed_layers(ckpt) -> list[int]:
    """Forward calls per decoder layer during one backward (a checkpointed layer runs its forward
    again when backward reaches it; the others do not). Counted on each layer's MLP: transformers
    checkpoints a layer's `forward`, so hooks on the layer itself stay outside the recompute; a pre-hook,
    since torch stops a recompute early, once it has rebuilt what backward needs."""
    cfg = sft_cfg(ckpt)
    torch.manual_seed(0)
    model = load_policy(cfg.model, cfg.peft, CPU).model
    model.train()
    layers = decoder_layers(model)
    calls = [0] * len(layers)
    for i, layer in enumerate(layers):
        layer.mlp.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
    ids = torch.randint(3, 500, (2, 32))
    loss = model(input_ids=ids).logits.float().pow(2).mean()
    assert calls == [1] * len(layers)
    calls[:] = [0] * len(layers)
    loss.backward()
    return calls


def test_trainer_recomputes_exactly_the_first_k_layers():
    assert recomputed_layers(2) == [1, 1, 0, 0]
    assert recomputed_layers(0.25) == [1, 0, 0, 0]
    assert recomputed_layers(True) == [1, 1, 1, 1]
    assert recomputed_layers(False) == [0, 0, 0, 0]


def real_step_peak(cfg) -> int:
    """Peak live tensor bytes of one SFT optimizer step of the trainer's model on CPU (padded batch,
    token-mean loss), counted by tracker.step_peak as bench/plan_accuracy.py does."""
    torch.manual_seed(0)
    loaded = load_policy(cfg.model, cfg.peft, CPU)
    model = loaded.model
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-5)
    mb, seq = cfg.train.micro_batch_size, cfg.data.max_seq_length

    def step():
        ids = torch.randint(3, len(loaded.tokenizer), (mb, seq))
        mask = torch.ones_like(ids)
        mask[0, :4] = 0  # a padded batch: the attention mask is materialized, as in training
        logits = model(input_ids=ids, attention_mask=mask).logits
        loss, _ = algos.sft_loss(logits, ids.masked_fill(mask == 0, -100), total_tokens=mb * (seq - 1))
        del logits
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # optimizer state exists from here on
    return step_peak(step, model, opt)


def test_partial_checkpointing_is_planned_within_5_percent_of_a_real_cpu_step():
    planned = {k: plan(sft_cfg(k), gpu="h100", suggest=False, from_data=False).phases["train"].allocated
               for k in (0, 2, 4)}
    measured = real_step_peak(sft_cfg(2))
    assert planned[2] / measured - 1 == pytest.approx(0.0, abs=0.05)
    # The setting matters: 2 of 4 layers sits well between none and all (about 50 MiB a layer here),
    # so planning it as either would miss by far more than 5%.
    assert planned[0] > 1.15 * measured and measured > 1.15 * planned[4]


def test_fit_picks_partial_checkpointing_when_it_is_the_fastest_plan_that_fits():
    """qwen3-0.6b (28 layers), bf16 full SFT at 4096 tokens, one sequence a step (micro-batch fixed at 1,
    log-probs already chunked), on a generic card between the plans with 7 and 14 checkpointed layers:
    all 28 fit, none does not, 14 (L/2) is the fewest of the searched settings that fits and, with
    half the recompute of all layers, the fastest. The fused LM head is off (an explicit choice fit
    keeps): with it 7 layers fit, and fit rightly takes that (a head matmul costs less than 7 layers'
    recompute)."""
    from trainfit.plan.fit import fit

    def cfg(ckpt):
        return validate({"stage": "sft", "task": {"name": "arithmetic"},
                         "model": {"name": "qwen3-0.6b", "dtype": "bf16", "gradient_checkpointing": ckpt},
                         "data": {"max_seq_length": 4096},
                         "train": {"global_batch_size": 1, "micro_batch_size": 1, "logits_chunk_rows": 1024,
                                   "fused_head": "off"}})

    peak = {k: plan(cfg(k), gpu="h100", suggest=False, from_data=False).peak for k in (7, 14)}
    card = f"{(peak[7] + peak[14]) / 2 / 2**30:.3f}gib"
    on_card = lambda k: plan(cfg(k), gpu=card, margin=0.0, suggest=False, from_data=False)  # noqa: E731
    assert on_card(True).fits and not on_card(False).fits and not on_card(7).fits and on_card(14).fits
    r = fit(cfg(False), gpu=card, margin=0.0)
    assert r.best is not None and r.best.overrides.get("model.gradient_checkpointing") == 14
    assert r.best.cfg.model.checkpointed_layers(28) == 14
    every = fit(cfg(True), gpu=card, margin=0.0)  # from all layers on, fit also lowers it to 14
    assert every.best.cfg.model.gradient_checkpointing == 14
    assert every.best.step.total < every.user.step.total
