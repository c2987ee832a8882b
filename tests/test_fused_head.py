"""train.fused_head: the LM head fused with the log-probs changes no math and keeps no [n, V] logits.

- `algos.linear_token_logprobs` equals the plain head (`linear` then `token_logprobs_rows`) in fp64:
  log-probs, entropy, and the gradients of the hidden rows, the head weight and a bias, for several
  chunk sizes and temperatures, and with a tied (shared) weight.
- An SFT step and a GRPO step on preset:tiny with `train.fused_head=chunked` give the loss, gradients
  (head weight included under full fine-tuning) and logged entropy of `off`, in fp64 (1e-10): in fp32
  the chunked sums round differently, a few of ~156k gradient elements differing by 2-3e-6 (2e-7 of
  the largest gradient), which says nothing about the math.
- Settings the fused head cannot serve are refused with the key and the fix (exit 2 from the CLI).
- The planner counts the fused head's shapes: its figure matches a real fused step and is far under
  the plain head's.
- On CUDA with liger-kernel: Liger's kernel gives the chunked path's log-probs and gradients (gpu).
"""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("TRAINFIT_CACHE", tempfile.mkdtemp(prefix="trainfit-fused-test-"))

import pytest
import torch
from typer.testing import CliRunner

from conftest import tiny_config
from head_helpers import real_grpo_head_peak
from trainfit import algos
from trainfit.app.cli import app
from trainfit.config import ConfigError, ModelConfig, PeftConfig, to_yaml
from trainfit.models.policy import load_policy, trainable_parameters
from trainfit.plan.head import HeadSpec, head_memory, liger_chunk_rows
from trainfit.models import fused_head
from trainfit.models.logprobs import single_turn_sample
from trainfit.train.run import build_stage

CPU = torch.device("cpu")


@pytest.mark.parametrize("chunk,temperature", [(0, 1.0), (1, 0.7), (7, 0.7), (64, 1.0)])
def test_linear_token_logprobs_equals_the_plain_head_fp64(chunk, temperature):
    torch.manual_seed(chunk)
    n, d, v = 37, 16, 50
    h = torch.randn(n, d, dtype=torch.float64, requires_grad=True)
    w = torch.randn(v, d, dtype=torch.float64, requires_grad=True)
    b = torch.randn(v, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, v, (n,))
    g = torch.randn(n, dtype=torch.float64)      # an upstream gradient that differs per row
    for bias in (None, b):
        params = [h, w] + ([b] if bias is not None else [])
        logp, ent = algos.linear_token_logprobs(h, w, t, temperature, chunk, True, bias)
        got = torch.autograd.grad((logp * g).sum(), params)
        want_logp, want_ent = algos.token_logprobs_rows(torch.nn.functional.linear(h, w, bias), t, temperature,
                                                        chunk, True)
        want = torch.autograd.grad((want_logp * g).sum(), params)
        torch.testing.assert_close(logp, want_logp, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(ent, want_ent, rtol=1e-12, atol=1e-12)
        assert not ent.requires_grad
        for a, c in zip(got, want):
            assert c.norm() > 0
            torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)
    assert algos.linear_token_logprobs(h, w, t, temperature, chunk)[1] is None


def test_tied_weight_and_frozen_head_and_empty_rows():
    # Tied embeddings: the head weight is also the input embedding; both gradients add up.
    torch.manual_seed(1)
    emb = torch.randn(20, 8, dtype=torch.float64, requires_grad=True)
    ids, t = torch.randint(0, 20, (9,)), torch.randint(0, 20, (9,))
    mix = torch.randn(8, 8, dtype=torch.float64)
    grads = []
    for fused in (True, False):
        h = torch.tanh(emb[ids] @ mix)                                                 # [9, 8]
        logp = (algos.linear_token_logprobs(h, emb, t, 0.9, 4)[0] if fused
                else algos.token_logprobs_rows(h @ emb.T, t, 0.9, 4)[0])
        grads.append(torch.autograd.grad(logp.sum(), emb)[0])
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-12)
    # A frozen head (LoRA): no weight gradient is made, the hidden rows still get theirs.
    h = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(20, 8, dtype=torch.float64)
    algos.linear_token_logprobs(h, w, t[:5], 1.0, 2)[0].sum().backward()
    assert h.grad is not None and w.grad is None
    # No scored row: empty log-probs, and backward still runs.
    logp, ent = algos.linear_token_logprobs(h[:0], w, t[:0], 1.0, 0, True)
    assert logp.shape == (0,) and ent.shape == (0,)
    logp.sum().backward()
    with pytest.raises(ValueError, match=r"\[N, d\]"):
        algos.linear_token_logprobs(h, w[:, :3], t[:5])


