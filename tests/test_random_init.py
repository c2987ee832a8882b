"""Pretraining from scratch at any architecture: `model.init: random` builds a catalog (or local)
architecture with random weights, `model.config_overrides` changes its numbers, and the planner plans
the same overridden architecture (one function applies the overrides for both)."""

from __future__ import annotations

import json

import pytest
import torch
from rich.console import Console

from trainfit.config import ConfigError, validate
from trainfit.models.policy import count_parameters, load_policy
from trainfit.models.shapes import arch_facts, model_source

CPU = torch.device("cpu")
SMALL_QWEN3 = {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}


def cfg_of(model: dict, **sections):
    return validate({"stage": "pretrain", "data": {"path": "x.txt"}, "train": {"device": "cpu"},
                     "model": model, **sections})


def test_random_init_builds_the_overridden_catalog_architecture_and_the_planner_counts_it():
    cfg = cfg_of({"name": "qwen3-0.6b", "init": "random", "tokenizer": "preset", "config_overrides": SMALL_QWEN3})
    # qwen3-0.6b at hidden H=64, 4 heads x head_dim 16 (=64), 2 KV heads (=32), MLP I=128, vocab V=512,
    # tied embeddings (as qwen3-0.6b), no attention bias:
    #   embedding V*H                     = 512*64                      = 32,768
    #   per layer: q 64*64 + k 64*32 + v 64*32 + o 64*64               = 12,288
    #              q_norm, k_norm 16 + 16                               =     32
    #              gate, up, down 3*64*128                              = 24,576
    #              input / post-attention RMSNorm 64 + 64               =    128   -> 37,024 a layer
    #   2 layers = 74,048; final norm 64                     total = 32,768 + 74,048 + 64 = 106,880
    expected = 106_880
    model = load_policy(cfg.model, cfg.peft, CPU).model
    assert count_parameters(model) == (expected, expected)
    assert len(model.model.layers) == 2 and model.config.hidden_size == 64
    assert arch_facts(model_source(cfg.model)).n_params == expected
    # The catalog architecture itself is untouched (qwen3-0.6b: 28 layers, hidden 1024).
    assert arch_facts("qwen3-0.6b").n_layers == 28 and arch_facts("qwen3-0.6b").hidden == 1024


def test_random_init_is_seeded_and_random():
    m = {"name": "qwen3-0.6b", "init": "random", "tokenizer": "preset", "config_overrides": SMALL_QWEN3}
    a = load_policy(cfg_of(m).model, cfg_of(m).peft, CPU).model
    b = load_policy(cfg_of({**m, "seed": 1}).model, cfg_of(m).peft, CPU).model
    wa, wb = a.model.layers[0].mlp.up_proj.weight, b.model.layers[0].mlp.up_proj.weight
    assert wa.std() > 0 and not torch.equal(wa, wb)


def test_mamba_overrides_take_mamba_ssm_names_and_plan_the_built_model():
    """The guides' Mamba presets name d_state / n_layer (mamba_ssm); transformers' MambaConfig calls
    them state_size / num_hidden_layers. Planner and trainer both build the overridden model."""
    ov = {"n_layer": 2, "hidden_size": 64, "d_state": 8, "expand": 2, "vocab_size": 512}
    cfg = cfg_of({"name": "mamba-2.8b", "init": "random", "tokenizer": "preset", "config_overrides": ov})
    src = model_source(cfg.model)
    assert src.config["state_size"] == 8 and src.config["num_hidden_layers"] == 2
    model = load_policy(cfg.model, cfg.peft, CPU).model
    assert model.config.state_size == 8 and len(model.backbone.layers) == 2
    assert count_parameters(model)[0] == arch_facts(src).n_params


def test_unknown_override_key_names_it_and_its_close_matches():
    cfg = cfg_of({"name": "qwen3-0.6b", "init": "random", "config_overrides": {"num_layers": 2}})
    with pytest.raises(ConfigError, match=r"'num_layers'.*close matches: num_hidden_layers"):
        model_source(cfg.model)


def test_cross_field_rules():
    with pytest.raises(ConfigError, match="model.init=random with peft.method=lora"):
        cfg_of({"name": "qwen3-0.6b", "init": "random"}, peft={"method": "lora"})
    with pytest.raises(ConfigError, match="set model.init=random"):
        cfg_of({"name": "qwen3-0.6b", "config_overrides": {"num_hidden_layers": 2}})
    cfg_of({"name": "preset:tiny", "config_overrides": {"num_hidden_layers": 1}})  # presets are random already


def test_local_architecture_dir_with_overrides_and_no_tokenizer(tmp_path):
    """A local directory with only config.json: built at random with the same overrides (the planner
    reads the dict, the trainer transformers' config object); with no tokenizer anywhere the error
    names model.tokenizer."""
    from trainfit.models.shapes import hf_config, locate

    hf_config(locate("qwen3-0.6b")).save_pretrained(tmp_path / "arch")   # config.json only
    m = {"name": str(tmp_path / "arch"), "init": "random", "config_overrides": SMALL_QWEN3}
    with pytest.raises(ConfigError, match="model.tokenizer"):
        load_policy(cfg_of(m).model, cfg_of(m).peft, CPU)
    cfg = cfg_of({**m, "tokenizer": "preset"})
    model = load_policy(cfg.model, cfg.peft, CPU).model
    assert count_parameters(model)[0] == arch_facts(model_source(cfg.model)).n_params == 106_880


def test_three_step_pretrain_from_scratch_on_cpu(tmp_path):
    from trainfit.train.run import run_pipeline

    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": f"{i} plus {i} is {2 * i}. " * 8}) + "\n" for i in range(64)))
    cfg = validate({"stage": "pretrain", "run_dir": str(tmp_path / "run"),
                    "model": {"name": "qwen3-0.6b", "init": "random", "tokenizer": "preset",
                              "config_overrides": SMALL_QWEN3},
                    "data": {"path": str(data), "max_seq_length": 64, "eval_fraction": 0.0},
                    "train": {"global_batch_size": 4, "micro_batch_size": 2, "max_steps": 3, "lr": 1e-3,
                              "device": "cpu"},
                    "logging": {"report_to": [], "progress": False, "plot": False}})
    (result,) = run_pipeline(cfg, console=Console(file=open("/dev/null", "w")))
    saved = json.loads((result.final_dir / "config.json").read_text())
    assert saved["num_hidden_layers"] == 2 and saved["hidden_size"] == 64
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert len(losses) == 3 and all(x == x for x in losses)
