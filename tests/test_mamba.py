"""Mamba end to end: `preset:mamba-tiny` trains (SFT, pretraining, GRPO through `generate`) on CPU,
the planner's train phase matches a real CPU step, its rollout phase holds Mamba's fixed recurrent
state (what `generate` allocates), and the Falcon-Mamba-7B catalog entry counts as published."""

from __future__ import annotations

import json
import os
import random
import tempfile
from pathlib import Path
from unittest import mock

os.environ.setdefault("TRAINFIT_CACHE", tempfile.mkdtemp(prefix="trainfit-mamba-test-"))

import pytest
import torch
from rich.console import Console

from conftest import tiny_config
from trainfit.config import load_config
from trainfit.plan import plan

QUIET = Console(file=open("/dev/null", "w"))
REWARD = str(Path(__file__).parent / "data" / "rewards_for_tests.py") + ":length_reward"
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MAMBA = {"model.name": "preset:mamba-tiny"}


def _train(cfg, stage_dir: Path):
    from trainfit.models.save import save_pretrained
    from trainfit.train import memstats
    from trainfit.train.faults import Faults
    from trainfit.train.loop import train_stage
    from trainfit.train.report import read_metrics
    from trainfit.train.run import build_stage

    loaded, stage, _ = build_stage(cfg, stage_dir)
    before = {n: p.detach().clone() for n, p in loaded.model.named_parameters()}
    # The run's planned-vs-used memory table is not what these tests check (a plan never stops training),
    # and planning it traced each run's Mamba spec cold: ~10 s of the reference scan's per-token loop under
    # fake tensors, most of each test. The stage runs as on a rank that does not report; the Mamba plan
    # itself is checked against real tensors in test_plan_matches_a_real_cpu_step and
    # test_rollout_plans_the_recurrent_state_generate_allocates.
    with mock.patch.object(memstats, "plan_stage", lambda cfg: ({}, None)):
        train_stage(cfg, loaded, stage, stage_dir, resume=False, console=QUIET, faults=Faults(),
                    save_final=lambda p: save_pretrained(loaded, p, base_dir=stage_dir / "base"))
    changed = {n for n, p in loaded.model.named_parameters() if not torch.equal(before[n], p.detach())}
    return loaded, stage, changed, [m for m in read_metrics(stage_dir / "metrics.jsonl") if m["kind"] == "train"]


def test_preset_is_transformers_mamba_with_the_local_tokenizer():
    from trainfit.models.policy import load_policy

    cfg = tiny_config(Path(tempfile.mkdtemp()), **MAMBA)
    loaded = load_policy(cfg.model, cfg.peft, torch.device("cpu"))
    model = loaded.model
    assert type(model).__name__ == "MambaForCausalLM" and model.config.vocab_size == len(loaded.tokenizer)
    c = model.config
    d, n, k, r, h = c.intermediate_size, c.state_size, c.conv_kernel, c.time_step_rank, c.hidden_size
    assert d == c.expand * h
    # in_proj, conv1d (+bias), x_proj, dt_proj (+bias), A_log, D, out_proj, norm; tied embedding; final norm
    layer = h * 2 * d + d * k + d + d * (r + 2 * n) + r * d + d + d * n + d + d * h + h
    assert sum(p.numel() for p in model.parameters()) == c.num_hidden_layers * layer + c.vocab_size * h + h


def test_sft_loss_falls_over_30_cpu_steps(tmp_path):
    cfg = tiny_config(tmp_path, "sft", **MAMBA, **{"task.max_operand": 99, "train.max_steps": 30,
                                                  "train.global_batch_size": 16, "train.micro_batch_size": 16,
                                                  "train.lr": 3e-3, "train.warmup_steps": 3})
    _, _, changed, steps = _train(cfg, tmp_path / "sft")
    loss = [m["loss"] for m in steps]
    assert len(loss) == 30 and changed
    assert sum(loss[-3:]) / 3 < 0.6 * sum(loss[:3]) / 3, loss