def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in trainable_parameters(model)])


def _loss_and_grads(stage, model, micro, totals, head: str):
    stage.head = head
    model.zero_grad(set_to_none=True)
    loss, m = stage.loss(model, micro, totals)
    loss.backward()
    return loss.detach(), _grads(model), m


@pytest.mark.parametrize("peft,chunk", [("none", 0), ("lora", 5)])
def test_sft_step_fused_equals_plain(tmp_path, peft, chunk):
    cfg = tiny_config(tmp_path, "sft", **{"task.num_eval": 0, "peft.method": peft, "train.logits_chunk_rows": chunk,
                                          "train.fused_head": "chunked"})
    loaded, stage, _ = build_stage(cfg, tmp_path / "stage")
    assert stage.head == "chunked"
    loaded.model.double()
    g = torch.Generator().manual_seed(3)
    ids = lambda n: torch.randint(3, 500, (n,), generator=g).tolist()  # noqa: E731
    micro = [{"input_ids": (x := ids(11)), "labels": [-100] * 6 + x[6:]},
             {"input_ids": (y := ids(7)), "labels": list(y)},
             {"input_ids": (z := ids(14)), "labels": [-100] * 4 + z[4:9] + [-100] * 5}]
    got_loss, got_g, got_m = _loss_and_grads(stage, loaded.model, micro, {"tokens": 16}, "chunked")
    want_loss, want_g, want_m = _loss_and_grads(stage, loaded.model, micro, {"tokens": 16}, "off")
    assert got_m["tokens"] == want_m["tokens"] == 16 and want_g.norm() > 0 and want_g.dtype == torch.float64
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got_g, want_g, rtol=1e-10, atol=1e-12)
    if peft == "none":  # full fine-tuning trains the head: its gradient came through the fused backward
        head_w = loaded.model.get_output_embeddings().weight
        assert head_w.requires_grad and head_w.grad is not None and head_w.grad.norm() > 0


def test_grpo_step_fused_equals_plain(tmp_path):
    cfg = tiny_config(tmp_path, "grpo", **{"task.num_eval": 0, "rollout.temperature": 0.7, "grpo.beta": 0.1,
                                           "train.logits_chunk_rows": 3, "train.fused_head": "chunked"})
    loaded, stage, _ = build_stage(cfg, tmp_path / "stage")
    assert stage.head == "chunked"
    loaded.model.double()
    g = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(3, 500, (n,), generator=g).tolist()  # noqa: E731
    micro = [single_turn_sample(ids(5), ids(7)), single_turn_sample(ids(9), ids(2))]
    mask = [0] * 4 + [1] * 3 + [0] * 2 + [1] * 4                    # multi-turn: a gap in the mask
    micro.append({"input_ids": ids(len(mask)), "loss_mask": mask})
    for s, a in zip(micro, [1.5, -0.5, -1.0]):
        s["advantage"] = a
        s["ref_logp"] = -torch.rand(sum(s["loss_mask"]), generator=g, dtype=torch.float64) * 3
    totals = {"total_seqs": 4, "total_tokens": 20.0, "max_len": 12}
    got_loss, got_g, got_m = _loss_and_grads(stage, loaded.model, micro, totals, "chunked")
    want_loss, want_g, want_m = _loss_and_grads(stage, loaded.model, micro, totals, "off")
    assert want_g.norm() > 0 and want_g.dtype == torch.float64
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got_g, want_g, rtol=1e-10, atol=1e-12)
    for k in ("entropy_sum", "kl_sum", "ratio_sum"):
        assert got_m[k] == pytest.approx(want_m[k], rel=1e-10, abs=1e-12), k


