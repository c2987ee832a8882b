"""FSDP2 with LoRA/DoRA adapters on CPU (gloo through torchrun): N ranks train what 1 rank trains, the
checkpoint holds the same files as a single process's, a cut run resumes, and each rank's shards are
the bytes the planner gives that rank; under FSDP2's CPU offload too (a full fine-tune trained, a LoRA run cut
and resumed, DoRA's shards in CPU RAM). PPO under FSDP2 is in test_ppo_fsdp.py.

The 4-rank runs are marked `fsdp` (deselected by make test, run by make test-fsdp in .ci/run): four
interpreters on a 2-core machine take ~2 minutes a run. make test keeps the 2-rank GRPO + LoRA run."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_config
from test_distributed import losses, stage_cfg, train, train_here, write
from trainfit.train.report import read_metrics

SHARD_BYTES = str(Path(__file__).parent / "fsdp_shard_bytes.py")


def weights(run_dir: Path, file: str) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / file))


def flat(sd: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([sd[k].flatten().float() for k in sorted(sd)])


def assert_same_training(one: Path, many: Path, files: list[str], init: dict[str, torch.Tensor]) -> None:
    """The N-rank run's files hold the 1-rank run's keys and values (to 1e-5), its losses too, and the
    weights moved from `init` (the comparison is not vacuous)."""
    for file in files:
        a, b = weights(one, file), weights(many, file)
        assert sorted(a) == sorted(b), file
        assert (flat(a) - flat(b)).norm() / flat(a).norm() < 1e-5, file
    for step, loss in losses(one).items():
        assert losses(many)[step] == pytest.approx(loss, rel=1e-5, abs=1e-7)
    last = weights(one, files[0])
    assert (flat({k: init[k] for k in last}) - flat(last)).norm() > 1e-4


def start_weights(cfg_path: Path, run_dir: Path) -> dict[str, torch.Tensor]:
    """The trainable weights the run starts from, under the checkpoint's keys."""
    from trainfit.config import load_config
    from trainfit.models.policy import load_policy
    from trainfit.models.state import trainable_state

    cfg = load_config(cfg_path, [f"run_dir={run_dir}"])
    loaded = load_policy(cfg.model, cfg.peft, torch.device("cpu"), seed=cfg.train.seed)
    return trainable_state(loaded.model, loaded.is_peft)


def adapter_cfg(tmp_path: Path, stage: str, method: str, **kw):
    return stage_cfg(tmp_path, stage, "x", **{"peft.method": method, "train.max_steps": 2, "train.save_every": 2,
                                              "train.global_batch_size": 8, **kw})


def test_grpo_with_lora_on_two_fsdp_ranks_equals_one_rank(tmp_path):
    # make test's FSDP2 + adapters run (2 ranks; the 4-rank ones below are marked fsdp). GRPO: generation
    # with synced ranks over sharded layers, then the adapters' gradients reduce-scattered.
    config = write(adapter_cfg(tmp_path, "grpo", "lora"), tmp_path / "c.yaml")
    train_here(config, f"run_dir={tmp_path / 'one'}")
    two = train(config, f"run_dir={tmp_path / 'two'}", "distributed.num_gpus=2", "distributed.strategy=fsdp")
    assert two.returncode == 0, two.stderr[-3000:]
    assert_same_training(tmp_path / "one", tmp_path / "two", ["checkpoints/step-000002/model.safetensors",
                                                              "final/adapter_model.safetensors"],
                         start_weights(config, tmp_path / "one"))


def gathered(stdout: str) -> tuple[int, int]:
    """(tensors, of all) the final save gathered from the shards, as the run says it."""
    m = re.search(r"final save gathered (\d+) of (\d+) tensors", " ".join(stdout.split()))
    assert m, stdout[-2000:]
    return int(m.group(1)), int(m.group(2))


