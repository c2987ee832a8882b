"""Padding-free GRPO / PPO / DPO micro-batches (train.padding_free, models/logprobs.ForwardBatch) train
what the padded batch trains: CPU, preset:tiny in fp32 (train.device=cpu).

A packed micro-batch is one row of its sequences back to back with position ids restarting per
sequence; transformers then keeps them apart (a block-diagonal mask with sdpa / eager on CPU), so the
per-token log-probs, the critic's values, the losses and every gradient equal the padded path's.
"""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch

from conftest import tiny_config
from trainfit.config import ConfigError, load_config
from trainfit.models import logprobs as lp

# Prompt + completion lengths far apart: the padded micro-batch is mostly padding.
SHAPES = [(3, 2), (11, 25), (4, 6), (20, 3), (6, 31), (2, 9), (14, 14), (5, 1)]


def make_samples(vocab: int, seed: int = 0) -> list[dict]:
    """Samples of skewed lengths; one multi-turn-like row (environment tokens inside its completion)
    and one zero-advantage row with an all-zero loss mask (a padding row of GRPO's ranks)."""
    g = random.Random(seed)
    out = []
    for i, (p, c) in enumerate(SHAPES):
        mask = [0] * p + [1] * c
        if i == 1:
            mask[p + 5:p + 9] = [0] * 4   # an observation between two policy turns
        if i == 7:
            mask = [0] * (p + c)
        out.append({"input_ids": [g.randrange(3, vocab) for _ in range(p + c)], "loss_mask": mask,
                    "advantage": 0.0 if i == 7 else g.uniform(-1, 1)})
    return out


def spy_shapes(model):
    """The input_ids shapes of the model's forwards, recorded while the returned list is alive."""
    seen, real = [], model.forward

    def spy(*a, **k):
        seen.append(tuple(k["input_ids"].shape))
        return real(*a, **k)

    model.forward = spy
    return seen


def grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same(got: dict, want: dict):
    assert want and got.keys() == want.keys()
    for n in want:
        assert torch.allclose(got[n], want[n], rtol=1e-4, atol=1e-6), n


