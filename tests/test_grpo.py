"""GRPO behaviour: what changes under LoRA vs full training, KL at the first step, reloadable outputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rich.console import Console

from conftest import tiny_config
from trainfit.models.save import save_pretrained
from trainfit.train.faults import Faults
from trainfit.train.loop import train_stage
from trainfit.train.report import read_metrics
from trainfit.train.run import build_stage

QUIET = Console(file=open("/dev/null", "w"))
REWARD = str(Path(__file__).parent / "data" / "rewards_for_tests.py") + ":length_reward"


def train(cfg, stage_dir: Path):
    loaded, stage, _ = build_stage(cfg, stage_dir)
    before = {n: p.detach().clone() for n, p in loaded.model.named_parameters()}
    train_stage(cfg, loaded, stage, stage_dir, resume=False, console=QUIET, faults=Faults(),
                save_final=lambda p: save_pretrained(loaded, p, base_dir=stage_dir / "base"))
    after = {n: p.detach() for n, p in loaded.model.named_parameters()}
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    return loaded, changed, read_metrics(stage_dir / "metrics.jsonl")


def grpo(tmp_path, **kw):
    return tiny_config(tmp_path, "grpo", **{"task.rewards": f"[{REWARD}]", "grpo.beta": 0.1,
                                            "train.max_steps": 3, "train.lr": 1e-2,
                                            "rollout.max_new_tokens": 6, **kw})


def test_lora_grpo_changes_only_adapters_and_starts_at_zero_kl(tmp_path):
    loaded, changed, metrics = train(grpo(tmp_path, **{"peft.method": "lora", "peft.r": 4}), tmp_path / "lora")
    assert changed, "nothing was trained"
    assert all("lora_" in n for n in changed), sorted(n for n in changed if "lora_" not in n)
    assert any("lora_B" in n for n in changed)
    steps = [m for m in metrics if m["kind"] == "train"]
    # Step 1: adapters start at B = 0, so policy == adapter-disabled reference exactly.
    assert steps[0]["kl"] == 0.0
    assert steps[-1]["kl"] > 0.0  # ...and the KL metric does move once adapters are trained


def test_full_grpo_changes_base_weights_and_starts_at_zero_kl(tmp_path):
    loaded, changed, metrics = train(grpo(tmp_path), tmp_path / "full")
    names = {n for n, _ in loaded.model.named_parameters()}
    assert "model.layers.0.self_attn.q_proj.weight" in changed
    assert len(changed) == len(names)  # every weight of the policy receives gradient
    steps = [m for m in metrics if m["kind"] == "train"]
    assert steps[0]["kl"] == 0.0       # the frozen reference copy equals the policy at step 1
    assert steps[-1]["kl"] > 0.0


def test_saved_adapter_and_full_model_load_with_plain_libraries(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for method in ("lora", "none"):
        cfg = grpo(tmp_path, **{"peft.method": method, "train.max_steps": 1})
        d = tmp_path / method
        loaded, _, _ = train(cfg, d)
        final = d / "final"
        ids = torch.tensor([[5, 6, 7, 8]])
        want = loaded.model.eval()(input_ids=ids).logits
        if method == "lora":
            base = AutoModelForCausalLM.from_pretrained(
                __import__("json").loads((final / "adapter_config.json").read_text())["base_model_name_or_path"])
            model = PeftModel.from_pretrained(base, str(final))
        else:
            model = AutoModelForCausalLM.from_pretrained(str(final))
        got = model.eval()(input_ids=ids).logits
        assert torch.allclose(got, want, atol=1e-5), method
        assert AutoTokenizer.from_pretrained(str(final)).eos_token == "<|im_end|>"


def test_num_iterations_reuses_rollout_with_importance_ratios(tmp_path):
    cfg = grpo(tmp_path, **{"grpo.num_iterations": 2, "train.max_steps": 2, "grpo.beta": 0.0,
                            "grpo.epsilon": 0.01})
    _, _, metrics = train(cfg, tmp_path / "iters")
    first, second = [m for m in metrics if m["kind"] == "train"]
    # Same rollout both steps (one generation), so the same rewards are logged twice.
    assert first["reward"] == second["reward"]
    # Step 1 is on-policy: behaviour log-probs equal the current ones, ratio exactly 1, nothing clipped.
    assert first["ratio"] == pytest.approx(1.0, abs=1e-6) and first["clip_frac"] == 0.0
    # Step 2 reuses the samples after an update: ratios move and the tight clip range engages.
    assert abs(second["ratio"] - 1.0) > 1e-4 and second["clip_frac"] > 0.0