def assert_same_final(one: Path, many: Path, adapters: bool) -> None:
    """The N-rank run's final dir loads as the 1-rank run's does, to the same tensors (1e-5)."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    load = AutoPeftModelForCausalLM if adapters else AutoModelForCausalLM
    a, b = (load.from_pretrained(str(d / "final")).state_dict() for d in (one, many))
    assert sorted(a) == sorted(b)
    assert (flat(a) - flat(b)).norm() / flat(a).norm() < 1e-5


def saved_base(tmp_path: Path) -> Path:
    """preset:tiny saved as a model directory: a base trainfit references and never saves again, like a hub id."""
    from trainfit.config import ModelConfig, PeftConfig
    from trainfit.models.policy import load_policy

    loaded = load_policy(ModelConfig(name="preset:tiny"), PeftConfig(), torch.device("cpu"), seed=0)
    loaded.model.save_pretrained(str(tmp_path / "tiny-base"))
    loaded.tokenizer.save_pretrained(str(tmp_path / "tiny-base"))
    return tmp_path / "tiny-base"


@pytest.mark.fsdp
@pytest.mark.parametrize("method,offload", [("lora", False), ("dora", False), ("none", True)],
                         ids=["lora", "dora", "full-offload"])
def test_sft_on_four_fsdp_ranks_equals_one_rank(tmp_path, method, offload):
    # DoRA over a saved base (as over a hub id): the final save gathers the adapters and nothing of the base.
    # LoRA over preset:tiny: trainfit saves the base beside the adapters, streamed from the shards.
    # full-offload: FSDP2's CPU offload (distributed.offload_params) of a full fine-tune, gradients clipped
    # (fsdp.clip_offloaded) to a norm the step reaches, so the clipped update is compared too.
    over = {"model.name": str(saved_base(tmp_path))} if method == "dora" else {}
    extra = {"train.grad_clip": 0.5} if offload else {}
    config = write(adapter_cfg(tmp_path, "sft", method, **over, **extra), tmp_path / "c.yaml")
    train_here(config, f"run_dir={tmp_path / 'one'}")
    four = train(config, f"run_dir={tmp_path / 'four'}", "distributed.num_gpus=4", "distributed.strategy=fsdp",
                 *(["distributed.offload_params=true"] if offload else []))
    assert four.returncode == 0, four.stderr[-3000:]
    assert "x devices 4" in " ".join(four.stdout.split())   # a long model path wraps the line anywhere
    init = start_weights(config, tmp_path / "one")
    final = "final/model.safetensors" if method == "none" else "final/adapter_model.safetensors"
    assert_same_training(tmp_path / "one", tmp_path / "four", ["checkpoints/step-000002/model.safetensors", final],
                         init)
    assert_same_final(tmp_path / "one", tmp_path / "four", adapters=method != "none")
    read, total = gathered(four.stdout)
    if method == "dora":
        assert read == len(init) < total and not (tmp_path / "four" / "base").exists()
    elif method == "lora":
        assert read == total and (tmp_path / "four" / "base" / "model.safetensors").is_file()
    else:
        assert read == total
    if offload:
        norms = [r["grad_norm"] for r in read_metrics(tmp_path / "four" / "metrics.jsonl") if r["kind"] == "train"]
        assert max(norms) > 0.5   # the clip acted on at least one step


@pytest.mark.fsdp
def test_four_fsdp_ranks_with_lora_offloaded_resume_a_cut_run(tmp_path):
    # Under FSDP2's CPU offload (distributed.offload_params): the checkpoint gathers the CPU shards and the
    # resume scatters weights and AdamW moments back into them; the result equals one uninterrupted rank.
    cfg = adapter_cfg(tmp_path, "sft", "lora", **{"train.max_steps": 4})
    config = write(cfg, tmp_path / "c.yaml")
    args = ["distributed.num_gpus=4", "distributed.strategy=fsdp", "distributed.offload_params=true",
            f"distributed.master_port={free_port()}"]   # both launches on a port no other run is using
    train_here(config, f"run_dir={tmp_path / 'full'}")   # 1 rank, uninterrupted (4 ranks == 1 rank above)
    cut = train(config, f"run_dir={tmp_path / 'cut'}", *args, "--fault", "kill_after_step:3")
    assert cut.returncode != 0
    resumed = train(config, f"run_dir={tmp_path / 'cut'}", *args, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout
    want, got = losses(tmp_path / "full"), losses(tmp_path / "cut")
    assert sorted(got) == [1, 2, 3, 4]
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-7), step
    a, b = weights(tmp_path / "full", "final/adapter_model.safetensors"), weights(tmp_path / "cut",
                                                                                  "final/adapter_model.safetensors")
    assert (flat(a) - flat(b)).norm() / flat(a).norm() < 1e-5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shard_bytes(config: Path, out: Path, world: int, *overrides: str) -> list[dict]:
    """Each rank's bytes per component (tests/fsdp_shard_bytes.py under torchrun)."""
    out.mkdir()
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
                          f"--master_port={free_port()}", SHARD_BYTES, str(config), str(out),
                          f"distributed.num_gpus={world}", "distributed.strategy=fsdp", *overrides],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def planned_rows(config: Path, world: int, *overrides: str, column: str = "train") -> dict[str, int]:
    """The planner's bytes per rank by row name (`trainfit plan`'s rows) for this config at `world` ranks: on
    each GPU in the training phase (`column` train) or in CPU RAM (cpu)."""
    from trainfit.config import load_config
    from trainfit.plan import plan

    cfg = load_config(config, [f"distributed.num_gpus={world}", "distributed.strategy=fsdp", *overrides])
    return {i.name.split(" (")[0]: getattr(i, column) for i in plan(cfg).items}