def test_refused_settings(tmp_path):
    # Config rules: a sharded head weight, and stages without a fused path.
    for over, words in [({"distributed.strategy": "fsdp", "distributed.num_gpus": 2}, "sharded"),
                        ({"distributed.zero_stage": 3, "distributed.num_gpus": 2}, "sharded"),
                        ({"stage": "ppo"}, "not ppo")]:
        with pytest.raises(ConfigError, match=r"train\.fused_head=chunked") as e:
            tiny_config(tmp_path, **{"train.global_batch_size": 8, "train.fused_head": "chunked", **over})
        assert words in str(e.value) and "train.fused_head=off" in str(e.value)
    # auto is the plain head on CPU, and the plain head where a fused one cannot serve.
    cfg = tiny_config(tmp_path, "sft", **{"task.num_eval": 0})
    assert cfg.train.fused_head == "auto"
    tiny = load_policy(ModelConfig(name="preset:tiny"), PeftConfig(), CPU, seed=0).model
    assert fused_head.resolve(cfg, tiny, CPU) == "off"
    # liger without CUDA: a ConfigError naming the fix.
    with pytest.raises(ConfigError, match="needs a CUDA device.*chunked"):
        fused_head.resolve(cfg.model_copy(update={"train": cfg.train.model_copy(update={"fused_head": "liger"})}),
                           tiny, CPU)
    chunked = cfg.model_copy(update={"train": cfg.train.model_copy(update={"fused_head": "chunked"})})
    # A LoRA-adapted LM head computes more than hidden @ W.T.
    lora_head = load_policy(ModelConfig(name="preset:tiny"),
                            PeftConfig(method="lora", r=4, target_modules=["q_proj", "lm_head"]), CPU, seed=0).model
    with pytest.raises(ConfigError, match="not a plain torch.nn.Linear"):
        fused_head.resolve(chunked, lora_head, CPU)
    # A model that softcaps its logits after the head (Gemma 2).
    from transformers import Gemma2Config, Gemma2ForCausalLM

    gemma = Gemma2ForCausalLM(Gemma2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=8))
    with pytest.raises(ConfigError, match="final_logit_softcapping"):
        fused_head.resolve(chunked, gemma, CPU)
    assert fused_head.resolve(cfg, gemma, CPU) == "off"


def test_liger_on_cpu_exits_2_from_the_cli(tmp_path):
    cfg = tiny_config(tmp_path, "sft", **{"task.num_eval": 0, "train.max_steps": 1, "train.fused_head": "liger"})
    path = tmp_path / "cfg.yaml"
    path.write_text(to_yaml(cfg))
    r = CliRunner().invoke(app, ["train", str(path)])
    assert r.exit_code == 2, r.output
    assert "train.fused_head=liger" in " ".join(r.output.split()) and "Traceback" not in r.output


def test_the_run_says_which_head_it_uses(tmp_path):
    """A fused head is named at stage start (a silent `auto` says nothing: the plain head, as before)."""
    outputs = {}
    for mode in ("chunked", "auto"):
        cfg = tiny_config(tmp_path / mode, "sft", **{"task.num_eval": 0, "train.max_steps": 1, "train.fused_head": mode})
        path = tmp_path / f"{mode}.yaml"
        path.write_text(to_yaml(cfg))
        r = CliRunner().invoke(app, ["train", str(path)])
        assert r.exit_code == 0, r.output
        outputs[mode] = " ".join(r.output.split())
    assert "LM head: fused, chunked (train.fused_head=chunked)" in outputs["chunked"]
    assert "LM head:" not in outputs["auto"]   # on CPU auto is the plain head


