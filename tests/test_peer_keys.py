"""Keys of TRL, verl, OpenRLHF and LLaMA-Factory that mean a trainfit key are answered with that key
(config/peer_keys.py), before the fuzzy "did you mean" that once sent grpo.group_size to grpo.epsilon."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from trainfit.app.cli import app
from trainfit.config import ConfigError, load_config, valid_keys
from trainfit.config.peer_keys import PEER_KEYS, WHAT

BASE = {"stage": "grpo", "model": {"name": "preset:tiny"}, "task": {"name": "arithmetic"}, "train": {"device": "cpu"}}


def error_of(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(None, list(overrides), base=BASE)
    return str(e.value)


def test_every_trainfit_key_of_the_table_exists_in_the_schema():
    keys = set(valid_keys())
    assert {r.trainfit for r in PEER_KEYS} <= keys, {r.trainfit for r in PEER_KEYS} - keys
    assert set(WHAT) <= keys, set(WHAT) - keys
    assert {r.trainfit for r in PEER_KEYS} <= set(WHAT)   # each answer can say what trainfit calls it
    assert {r.peer for r in PEER_KEYS} == {"", "TRL", "verl", "OpenRLHF", "LLaMA-Factory"}


CASES = [
    # (override, the tool and key named, the trainfit key, the fix written with the user's value or how to convert)
    ("grpo.group_size=8", None, "the group size grpo.num_generations", "write grpo.num_generations=8"),
    ("num_generations=8", "TRL's num_generations", "grpo.num_generations", "write grpo.num_generations=8"),
    ("train.per_device_train_batch_size=4", "TRL's and LLaMA-Factory's per_device_train_batch_size",
     "train.micro_batch_size", "write train.micro_batch_size=4"),
    ("gradient_accumulation_steps=4", "TRL's and LLaMA-Factory's gradient_accumulation_steps",
     "train.global_batch_size", "per_device_train_batch_size x gradient_accumulation_steps x GPUs"),
    ("learning_rate=1e-5", "TRL's and OpenRLHF's and LLaMA-Factory's learning_rate", "train.lr", "write train.lr=1e-5"),
    ("max_completion_length=256", "TRL's max_completion_length", "rollout.max_new_tokens",
     "write rollout.max_new_tokens=256"),
    ("beta=0.04", "TRL's and OpenRLHF's beta", "grpo.beta", "write dpo.beta=0.04"),
    ("rollout.n=8", "verl's actor_rollout_ref.rollout.n", "grpo.num_generations", "write grpo.num_generations=8"),
    ("data.ppo_mini_batch_size=16", "verl's actor_rollout_ref.actor.ppo_mini_batch_size", "train.global_batch_size",
     "ppo_mini_batch_size x rollout.n"),
    ("gpu_memory_utilization=0.5", "verl's actor_rollout_ref.rollout.gpu_memory_utilization",
     "rollout.gpu_memory_utilization", "write rollout.gpu_memory_utilization=0.5"),
    ("kl_coef=0.01", "verl's algorithm.kl_ctrl.kl_coef", "ppo.kl_coef", "write ppo.kl_coef=0.01"),
    ("n_samples_per_prompt=8", "OpenRLHF's n_samples_per_prompt", "grpo.num_generations",
     "write grpo.num_generations=8"),
    ("rollout_batch_size=128", "OpenRLHF's rollout_batch_size", "train.global_batch_size",
     "OpenRLHF counts prompts per rollout"),
    ("micro_train_batch_size=2", "OpenRLHF's micro_train_batch_size", "train.micro_batch_size",
     "write train.micro_batch_size=2"),
    ("ppo.init_kl_coef=0.01", "OpenRLHF's init_kl_coef", "ppo.kl_coef", "write ppo.kl_coef=0.01"),
    ("zero_stage=2", "OpenRLHF's zero_stage", "distributed.zero_stage", "write distributed.zero_stage=2"),
    ("data.cutoff_len=1024", "LLaMA-Factory's cutoff_len", "data.max_seq_length", "write data.max_seq_length=1024"),
    ("peft.lora_alpha=32", "LLaMA-Factory's lora_alpha", "peft.alpha", "write peft.alpha=32"),
    ("lora_rank=8", "LLaMA-Factory's lora_rank", "peft.r", "write peft.r=8"),
    ("finetuning_type=full", "LLaMA-Factory's finetuning_type", "peft.method", "full is peft.method=none"),
    ("pref_beta=0.1", "LLaMA-Factory's pref_beta", "dpo.beta", "write dpo.beta=0.1"),
]


@pytest.mark.parametrize("override,peer,key,fix", CASES, ids=[c[0] for c in CASES])
def test_a_peer_key_is_answered_with_the_trainfit_key(override, peer, key, fix):
    msg = error_of(override)
    assert msg.startswith(f"Unknown config key {override.split('=')[0]!r}"), msg
    for words in filter(None, (peer, "trainfit calls", key, fix)):
        assert words in msg, f"{words!r} missing from: {msg}"
    assert "did you mean" not in msg


def test_the_group_size_reads_as_the_issue_asks():
    assert error_of("grpo.group_size=8") == ("Unknown config key 'grpo.group_size': trainfit calls the group size "
                                              "grpo.num_generations: write grpo.num_generations=8.")


def test_a_pasted_verl_section_is_answered_key_by_key():
    msg = error_of("actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.optim.lr=1e-6")
    assert msg.startswith("Unknown config key 'actor_rollout_ref' holds keys of another tool:")
    assert "write grpo.num_generations=8" in msg and "write train.lr=1e-6" in msg


def test_a_key_no_peer_writes_keeps_the_nearest_spelling():
    assert "did you mean 'train.lr'?" in error_of("train.lrr=1e-4")
    # verl's one-letter `n` is only its own with its parent: grpo.n is a misspelling, not rollout.n
    assert "did you mean" in error_of("grpo.n=4")


def test_the_cli_exits_2_with_the_peer_answer(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("stage: grpo\nmodel: {name: 'preset:tiny'}\ntask: {name: arithmetic}\n"
                   "actor_rollout_ref:\n  rollout:\n    n: 8\n")
    r = CliRunner().invoke(app, ["config", str(cfg)])
    assert r.exit_code == 2 and "Traceback" not in r.output
    assert "verl's actor_rollout_ref.rollout.n" in r.output and "grpo.num_generations=8" in r.output