def assert_shards_as_planned(ranks: list[dict], planned: dict[str, int], rows: dict) -> None:
    """Every rank's bytes of each component equal the planner's row for it, but for what FSDP2 does not
    split 1/N: buffers (replicated on every rank) and tensors whose first dimension is not a multiple
    of the world (uneven chunks); those may move a rank's bytes by at most their own size."""
    for r, got in enumerate(ranks):
        for (model, kind), row in rows.items():
            g = got[model]
            # (A full fine-tune's weights row holds the buffers beside the trainable tensors.)
            slack = {"frozen": g["buffers"] + g["uneven_frozen"], "trainable": g["uneven_trainable"] + g["buffers"],
                     "optimizer": 2 * g["uneven_trainable"], "grads": g["uneven_trainable"]}[kind]
            assert abs(g[kind] - planned[row]) <= slack, (r, model, kind, g[kind], row, planned[row], slack)


@pytest.mark.fsdp
@pytest.mark.parametrize("method,offload", [("lora", False), ("dora", True)], ids=["lora", "dora-offload"])
def test_each_fsdp_rank_holds_the_adapter_shards_the_planner_plans(tmp_path, method, offload):
    # dora-offload: under FSDP2's CPU offload (distributed.offload_params) the same shards are the planner's
    # CPU RAM rows, gradients too (from a real backward: reduce-scattered, then offloaded by FSDP2), and no GPU
    # row holds them. On a CPU run the device is the CPU as well, so what tells offload apart is the policy
    # (CPUOffloadPolicy on every group, pinned only beside CUDA) and where the plan puts those bytes.
    config = write(adapter_cfg(tmp_path, "sft", method, **{"train.micro_batch_size": 2}), tmp_path / "c.yaml")
    extra = ["distributed.offload_params=true"] if offload else []
    ranks = shard_bytes(config, tmp_path / "bytes", 4, *extra)
    planned = planned_rows(config, 4, *extra, column="cpu" if offload else "train")
    rows = {("policy", "frozen"): "policy weights", ("policy", "trainable"): "policy adapters",
            ("policy", "optimizer"): "policy optimizer state"}
    assert_shards_as_planned(ranks, planned, {**rows, **({("policy", "grads"): "policy gradients"} if offload else {})})
    # The adapters split evenly here (r=16 rows, outputs multiples of 4): exactly 1/4 each, as planned.
    assert {r["policy"]["trainable"] for r in ranks} == {planned["policy adapters"]}
    if offload:
        gpu = planned_rows(config, 4, *extra)
        assert all(r["offloaded"] and r["policy"]["devices"] == ["cpu"] and not r["policy"]["pinned"] for r in ranks)
        assert not any(gpu[row] for row in rows.values()) and gpu["FSDP gathered layers"] > 0
        assert not any(v for k, v in gpu.items() if k.startswith("policy gradients"))