def test_planner_counts_the_fused_head():
    b, t, new, d, v, chunk = 3, 400, 40, 32, 4000, 8
    plain = HeadSpec("grpo", v, d, "fp32", b, t, new_tokens=new, chunk_rows=chunk, policy_rows=True)
    fused = HeadSpec("grpo", v, d, "fp32", b, t, new_tokens=new, chunk_rows=chunk, policy_rows=True, fused="chunked")
    real = real_grpo_head_peak(b, t, new, d, v, chunk, fused=True)
    assert head_memory(fused)["peak"] == pytest.approx(real, rel=0.1)
    n_v = b * new * v * 4                                   # one [n, V] fp32 tensor
    assert head_memory(fused)["peak"] < 0.5 * n_v < n_v < head_memory(plain)["peak"]
    assert head_memory(plain)["peak"] == pytest.approx(real_grpo_head_peak(b, t, new, d, v, chunk, False), rel=0.1)
    # SFT (every position labelled, the bound): fused is far under the [b, T, V] plan.
    sft = lambda f: head_memory(HeadSpec("sft", v, d, "bf16", 2, 300, chunk_rows=32, fused=f))["peak"]  # noqa: E731
    assert sft("chunked") < 0.2 * sft("off")
    assert liger_chunk_rows(4096, 896, 151936) == 32 and liger_chunk_rows(10, 4096, 1000) == 10


@pytest.mark.gpu
def test_liger_kernel_equals_the_chunked_head():
    if not torch.cuda.is_available() or not fused_head.liger_available():
        pytest.skip("needs CUDA and liger-kernel")
    torch.manual_seed(0)
    n, d, v = 300, 64, 1000
    h = torch.randn(n, d, device="cuda", requires_grad=True)
    w = (torch.randn(v, d, device="cuda") * 0.1).requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda")
    g = torch.randn(n, device="cuda")
    for temp in (1.0, 0.7):
        got = fused_head.liger_logprobs(h, w, None, t, temp)
        got_g = torch.autograd.grad((got * g).sum(), [h, w])
        want = algos.linear_token_logprobs(h, w, t, temp, 64)[0]
        want_g = torch.autograd.grad((want * g).sum(), [h, w])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        for a, c in zip(got_g, want_g):
            torch.testing.assert_close(a, c, rtol=1e-3, atol=1e-4)


