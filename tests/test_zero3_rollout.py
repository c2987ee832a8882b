"""The ZeRO-3 rollout: gathered whole only for the hf engine (Config.rollout_gathers_whole), streamed to an
engine with its own copy; and distributed.offload_train_states_during_rollout (train/zero.py StatesAsleep).

The planner's rows (in `make test`) and two GRPO runs under ZeRO-3 on 2 CPU ranks with the openai engine
against `trainfit serve` (`make test-deepspeed`, train.device=cpu).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from conftest import tiny_config
from serve_helpers import free_port, serve_subprocess
from test_distributed import train, write
from test_grpo_agents import REWARD, _served_base
from trainfit.config import ConfigError
from trainfit.plan import plan

ROOT = Path(__file__).resolve().parents[1]
ZERO3 = {"distributed.strategy": "deepspeed", "distributed.zero_stage": 3, "distributed.num_gpus": 2,
         "train.micro_batch_size": 2}
KNOB = "distributed.offload_train_states_during_rollout"


def _rows(p, prefix: str):
    return [i for i in p.items if i.name.startswith(prefix)]


@pytest.mark.parametrize("engine", ["vllm", "openai"])
def test_an_engine_with_its_own_copy_plans_no_whole_gather_under_zero3(tmp_path, engine):
    # The same config with the hf engine gathers policy and critic whole for the rollout; vllm and openai
    # get the sync's one-tensor transient instead (the openai engine syncs adapters: LoRA for both).
    def ppo(name: str):
        return plan(tiny_config(tmp_path, "ppo", **{**ZERO3, "peft.method": "lora", "rollout.engine": name,
                                                   "rollout.base_url": "http://127.0.0.1:1/v1",
                                                   "ppo.shared_base": False}), suggest=False)

    hf, other = ppo("hf"), ppo(engine)
    assert _rows(hf, "ZeRO-3 weights gathered whole") and _rows(hf, "ZeRO-3 critic weights gathered whole")
    assert not _rows(other, "ZeRO-3 weights gathered whole") and not _rows(other, "ZeRO-3 critic weights")
    hf_sync, (sync,) = _rows(hf, "ZeRO-3 weight sync"), _rows(other, "ZeRO-3 weight sync")
    assert not hf_sync and 0 < sync.rollout < _rows(hf, "ZeRO-3 weights gathered whole")[0].rollout
    assert not sync.train


def test_states_asleep_leave_the_rollout_column_for_cpu_ram(tmp_path):
    cfg = {**ZERO3, "rollout.engine": "vllm"}
    off = plan(tiny_config(tmp_path, "ppo", **cfg), suggest=False)
    on = plan(tiny_config(tmp_path, "ppo", **cfg, **{KNOB: True}), suggest=False)
    states = sum(i.rollout for i in off.items if i.name.endswith(("optimizer state", "fp32 master weights")))
    assert states > 0
    assert off.phases["rollout"].allocated - on.phases["rollout"].allocated == states
    assert on.phases["train"].allocated == off.phases["train"].allocated
    asleep = sum(i.cpu for i in _rows(on, "policy optimizer state + master") + _rows(on, "value optimizer state + master"))
    grads = sum(i.train for i in off.items if "gradients (accumulating" in i.name)
    assert asleep == states + grads and on.cpu_ram - off.cpu_ram == asleep * 2   # 2 ranks on the node
    # The step time pays the copies there and back over PCIe.
    assert on.work["offload_bytes"] - off.work.get("offload_bytes", 0) == 2 * asleep


@pytest.mark.parametrize("over,words", [
    ({}, ["distributed.offload_train_states_during_rollout=true", "ZeRO-3", "distributed.zero_stage=3"]),
    ({"distributed.strategy": "fsdp"}, ["not fsdp", "distributed.strategy=deepspeed"]),
    ({**ZERO3, "distributed.offload_optimizer": True}, ["distributed.offload_optimizer=true", "nothing to move"]),
])
def test_states_asleep_outside_zero3_is_a_config_error(tmp_path, over, words):
    with pytest.raises(ConfigError) as e:
        tiny_config(tmp_path, "grpo", **{"distributed.num_gpus": 2, "train.micro_batch_size": 2, **over, KNOB: True})
    for w in words:
        assert w in str(e.value)
    with pytest.raises(ConfigError, match="applies to stages grpo and ppo"):
        tiny_config(tmp_path, "sft", **{**ZERO3, KNOB: True})


def test_states_asleep_refusal_exits_2_with_one_paragraph(tmp_path):
    from typer.testing import CliRunner

    from trainfit.app.cli import app

    cfg = write(tiny_config(tmp_path, "grpo"), tmp_path / "c.yaml")
    out = CliRunner().invoke(app, ["plan", str(cfg), f"{KNOB}=true"])
    assert out.exit_code == 2, out.output
    assert out.exception is None or isinstance(out.exception, SystemExit)
    text = " ".join(out.output.split())
    assert "Traceback" not in text and f"{KNOB}=true" in text and "distributed.zero_stage=3" in text


SITE = '''import os, traceback
from trainfit.train import zero
_full_weights = zero.full_weights
def full_weights(model):
    with open(os.environ["FULL_WEIGHTS_LOG"], "a") as f:
        f.write(" ".join(s.name for s in traceback.extract_stack()) + "\\n")
    return _full_weights(model)
zero.full_weights = full_weights
_sleep = zero.StatesAsleep.sleep
def sleep(self):
    _sleep(self)
    if self.asleep:
        with open(os.environ["FULL_WEIGHTS_LOG"] + ".asleep", "a") as f:
            f.write(f"{len(self.devices)}\\n")
zero.StatesAsleep.sleep = sleep
'''


def _openai_run(tmp_path, stage: str, name: str, base: Path, *args: str):
    """Two optimizer steps (two rollouts) of a LoRA policy whose rollouts `trainfit serve` samples, evaluated
    before and after (the adapters pushed inside the evaluation's whole gather)."""
    # A server a run: a run's adapter names (trainfit-r<rank>-v<n>) would meet the last run's, still loaded.
    with serve_subprocess(base, tmp_path / f"server-{name}.log", "--batch-wait-ms", "0") as (url, _):
        over = {"model.name": str(base), "peft.method": "lora", "peft.r": 4, "rollout.engine": "openai",
                "rollout.base_url": url, "rollout.health_timeout_s": 90, "rollout.max_new_tokens": 5,
                "task.num_eval": 4, "train.max_steps": 2, "train.micro_batch_size": 2}
        over.update({"task.rewards": f"[{REWARD}]", "train.lr": 0.05, "grpo.beta": 0.05} if stage == "grpo" else
                    {"train.global_batch_size": 4, "ppo.kl_coef": 0.1, "train.lr": 1e-2, "ppo.value_lr": 3e-3})
        config = write(tiny_config(tmp_path, stage, **over), tmp_path / f"{name}.yaml")
        run = train(config, f"run_dir={tmp_path / name}", f"distributed.master_port={free_port()}", *args)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def _trained(run: Path) -> dict:
    """The tensors the run saved: the policy's adapters (and PPO's critic head), by name."""
    from safetensors.torch import load_file

    return {f"{f}:{k}": v for f in ("adapter_model.safetensors", "critic/model.safetensors")
            if (run / "final" / f).exists() for k, v in load_file(str(run / "final" / f)).items()}


@pytest.mark.deepspeed  # 2 ranks under DeepSpeed ZeRO-3 on CPU: `make test-deepspeed`
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs the deepspeed extra")
@pytest.mark.parametrize("stage", ["grpo", "ppo"])
def test_zero3_with_the_openai_engine_streams_the_sync_and_trains_as_one_rank_with_states_asleep(
        tmp_path, monkeypatch, stage):
    base = _served_base(tmp_path)
    one = _openai_run(tmp_path, stage, "one", base)   # one plain process: the reference
    # The ZeRO-3 ranks log every call of zero.full_weights with its stack, and what each sleep moved
    # (a sitecustomize on their PYTHONPATH).
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITE)
    monkeypatch.setenv("PYTHONPATH", f"{site}:{ROOT}")
    monkeypatch.setenv("FULL_WEIGHTS_LOG", str(tmp_path / "full_weights.log"))
    z3 = _openai_run(tmp_path, stage, "z3", base, "distributed.num_gpus=2", "distributed.strategy=deepspeed",
                     "distributed.zero_stage=3", f"{KNOB}=true")
    stacks = (tmp_path / "full_weights.log").read_text().splitlines()
    assert stacks   # the final save gathers whole: the log sees the ranks' calls...
    assert not [s for s in stacks if "prepare" in s.split()]   # ...and no rollout gathered whole
    for rows in (one, z3):
        steps = [r for r in rows if r["kind"] == "train"]
        assert [r["step"] for r in steps] == [1, 2]
        assert all(r["sync_logp_diff"] < 1e-3 for r in steps)   # the (streamed) sync reached the server
    # The states slept through each rollout (2 ranks x 2 rollouts): the fp32 partitions at the first,
    # with the two Adam moments of each after step 1...
    moved = sorted(int(x) for x in (tmp_path / "full_weights.log.asleep").read_text().split())
    assert len(moved) == 4 and moved[0] >= 1 and moved == [moved[0]] * 2 + [3 * moved[0]] * 2
    # ...and came back unchanged: 2 ZeRO-3 ranks train what one plain process trains.
    one_sd, z3_sd = _trained(tmp_path / "one"), _trained(tmp_path / "z3")
    assert sorted(one_sd) == sorted(z3_sd)
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in one_sd.items())   # B starts at 0: it trained
    a, b = (torch.cat([sd[k].flatten() for k in sorted(sd)]) for sd in (one_sd, z3_sd))
    assert (a - b).norm() / a.norm() < 1e-5