def perturb(model, seed=0):
    """Move the trained policy away from its frozen reference copy (so the KL terms are not 0)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_logprobs_equal_padded(tmp_path, attn):
    from trainfit.models.policy import load_policy

    cfg = tiny_config(tmp_path, "grpo", **{"model.dtype": "fp32", "model.attn_implementation": attn})
    model = load_policy(cfg.model, cfg.peft, torch.device("cpu"), seed=0).model
    samples = make_samples(model.config.vocab_size)
    want, mask, want_ent = lp.sequence_logprobs(model, samples, 0, "cpu", 0.7, entropy=True)
    seen = spy_shapes(model)
    got, got_mask, got_ent = lp.sequence_logprobs(model, samples, 0, "cpu", 0.7, entropy=True, packed=True)
    del model.forward
    assert seen == [(1, sum(p + c for p, c in SHAPES))]   # one row, the real tokens only
    assert torch.equal(mask, got_mask) and mask.sum() > 0
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    assert torch.allclose(got_ent, want_ent, rtol=1e-5, atol=1e-5)


def test_positions_that_do_not_restart_would_differ(tmp_path, monkeypatch):
    """The equality above needs the restarts: one row read as a single long sequence gives other
    log-probs, so the equality tests can tell a packed row that leaks across its sequences."""
    from trainfit.models.policy import load_policy

    cfg = tiny_config(tmp_path, "grpo", **{"model.dtype": "fp32"})
    model = load_policy(cfg.model, cfg.peft, torch.device("cpu"), seed=0).model
    samples = make_samples(model.config.vocab_size)
    want = lp.sequence_logprobs(model, samples, 0, "cpu")[0]
    real = lp.forward_batch

    def leaky(*a, **k):
        fb = real(*a, **k)
        fb.inputs["position_ids"] = torch.arange(fb.ids.shape[1])[None]
        return fb

    monkeypatch.setattr(lp, "forward_batch", leaky)
    got = lp.sequence_logprobs(model, samples, 0, "cpu", packed=True)[0]
    assert (got - want).abs().max() > 1e-3


def _grpo_step(stage, model, samples, totals, micro):
    samples = copy.deepcopy(samples)
    stage._fill_logprobs(samples)   # reference (beta > 0) and behaviour (num_iterations > 1) log-probs
    model.zero_grad(set_to_none=True)
    total, metrics = 0.0, []
    for i in range(0, len(samples), micro):
        loss, m = stage.loss(model, samples[i:i + micro], totals)
        loss.backward()
        total += loss.item()
        metrics.append(m)
    return samples, total, grads(model), metrics


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_grpo_packed_equals_padded(tmp_path, loss_type):
    from trainfit.train.run import build_stage

    cfg = tiny_config(tmp_path, "grpo", **{"model.dtype": "fp32", "grpo.beta": 0.04, "grpo.num_iterations": 2,
                                           "grpo.loss_type": loss_type, "rollout.sync_check": "never"})
    loaded, stage, _ = build_stage(cfg, tmp_path / "stage")
    model = loaded.model
    assert stage.packed is False   # auto: sdpa on CPU trains padded
    perturb(model)
    samples = make_samples(model.config.vocab_size)
    tokens = sum(sum(s["loss_mask"]) for s in samples)
    totals = {"total_seqs": len(samples), "total_tokens": float(tokens), "max_len": 40}
    want = _grpo_step(stage, model, samples, totals, micro=4)
    stage.packed = True
    seen = spy_shapes(model)
    got = _grpo_step(stage, model, samples, totals, micro=4)
    del model.forward
    halves = [sum(p + c for p, c in SHAPES[:4]), sum(p + c for p, c in SHAPES[4:])]
    # The no-grad old log-probs (train.micro_batch_size 8 a forward; the reference is its own copy), then
    # the training forwards of the 4-sample micro-batches: one row each, their real tokens.
    assert seen == [(1, sum(halves))] + [(1, n) for n in halves]
    for key in ("ref_logp", "old_logp"):
        for a, b in zip(got[0], want[0]):
            assert torch.allclose(a[key], b[key], rtol=1e-5, atol=1e-5), key
    assert got[1] == pytest.approx(want[1], rel=1e-5, abs=1e-7)
    assert_same(got[2], want[2])
    for a, b in zip(got[3], want[3]):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k


def test_ppo_packed_equals_padded(tmp_path):
    """The policy and critic forwards of PPO: behaviour / reference log-probs and old values, GAE,
    and the clipped policy + value loss with an entropy bonus, with their gradients."""
    from trainfit.train.run import build_stage

    cfg = tiny_config(tmp_path, "ppo", **{"model.dtype": "fp32", "ppo.kl_coef": 0.05, "ppo.entropy_coef": 0.01,
                                          "rollout.sync_check": "never", "train.micro_batch_size": 4})
    loaded, stage, _ = build_stage(cfg, tmp_path / "stage")
    pair = loaded.model
    perturb(pair.policy)
    perturb(pair.critic, seed=1)
    samples = make_samples(pair.policy.config.vocab_size)
    scores = torch.linspace(-1, 1, len(samples))
    totals = {"total_seqs": len(samples), "total_tokens": float(sum(sum(s["loss_mask"]) for s in samples)),
              "max_len": 40}

    def step(packed: bool):
        stage.packed = packed
        smp = copy.deepcopy(samples)
        stage._fill(smp)
        stage._advantages(smp, scores)
        pair.zero_grad(set_to_none=True)
        total = 0.0
        for i in range(0, len(smp), 4):
            loss, _ = stage.loss(pair, smp[i:i + 4], totals)
            loss.backward()
            total += loss.item()
        return smp, total, grads(pair)

    want = step(False)
    seen = spy_shapes(pair.critic.backbone)
    got = step(True)
    del pair.critic.backbone.forward
    assert seen and all(s[0] == 1 for s in seen)   # the critic's forwards packed too
    for a, b in zip(got[0], want[0]):
        for key in ("old_logp", "ref_logp", "old_values", "advantages", "returns"):
            assert torch.allclose(a[key], b[key], rtol=1e-5, atol=1e-5), key
    assert got[1] == pytest.approx(want[1], rel=1e-5, abs=1e-7)
    assert_same(got[2], want[2])


def skewed_pairs(path, n=8):
    g = random.Random(0)
    rows = []
    for i in range(n):
        rows.append({"prompt": " ".join(g.choice("abcdefgh") for _ in range(g.choice([1, 3, 12]))) + "?",
                     "chosen": " ".join("yes" for _ in range(g.choice([1, 2, 9]))),
                     "rejected": " ".join("no" for _ in range(g.choice([1, 6])))})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("loss_type", ["sigmoid", "simpo"])
def test_dpo_packed_equals_padded(tmp_path, loss_type):
    from trainfit.train.run import build_stage

    over = {"run_dir": str(tmp_path / "run"), "stage": "dpo", "model.name": "preset:tiny", "model.dtype": "fp32",
            "data.path": str(skewed_pairs(tmp_path / "pairs.jsonl")), "data.eval_fraction": 0,
            "dpo.loss_type": loss_type, "train.device": "cpu", "train.global_batch_size": 8,
            "train.micro_batch_size": 4, "logging.progress": "false", "logging.report_to": "none"}
    cfg = load_config(None, [f"{k}={v}" for k, v in over.items()])
    loaded, stage, _ = build_stage(cfg, tmp_path / "stage")
    model = loaded.model
    perturb(model)
    batch = stage.prepare(0)

    def step(packed: bool):
        stage.packed = packed
        model.zero_grad(set_to_none=True)
        total = 0.0
        for i in range(0, len(batch.samples), 4):
            loss, _ = stage.loss(model, batch.samples[i:i + 4], batch.totals)
            loss.backward()
            total += loss.item()
        return total, grads(model)

    want = step(False)
    seen = spy_shapes(model)
    got = step(True)
    del model.forward
    assert seen and all(s[0] == 1 for s in seen)
    assert got[0] == pytest.approx(want[0], rel=1e-5, abs=1e-7)
    assert_same(got[1], want[1])


def test_padding_free_switch(tmp_path):
    auto = tiny_config(tmp_path, "grpo")
    assert auto.train.padding_free == "auto" and not auto.padding_free()   # sdpa: padded
    assert tiny_config(tmp_path, "dpo", **{"train.padding_free": "on", "data.path": str(tmp_path)}).padding_free()
    assert tiny_config(tmp_path, "grpo", **{"model.attn_implementation": "flash_attention_2"}).padding_free()
    assert not tiny_config(tmp_path, "ppo", **{"model.attn_implementation": "flash_attention_2",
                                                "train.padding_free": "off"}).padding_free()
    assert tiny_config(tmp_path, "grpo", **{"train.padding_free": True}).train.padding_free == "on"   # YAML's on
    with pytest.raises(ConfigError, match="train.padding_free=on .*data.packing"):
        tiny_config(tmp_path, "sft", **{"train.padding_free": "on"})


def dpo_plan_config(tmp_path, padding_free: str, attn: str = "flash_attention_2"):
    over = {"run_dir": str(tmp_path / "run"), "stage": "dpo", "model.name": "preset:tiny", "model.dtype": "bf16",
            "model.attn_implementation": attn, "data.path": str(skewed_pairs(tmp_path / "p.jsonl", 64)),
            "data.eval_fraction": 0, "train.device": "cpu", "train.global_batch_size": 8, "train.micro_batch_size": 8,
            "train.padding_free": padding_free, "logging.progress": "false", "logging.report_to": "none"}
    return load_config(None, [f"{k}={v}" for k, v in over.items()])


def test_planner_packs_dpo_micro_batches_at_their_real_tokens(tmp_path):
    """The planned packed row is the largest one the trainer can form from the data (the 8 pairs with the
    longest sides, both sides each), it bounds every micro-batch the trainer packs, and the activations
    and FLOPs are planned at real tokens rather than micro x the longest."""
    from trainfit.plan import plan
    from trainfit.train.dpo import pair_sequences
    from trainfit.train.run import build_stage

    cfg, mb = dpo_plan_config(tmp_path, "on"), 8
    packed, padded = plan(cfg, gpu="h100", suggest=False), plan(dpo_plan_config(tmp_path, "off"), gpu="h100",
                                                                 suggest=False)
    stage = build_stage(dpo_plan_config(tmp_path, "on", "sdpa"), tmp_path / "stage")[1]   # the same pairs
    longer = sorted(len(p["prompt"]) + max(len(p["chosen"]), len(p["rejected"])) for p in stage.pairs)
    worst = 2 * sum(longer[-mb:])
    act_on, act_off = (next(i for i in p.items if i.name.startswith("activations")) for p in (packed, padded))
    assert f"micro 1 x {worst} tokens" in act_on.name and f"micro {2 * mb} x {longer[-1]} tokens" in act_off.name
    widths = [lp.forward_batch(pair_sequences([stage.pairs[stage.order(q)] for q in range(i, i + mb)]), 0, "cpu",
                               packed=True).ids.shape[1] for i in range(0, len(stage.pairs) - mb + 1, mb)]
    assert max(widths) <= worst < 2 * mb * longer[-1]
    assert act_on.train < act_off.train
    # The FLOPs: every sequence at the data's mean length instead of its longest.
    mean = sum(longer) / len(longer)
    ratio = packed.work["train_flops"] / padded.work["train_flops"]
    assert ratio < 0.75 and ratio == pytest.approx(mean / longer[-1], rel=0.15)


def test_planner_packs_grpo_policy_rows(tmp_path):
    """A packed GRPO micro-batch is one row of micro x (prompt + completion) tokens at the worst (every
    completion at max_new_tokens); the LM head still scores micro x max_new_tokens policy rows."""
    from trainfit.plan import plan

    def planned(pf):
        return plan(tiny_config(tmp_path, "grpo", **{"train.padding_free": pf, "rollout.max_new_tokens": 16,
                                                     "model.attn_implementation": "flash_attention_2"}),
                    gpu="h100", suggest=False)

    on, off = planned("on"), planned("off")
    assert any("train.padding_free: each micro-batch is one packed row" in n for n in on.notes)
    assert not any("train.padding_free" in n for n in off.notes)
    item = lambda p, name: next(i for i in p.items if i.name.startswith(name))  # noqa: E731
    assert "micro 1 x" in item(on, "activations").name and "micro 8 x" in item(off, "activations").name
    head_on, head_off = item(on, "logits + loss peak"), item(off, "logits + loss peak")
    assert "[1 x 128, " in head_on.note and "[8 x 16, " in head_off.note
    assert head_on.train == pytest.approx(head_off.train, rel=0.1)


def test_vision_language_policies_train_padded(tmp_path):
    """Image tokens and their rope positions are placed per row: `auto` trains such a policy padded,
    `on` is refused with the fix; a text policy packs where asked."""
    from types import SimpleNamespace

    from trainfit.train.stage import padding_free

    vlm = SimpleNamespace(config=SimpleNamespace(vision_config={"depth": 1}))
    text = SimpleNamespace(config=SimpleNamespace())
    flash = {"model.attn_implementation": "flash_attention_2"}
    assert not padding_free(tiny_config(tmp_path, "grpo", **flash), vlm)
    assert padding_free(tiny_config(tmp_path, "grpo", **flash), text)
    with pytest.raises(ConfigError, match="train.padding_free=on with a vision-language policy.*auto"):
        padding_free(tiny_config(tmp_path, "grpo", **{"train.padding_free": "on"}), vlm)