def test_pretraining_on_a_text_file_lowers_the_loss(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"{a} plus {b} is {a + b}." for a in range(40) for b in range(5)))
    cfg = tiny_config(tmp_path, "pretrain", **MAMBA, **{"data.path": str(corpus), "task.name": "null", "data.max_seq_length": 32,
                                                       "data.eval_fraction": 0.0, "train.max_steps": 15,
                                                       "train.lr": 3e-3, "train.warmup_steps": 2})
    _, _, _, steps = _train(cfg, tmp_path / "pt")
    loss = [m["loss"] for m in steps]
    assert sum(loss[-3:]) / 3 < 0.8 * sum(loss[:3]) / 3, loss


def test_grpo_runs_two_steps_through_generate(tmp_path):
    from trainfit.models import logprobs

    cfg = tiny_config(tmp_path, "grpo", **MAMBA, **{"task.rewards": f"[{REWARD}]", "grpo.beta": 0.1,
                                                   "train.lr": 1e-2, "rollout.max_new_tokens": 6})
    loaded, stage, changed, steps = _train(cfg, tmp_path / "grpo")
    assert [m["step"] for m in steps] == [1, 2]
    assert stage.engine.use_decode_loop is False  # Mamba keeps transformers' generate (its own cache)
    assert any(m["grad_norm"] > 0 for m in steps) and changed
    # Mamba's forward takes logits_to_keep, and honoured it (not demoted to the full-logits fallback).
    assert logprobs._KEEP_OK[type(loaded.model)] is True


def test_policy_logits_with_and_without_logits_to_keep_agree():
    from trainfit.models import logprobs
    from trainfit.models.logprobs import policy_logits

    cfg = tiny_config(Path(tempfile.mkdtemp()), **MAMBA)
    from trainfit.models.policy import load_policy

    model = load_policy(cfg.model, cfg.peft, torch.device("cpu")).model.eval()
    ids = torch.randint(3, 500, (2, 12))
    attn = torch.ones_like(ids)
    attn[1, :3] = 0                                              # a left-padded row
    keep = torch.zeros_like(ids, dtype=torch.bool)
    keep[:, 7:] = True
    sliced = policy_logits(model, ids, attn, keep)
    cls = type(model)
    old = logprobs._KEEP_OK.get(cls)
    logprobs._KEEP_OK[cls] = False                               # the fallback: full logits, rows selected
    try:
        full = policy_logits(model, ids, attn, keep)
    finally:
        logprobs._KEEP_OK[cls] = old
    assert sliced.shape == (int(keep.sum()), model.config.vocab_size)
    torch.testing.assert_close(sliced, full)


def _live_peak_of_a_step(cfg) -> int:
    """Peak live tensor bytes of one real optimizer step (the second), as tests/test_rm.py measures."""
    from trainfit.models.policy import load_policy, trainable_parameters
    from trainfit.plan.tracker import step_peak
    from trainfit.tasks import build_task
    from trainfit.train.loop import accumulate, make_optimizer
    from trainfit.train.sft import LMStage

    torch.manual_seed(0)
    loaded = load_policy(cfg.model, cfg.peft, torch.device("cpu"))
    loaded.model.train()
    stage = LMStage(cfg, loaded.model, loaded.tokenizer, torch.device("cpu"),
                    task=build_task(cfg.task) if cfg.task.name else None)
    params = trainable_parameters(loaded.model)
    opt = make_optimizer(params, cfg.train)

    def one_step(step):
        accumulate(loaded.model, stage.prepare(step), cfg.train.micro_batch_size, stage.loss)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    one_step(0)  # optimizer state exists from here on
    return step_peak(lambda: one_step(1), loaded.model, opt)


@pytest.mark.parametrize("stage, dtype, ckpt", [pytest.param("pretrain", "fp32", False, marks=pytest.mark.slow),
                                               ("sft", "bf16", True)])