def test_fsdp_with_adapters_and_ppo_are_what_train_runs_and_the_rest_is_refused(tmp_path):
    from trainfit.models.runnable import refusal

    base = tiny_config(tmp_path, "ppo", **{"peft.method": "lora", "distributed.num_gpus": 4,
                                           "train.micro_batch_size": 2, "distributed.strategy": "fsdp",
                                           "train.global_batch_size": 16})
    for ok in ([], ["peft.method=dora"], ["peft.method=none"], ["stage=sft"], ["stage=grpo"]):
        assert refusal(base, ok) is None, ok
    assert "sharded twice" in refusal(base, ["ppo.shared_base=true"])
    assert "adapters merged into the weights" in refusal(base, ["stage=rm"])   # rm saves a merged model
    assert "drops bitsandbytes' quantization state" in refusal(base, ["stage=sft", "model.quantization=4bit"])
    assert "offload" in refusal(base, ["distributed.offload_optimizer=true"])


def test_checkpoint_keys_under_fsdp_are_the_single_process_keys(tmp_path):
    # The names gathered from the shards are mapped to what models.state.trainable_state saves of the
    # same model on one process: a peft adapter's keys (adapter name dropped), PPO's policy. / critic.
    from trainfit.models.policy import load_policy
    from trainfit.models.state import trainable_state
    from trainfit.models.value import PolicyCritic, build_critic
    from trainfit.train.fsdp import saved_names

    cfg = tiny_config(tmp_path, "ppo", **{"peft.method": "dora", "ppo.shared_base": False})
    loaded = load_policy(cfg.model, cfg.peft, torch.device("cpu"), seed=0)
    pair = PolicyCritic(loaded.model, build_critic(cfg, loaded.tokenizer, torch.device("cpu")), True)
    for model, is_peft in ((loaded.model, True), (pair, True)):
        names, want = saved_names(model, is_peft), trainable_state(model, is_peft)
        params = dict(model.named_parameters())
        assert sorted(names) == sorted(want)
        for key, name in names.items():
            assert torch.equal(params[name].detach(), want[key])


def test_vllm_adapter_push_gathers_whole_tensors_from_fsdp_shards(tmp_path, monkeypatch):
    # rollout/vllm_engine.py saves the adapters each engine loads from what every rank gathers: whole
    # tensors, not a rank's DTensor shard. Checked without vllm on a 1-rank gloo mesh (a real DTensor).
    import torch.distributed as dist
    from peft import get_peft_model_state_dict

    from trainfit.models.policy import load_policy
    from trainfit.models.state import trainable_state
    from trainfit.rollout.vllm_engine import full_adapters
    from trainfit.train.fsdp import shard

    cfg = tiny_config(tmp_path, "sft", **{"peft.method": "lora"})
    loaded = load_policy(cfg.model, cfg.peft, torch.device("cpu"), seed=0)
    want = trainable_state(loaded.model, True)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        shard(loaded.model, 1)
        assert any(hasattr(p, "full_tensor") for p in loaded.model.parameters())   # sharded: DTensors
        got = full_adapters(loaded.model)
        saved = get_peft_model_state_dict(loaded.model, state_dict=got)   # what save_pretrained writes
        assert sorted(saved) == sorted(want)
        for k, v in saved.items():
            assert type(v) is torch.Tensor and torch.equal(v, want[k])
    finally:
        dist.destroy_process_group()
