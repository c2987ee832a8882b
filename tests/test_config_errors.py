"""User mistakes in configs: exit code 2, one paragraph naming the key, the value and the fix,
never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from trainfit.app.cli import app

BASE = """
stage: sft
run_dir: {run}
model: {{name: "preset:tiny"}}
task: {{name: arithmetic, max_operand: 9, num_eval: 8}}
train: {{max_steps: 1, global_batch_size: 8, micro_batch_size: 8, device: cpu}}
logging: {{progress: false, tensorboard: false, plot: false}}
"""


@pytest.fixture
def config(tmp_path):
    p = tmp_path / "cfg.yaml"
    p.write_text(BASE.format(run=tmp_path / "run"))
    return p


def invoke(*args):
    return CliRunner().invoke(app, ["train", *map(str, args)])


CASES = [
    # (overrides, words the message must contain)
    (["train.lrr=1e-4"], ["'train.lrr'", "did you mean 'train.lr'"]),
    (["trian.lr=1e-4"], ["'trian'", "'train'"]),
    (["train.lr=abc"], ["'train.lr'", "'abc'", "number"]),
    (["train.micro_batch_size=0"], ["'train.micro_batch_size'", "0", "greater than or equal to 1"]),
    (["model.dtype=fp8"], ["'model.dtype'", "'fp8'", "'fp32', 'bf16' or 'fp16'"]),
    (["train.micro_batch_size=3"], ["train.micro_batch_size=3", "per-device batch 8", "[1, 2, 4, 8]"]),
    (["stage=grpo", "train.global_batch_size=12", "train.micro_batch_size=4", "grpo.num_generations=8"],
     ["grpo.num_generations=8", "split across optimizer steps", "16"]),
    (["model.quantization=4bit"], ["model.quantization=4bit", "peft.method=lora"]),
    # FSDP2's CPU offload (config/rules.py fsdp_offload_errors): offload_params is its switch.
    (["distributed.strategy=fsdp", "distributed.num_gpus=4", "train.micro_batch_size=2",
      "distributed.offload_optimizer=true"],
     ["distributed.offload_optimizer=true", "offload_params=false", "distributed.offload_params=true too",
      "zero_stage=2"]),
    (["distributed.strategy=fsdp", "distributed.offload_params=true"],
     ["distributed.offload_params=true", "one process", "distributed.num_gpus to 2", "zero_stage=3"]),
    (["distributed.strategy=fsdp", "distributed.num_gpus=4", "train.micro_batch_size=2",
      "distributed.offload_params=true", "train.optimizer=adamw_8bit"],
     ["train.optimizer=adamw_8bit", "train.optimizer=adamw,", "distributed.offload_params=false"]),
    (["model.name=preset:huge"], ["preset:huge", "preset:tiny"]),
    (["task.name=nosuch"], ["'nosuch'", "arithmetic"]),
    (["stage=grpo", "task.rewards=[nomodule_xyz:fn]"], ["task.rewards", "nomodule_xyz:fn"]),
    (["rollout.engine=vllm", "stage=grpo"], ["rollout.engine=vllm", "pip install 'trainfit[vllm]'", "rollout.engine=hf"]),
    (["stage=grpo", "rollout.engine=openai", "peft.method=lora"], ["rollout.engine=openai", "rollout.base_url"]),
    (["stage=grpo", "rollout.engine=openai", "rollout.base_url=http://127.0.0.1:1/v1"],
     ["peft.method=none", "load_lora_adapter", "peft.method=lora"]),
    (["stage=grpo", "rollout.max_turns=3"], ["rollout.max_turns=3", "env.type"]),
    (["stage=grpo", "env.type=http"], ["env.type=http", "env.url"]),
    (["stage=grpo", "env.type=http", "env.url=http://127.0.0.1:1", "rollout.max_turns=3",
      "rollout.max_images_per_episode=1", "distributed.strategy=deepspeed"],
     ["rollout.max_images_per_episode=1", "rollout.max_turns=3", "DeepSpeed", "distributed.strategy=auto"]),
    (["stage=grpo", "env.type=simulated_user"], ["env.type=simulated_user", "peft.method=lora", "env.user_model"]),
    (["env.type=tools"], ["env.type=tools", "stage=grpo"]),
    (["rollout.mode=async"], ["rollout.mode=async", "stage sft", "rollout.mode=sync"]),
    (["stage=grpo", "rollout.mode=async", "rollout.engine=vllm", "rollout.worker=process"],
     ["rollout.mode=async", "rollout.engine=vllm", "rollout.worker=process", "rollout.worker=thread",
      "rollout.engine=openai", "rollout.engine=hf"]),
    (["stage=grpo", "rollout.mode=async", "distributed.strategy=deepspeed"],
     ["rollout.mode=async", "deepspeed", "distributed.num_gpus=1", "rollout.mode=sync"]),
    (["stage=grpo", "rollout.mode=async", "env.type=simulated_user", "peft.method=lora"],
     ["rollout.mode=async", "env.type=simulated_user", "env.user_model", "rollout.mode=sync"]),
    (["stage=grpo", "rollout.worker=process"],
     ["rollout.worker=process", "rollout.mode=sync", "rollout.mode=async", "rollout.worker=thread"]),
    (["stage=grpo", "rollout.mode=async", "rollout.worker=process", "train.device=cuda"],
     ["rollout.worker=process", "train.device=cuda", "rollout.worker=thread", "train.device=cpu"]),
    (["stage=grpo", "rollout.mode=async", "rollout.worker=process", "peft.method=lora", "model.quantization=4bit"],
     ["rollout.worker=process", "model.quantization=4bit", "rollout.worker=thread", "model.quantization=none"]),
    (["stage=grpo", "rollout.max_staleness=-1"], ["'rollout.max_staleness'", "-1", "greater than or equal to 0"]),
    (["stage=grpo", "rollout.importance_cap=0.5"], ["'rollout.importance_cap'", "0.5", "greater than or equal to 1"]),
]


@pytest.mark.parametrize("overrides,words", CASES, ids=[c[0][-1] for c in CASES])
def test_bad_config_exits_2_with_key_and_fix(config, overrides, words):
    r = invoke(config, *overrides)
    out = r.output
    assert r.exit_code == 2, out
    assert "Traceback" not in out
    assert r.exception is None or isinstance(r.exception, SystemExit)
    for w in words:
        assert w in out.replace("\n", " "), f"{w!r} missing from: {out}"


def test_yaml_unknown_key_and_bad_syntax(tmp_path):
    bad_key = tmp_path / "k.yaml"
    bad_key.write_text("train:\n  lr: 1e-4\n  warmup: 10\n")
    r = invoke(bad_key)
    assert r.exit_code == 2 and "'train.warmup'" in r.output and "train.warmup_steps" in r.output
    bad_yaml = tmp_path / "y.yaml"
    bad_yaml.write_text("train: {lr: 1e-4\n")
    r = invoke(bad_yaml)
    assert r.exit_code == 2 and "not valid YAML" in r.output
    r = invoke(tmp_path / "missing.yaml")
    assert r.exit_code == 2 and "does not exist" in r.output


def test_real_process_exit_code_and_no_traceback(config):
    p = subprocess.run([sys.executable, "-m", "trainfit.app.cli", "train", str(config), "train.lrr=1"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr + p.stdout
    assert "train.lrr" in p.stderr


@pytest.mark.parametrize("override,sentence", [
    ("data.packing=maybe", "'data.packing' takes true or false, not 'maybe'."),
    ("model.gradient_checkpointing=maybe",
     "'model.gradient_checkpointing' takes true or false, an integer or a number, not 'maybe'."),
    ("train.micro_batch_size=0", "'train.micro_batch_size' takes a value greater than or equal to 1, not 0."),
    ("rollout.stop=5", "'rollout.stop' takes a list, e.g. [a, b], not 5."),
])
def test_a_bad_value_reads_as_one_sentence_naming_key_value_and_what_is_accepted(config, override, sentence):
    r = invoke(config, override)
    out = " ".join(r.output.split())
    assert r.exit_code == 2 and sentence in out, out
    assert "Input should" not in out   # pydantic's own sentence is not pasted in