def test_plan_matches_a_real_cpu_step(stage, dtype, ckpt, tmp_path):
    """The train phase (weights, grads, AdamW, traced activations of the sequential scan) against the
    peak of live tensor bytes of a real step: pretraining packed 128-token blocks, and SFT (padded,
    checkpointed) on completions longer than data.max_seq_length, so every row has the planned length."""
    words = "one two three four five six seven eight nine ten".split()
    text = [" ".join(random.Random(i).choices(words, k=60)) for i in range(100)]
    over = {"stage": stage, "run_dir": str(tmp_path / "run"), **MAMBA, "model.dtype": dtype,
            "model.gradient_checkpointing": str(ckpt).lower(), "train.device": "cpu",
            "train.global_batch_size": 8, "train.micro_batch_size": 4, "data.eval_fraction": 0.0}
    data = tmp_path / ("corpus.txt" if stage == "pretrain" else "pairs.jsonl")
    if stage == "pretrain":
        data.write_text("\n".join(text))
        over.update({"data.path": str(data), "data.max_seq_length": 128})
    else:
        data.write_text("".join(json.dumps({"prompt": "Count:", "completion": t}) + "\n" for t in text))
        over.update({"data.path": str(data), "data.max_seq_length": 64})
    cfg = load_config(None, [f"{k}={v}" for k, v in over.items()])
    measured = _live_peak_of_a_step(cfg)
    planned = plan(cfg, gpu="h100", suggest=False).phases["train"].allocated
    assert planned / measured - 1 == pytest.approx(0.0, abs=0.05)


def _generate_cache_bytes(cfg, rows: int) -> int:
    """Bytes of the cache tensors transformers allocates while `generate` decodes `rows` prompts."""
    from trainfit.models.policy import load_policy

    loaded = load_policy(cfg.model, cfg.peft, torch.device("cpu"))
    tok = loaded.tokenizer
    enc = tok([f"{i}+{i}=" for i in range(rows)], return_tensors="pt", padding=True, padding_side="left")
    out = loaded.model.eval().generate(**enc, max_new_tokens=4, do_sample=False, return_dict_in_generate=True,
                                       pad_token_id=tok.pad_token_id)
    cache = out.past_key_values
    states = [t for layer in cache.layers for d in (layer.conv_states, layer.recurrent_states)
              for t in d.values() if t is not None]
    assert len(states) == 2 * loaded.model.config.num_hidden_layers   # conv + ssm state per layer
    return sum(t.numel() * t.element_size() for t in states)


def test_rollout_plans_the_recurrent_state_generate_allocates(tmp_path):
    from trainfit.plan.rollout import uses_decode_loop
    from trainfit.models.shapes import arch_facts

    cfg = tiny_config(tmp_path, "grpo", **MAMBA, **{"model.dtype": "bf16"})
    p = plan(cfg, gpu="h100", suggest=False)
    state = [i for i in p.items if i.name.startswith("recurrent state")]
    assert len(state) == 1 and not any(i.name.startswith("KV cache") for i in p.items)
    rows = cfg.batch_plan().per_device_batch
    assert f"{rows} sequences" in state[0].name
    # conv state in bf16, ssm state in fp32: exactly what the cache object holds after generate
    assert state[0].rollout == _generate_cache_bytes(cfg, rows)
    # a fixed state: longer generations do not grow it
    longer = plan(tiny_config(tmp_path, "grpo", **MAMBA, **{"model.dtype": "bf16", "rollout.max_new_tokens": 64}),
                  gpu="h100", suggest=False)
    assert next(i.rollout for i in longer.items if i.name.startswith("recurrent state")) == state[0].rollout
    assert not uses_decode_loop(cfg.rollout, arch_facts("preset:mamba-tiny"))