def test_vision_language_policy_fused_equals_plain(tmp_path):
    # A VLM batch (image inputs through `inputs=`): the identity head sits on the language model's
    # output embedding; log-probs and gradients are the plain head's.
    from trainfit.config import load_config
    from trainfit.models.logprobs import sequence_logprobs
    from trainfit.data.image_examples import encode_image_prompt, image_inputs

    base = {"stage": "grpo", "run_dir": str(tmp_path / "run"), "model": {"name": "preset:vlm-tiny"},
            "task": {"name": "shapes", "chat": True, "num_eval": 0}, "grpo": {"num_generations": 2},
            "rollout": {"max_new_tokens": 4},
            "train": {"global_batch_size": 2, "micro_batch_size": 2, "max_steps": 1, "device": "cpu",
                      "fused_head": "chunked", "logits_chunk_rows": 3},
            "logging": {"tensorboard": False, "progress": False, "plot": False}}
    loaded, stage, _ = build_stage(load_config(None, [], base=base), tmp_path / "stage")
    assert stage.head == "chunked"
    loaded.model.double()
    exs = [stage.task.train_example(i) for i in range(2)]
    g = torch.Generator().manual_seed(2)
    samples = [dict(single_turn_sample(encode_image_prompt(loaded.tokenizer, stage.vision, ex, True),
                                       torch.randint(3, 400, (5,), generator=g).tolist()), images=ex.images)
               for ex in exs]
    out = {}
    for head in ("chunked", "off"):
        loaded.model.zero_grad(set_to_none=True)
        logp, mask, ent = sequence_logprobs(loaded.model, samples, loaded.tokenizer.pad_token_id, CPU, 0.8, 3,
                                            True, image_inputs(samples, stage.vision, CPU), head)
        logp.sum().backward()
        out[head] = (logp.detach(), ent, _grads(loaded.model))
    for a, c in zip(out["chunked"], out["off"]):
        torch.testing.assert_close(a, c, rtol=1e-10, atol=1e-12)
    assert out["off"][2].norm() > 0 and out["off"][2].dtype == torch.float64


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["sft", "grpo"])
def test_two_ddp_ranks_fused_equal_one_rank_plain(tmp_path, stage):
    # Under DDP the head weight's gradient (full fine-tuning, tied to the embedding) is made after the
    # forward, by the fused backward: DDP still all-reduces it, so 2 ranks fused = 1 rank plain.
    from test_distributed import final_params, losses, stage_cfg, train, write

    config = write(stage_cfg(tmp_path, stage, "x"), tmp_path / "c.yaml")
    one = train(config, f"run_dir={tmp_path / 'one'}", "train.fused_head=off")
    assert one.returncode == 0, one.stderr[-3000:]
    two = train(config, f"run_dir={tmp_path / 'two'}", "distributed.num_gpus=2", "distributed.strategy=ddp",
                "train.fused_head=chunked", "train.logits_chunk_rows=3")
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = final_params(tmp_path / "one"), final_params(tmp_path / "two")
    assert (a - b).norm() / a.norm() < 1e-5
    for step, loss in losses(tmp_path / "one").items():
        assert losses(tmp_path / "two")[step] == pytest.approx(loss, rel=1e-5, abs=1e-7)


def test_plan_suggests_the_fused_head_only_where_train_accepts_it():
    """`trainfit plan` suggestions list `train.fused_head=chunked` for a model whose head it can
    stand in for, not for Gemma-2 (logit softcapping after the head) nor under FSDP."""
    from trainfit.config import load_config
    from trainfit.plan.suggest import _candidates

    def overrides(**kw):
        base = {"stage": "grpo", "model": {"name": "preset:tiny"}, "task": {"name": "arithmetic"},
                "train": {"device": "cpu"}}
        cfg = load_config(None, [f"{k}={v}" for k, v in kw.items()], base=base)
        return [o for _, ovs in _candidates(cfg) for o in ovs]

    assert "train.fused_head=chunked" in overrides()
    assert "train.fused_head=chunked" not in overrides(**{"model.name": "google/gemma-2-2b"})
    assert "train.fused_head=chunked" not in overrides(**{"distributed.strategy": "fsdp", "distributed.num_gpus": 2})
    assert "train.fused_head=chunked" not in overrides(**{"train.fused_head": "chunked"})
    assert "train.fused_head=chunked" not in overrides(**{"train.fused_head": "off"})   # the user's choice


@pytest.mark.parametrize("spec", [
    HeadSpec("sft", 4000, 64, "bf16", 6, 600, fused="chunked", chunk_rows=64),
    HeadSpec("grpo", 4000, 64, "bf16", 6, 600, new_tokens=300, fused="chunked", chunk_rows=32, policy_rows=True,
             beta=0.1, temperature=0.7),
    HeadSpec("sft", 4000, 64, "fp32", 5, 400, fused="chunked", chunk_rows=16, head_trainable=True),
])
def test_many_chunk_fused_head_is_planned_from_two_small_batches_exactly(spec):
    """A chunked fused head of many chunks is traced at 2 and 3 sequences and extended linearly (its
    per-row buffers grow with the batch, a chunk's temporaries do not): the figures equal the full
    trace's, so large SFT micro-batches (thousands of chunks) plan in a second."""
    from trainfit.plan.head import _many_fused_chunks, _run, _run_fused_by_rows

    assert _many_fused_chunks(spec)
    assert _run_fused_by_rows(spec) == _run(spec)
