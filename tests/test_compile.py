"""train.compile (models/compile.py): compiled decoder layers train exactly what the eager ones train.

The default-suite tests compile with the `aot_eager` backend (Dynamo's trace and AOT autograd's
forward/backward split, no code generation: seconds on 2 cores); the inductor test is `slow` (its
C++ code generation takes minutes on a small CPU).
"""

from __future__ import annotations

import pytest
import torch

from trainfit import algos
from trainfit.config import ModelConfig, PeftConfig
from trainfit.models.policy import load_policy
from trainfit.models.compile import compile_blocks

CPU = torch.device("cpu")


def steps(backend, ckpt=False, lora=False):
    """Loss and gradients of two SFT-style steps at two sequence lengths (the second one makes Dynamo
    recompile with a dynamic length), eager (backend None) or with compiled layers."""
    torch.manual_seed(0)
    lm = load_policy(ModelConfig(name="preset:tiny", seed=3, gradient_checkpointing=ckpt),
                     PeftConfig(method="lora", r=4) if lora else PeftConfig(), CPU)
    model = lm.model.train()
    if backend is not None:
        assert compile_blocks(model, backend=backend) == 2   # preset:tiny has 2 decoder layers
    ids = torch.randint(3, 400, (2, 24), generator=torch.Generator().manual_seed(1))
    out = []
    for T in (24, 17):
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids[:, :T]).logits
        loss, _ = algos.sft_loss(logits, ids[:, :T], total_tokens=2 * (T - 1))
        loss.backward()
        out.append((loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    return out


def assert_same(a, b, atol):
    for (la, ga), (lb, gb) in zip(a, b, strict=True):
        assert la == pytest.approx(lb, abs=atol)
        assert ga.keys() == gb.keys() and ga
        for n in ga:
            assert torch.allclose(ga[n], gb[n], rtol=0, atol=atol), n


@pytest.mark.parametrize("ckpt,lora", [(False, False), (True, True)])
def test_compiled_layers_give_the_eager_loss_and_gradients(ckpt, lora):
    assert_same(steps("aot_eager", ckpt, lora), steps(None, ckpt, lora), atol=1e-6)


def test_no_grad_forwards_stay_eager():
    """Decoding and scoring forwards (no grad) never reach the compiler; training forwards do."""
    graphs = []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    lm = load_policy(ModelConfig(name="preset:tiny", seed=3), PeftConfig(), CPU)
    compile_blocks(lm.model, backend=counting)
    ids = torch.randint(3, 400, (1, 9))
    with torch.no_grad():
        lm.model(input_ids=ids)
        lm.model.generate(input_ids=ids, max_new_tokens=3, do_sample=False)
    assert graphs == []
    lm.model(input_ids=ids).logits.sum().backward()
    assert graphs


def test_train_compile_compiles_the_policy(tmp_path, monkeypatch):
    from conftest import tiny_config

    from trainfit.train import stage as compile_mod   # where the stage's loading binds compile_blocks
    from trainfit.train.run import build_stage

    seen = []
    monkeypatch.setattr(compile_mod, "compile_blocks", lambda model: seen.append(model))
    loaded, _, _ = build_stage(tiny_config(tmp_path, "sft", **{"train.compile": True}), tmp_path / "stage")
    assert seen == [loaded.model]
    seen.clear()
    build_stage(tiny_config(tmp_path, "sft"), tmp_path / "stage2")
    assert seen == []  # off by default


@pytest.mark.slow
def test_inductor_layers_give_the_eager_loss_and_gradients():
    assert_same(steps("inductor"), steps(None), atol=1e-5)