def test_falcon_mamba_7b_counts_as_published():
    from trainfit.models.shapes import arch_facts
    from trainfit.models.catalog import catalog_entries

    entry = catalog_entries()["falcon-mamba-7b"]
    c = entry["config"]
    h, d, n, k, r = c["hidden_size"], c["intermediate_size"], c["state_size"], c["conv_kernel"], c["time_step_rank"]
    assert (h, d, n, k, r, c["num_hidden_layers"], c["vocab_size"]) == (4096, 8192, 16, 4, 256, 64, 65024)
    layer = h * 2 * d + d * k + d + d * (r + 2 * n) + r * d + d + d * n + d + d * h + h
    by_hand = c["num_hidden_layers"] * layer + 2 * c["vocab_size"] * h + h   # untied embedding and head
    facts = arch_facts("tiiuae/falcon-mamba-7b-instruct")   # the -instruct variant shares the architecture
    assert facts.n_params == by_hand == entry["published_params"]
    assert round(facts.n_params / 1e9, 2) == 7.27       # "7.27B params" on the model card
    assert facts.ssm_state_per_seq == 64 * d * (k + n) and facts.ssm_fp32_per_seq == 64 * d * n


# The 7B example's plans read the run's starting planner cache (user_plan_cache, offline), as the other
# tests of shipped 7B/8B examples do (test_fit_trainable fits this example too): entries are keyed by
# their content, and a cold trace of Falcon-Mamba-7B's scan is ~30 s a spec.
def test_mamba_7b_sft_example_fits_one_a800_only_checkpointed(user_plan_cache):
    cfg = load_config(EXAMPLES / "mamba_7b_sft_a800.yaml")
    p = plan(cfg, suggest=False)
    assert p.gpu.startswith("A800") and p.fits and p.trainable_params > 7e9  # a full fine-tune
    # The sequential scan keeps [d_inner, state] fp32 per token and layer: all 64 layers at once do not fit.
    whole = plan(load_config(EXAMPLES / "mamba_7b_sft_a800.yaml", ["model.gradient_checkpointing=false"]),
                 suggest=False)
    assert not whole.fits and whole.phases["train"].total > 2 * p.phases["train"].total


def test_lora_on_mamba_adapts_every_linear_peft_accepts(tmp_path):
    # peft refuses LoRA on Mamba's out_proj (and conv1d): all-linear there means in_proj, x_proj and
    # dt_proj, in the trainer and the planner alike; naming out_proj is a config error.
    import torch

    from trainfit.config import ConfigError, ModelConfig, PeftConfig
    from trainfit.models.policy import load_policy
    from trainfit.models.shapes import arch_facts, locate, match_targets

    loaded = load_policy(ModelConfig(name="preset:mamba-tiny"), PeftConfig(method="lora", r=4), torch.device("cpu"))
    adapted = {n.split(".lora_A")[0].rsplit(".", 1)[-1] for n, _ in loaded.model.named_parameters() if ".lora_A" in n}
    assert adapted == {"in_proj", "x_proj", "dt_proj"}
    loaded.model.get_base_model().save_pretrained(str(tmp_path))
    planned = {g.name.rsplit(".", 1)[-1] for g in match_targets(arch_facts(locate(str(tmp_path))), "all-linear")}
    assert planned == adapted
    with pytest.raises(ConfigError, match="out_proj"):
        load_policy(ModelConfig(name="preset:mamba-tiny"), PeftConfig(method="lora", target_modules=["out_proj"]),
                    torch.device("cpu"))


def test_quantized_mamba_is_refused_and_never_offered(user_plan_cache):
    # bitsandbytes' 4-bit layers break the selective scan (checked on CPU: a shape error in the
    # scan's batched matmul), so train refuses it and neither fit nor the suggestions offer it.
    from pathlib import Path

    from trainfit.config import load_config
    from trainfit.plan import plan
    from trainfit.plan.fit import Allow, fit
    from trainfit.models.runnable import not_trainable

    example = Path(__file__).resolve().parents[1] / "examples" / "mamba_7b_sft_a800.yaml"
    cfg = load_config(example, ["peft.method=lora", "model.quantization=4bit"])
    assert "Mamba-family" in not_trainable(cfg)
    base = load_config(example)
    res = fit(base, gpu="rtx4090", allow=Allow(True, True, True))
    for c in [res.best, res.closest, *res.alternatives]:
        assert c is None or c.cfg.model.quantization == "none"
    assert not any("4-bit" in s.change or "QLoRA" in s.change for s in plan(base, gpu="rtx4090").suggestions)
