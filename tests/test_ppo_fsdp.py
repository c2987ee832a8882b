"""PPO under FSDP2 on 4 CPU ranks (gloo): policy and critic sharded and trained; with a full fine-tune the
frozen reference copy and a reward model sharded with them (train/frozen.py; with adapters the reference
is the base with adapters off). 4 ranks train what 1 rank trains, and each rank's shards are the bytes
the planner gives it. Marked `fsdp`: run by make test-fsdp (see test_fsdp_adapters.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_distributed import stage_cfg, train, train_here, write
from test_fsdp_adapters import (assert_same_final, assert_same_training, assert_shards_as_planned, gathered,
                                planned_rows, shard_bytes)

REWARD = str(Path(__file__).parent / "data" / "rewards_for_tests.py") + ":length_reward"

pytestmark = pytest.mark.fsdp


def ppo_cfg(tmp_path: Path, method: str, **kw):
    # 16 samples a step: 4 a rank, 2 micro-steps, so the first one's gradient sync is skipped on both roots.
    # A full fine-tune scores with a reward model too: the reference copy and it are the frozen models sharded.
    rm = {"rl_models.reward_model": "preset:tiny", "rl_models.reward_dtype": "fp32"} if method == "none" else {}
    return stage_cfg(tmp_path, "ppo", "x", **{"peft.method": method, "train.max_steps": 2, "train.save_every": 2,
                                              "train.global_batch_size": 16, "train.micro_batch_size": 2,
                                              "ppo.kl_coef": 0.05, **rm,
                                              "task.rewards": f"[{REWARD}]", "rollout.max_new_tokens": 5, **kw})


def initial_pair(config: Path):
    """PPO's trainable weights at the start (policy. / critic. keys), as a single process builds them."""
    import torch

    from trainfit.config import load_config
    from trainfit.models.policy import load_policy
    from trainfit.models.value import PolicyCritic, build_critic

    cfg = load_config(config, ["ppo.shared_base=false"] if "lora" in config.read_text() else [])
    loaded = load_policy(cfg.model, cfg.peft, torch.device("cpu"), seed=cfg.train.seed)
    critic = build_critic(cfg, loaded.tokenizer, torch.device("cpu"), loaded.model)
    return PolicyCritic(loaded.model, critic, loaded.is_peft).trainable_state_dict()


@pytest.mark.parametrize("method", ["lora", "none"])
def test_ppo_on_four_fsdp_ranks_equals_one_rank(tmp_path, method):
    config = write(ppo_cfg(tmp_path, method), tmp_path / "c.yaml")
    # Under FSDP the critic has a base of its own (Config.ppo_shared_base); one rank does the same here.
    train_here(config, f"run_dir={tmp_path / 'one'}", *(["ppo.shared_base=false"] if method != "none" else []))
    # A full fine-tune's frozen reference copy and reward model are sharded too, here with their shards kept
    # in CPU RAM (rl_models.offload_frozen: FSDP2's CPU offload policy; the same numbers).
    four = train(config, f"run_dir={tmp_path / 'four'}", "distributed.num_gpus=4", "distributed.strategy=fsdp",
                 *(["rl_models.offload_frozen=true"] if method == "none" else []))
    assert four.returncode == 0, four.stderr[-3000:]
    final = "final/adapter_model.safetensors" if method != "none" else "final/model.safetensors"
    assert_same_training(tmp_path / "one", tmp_path / "four", ["checkpoints/step-000002/model.safetensors", final],
                         initial_pair(config))
    assert (tmp_path / "four" / "final" / "critic" / "config.json").is_file()
    # The final dir loads as one rank's; a full fine-tune's weights were gathered, one tensor at a time.
    assert_same_final(tmp_path / "one", tmp_path / "four", adapters=method != "none")
    read, total = gathered(four.stdout)
    assert read == total


@pytest.mark.parametrize("method", ["lora", "none"])
def test_each_fsdp_rank_holds_the_ppo_shards_the_planner_plans(tmp_path, method):
    config = write(ppo_cfg(tmp_path, method), tmp_path / "c.yaml")
    ranks = shard_bytes(config, tmp_path / "bytes", 4)
    planned = planned_rows(config, 4)
    trained = "adapters" if method != "none" else "weights"
    rows = {("policy", "trainable"): f"policy {trained}", ("policy", "optimizer"): "policy optimizer state",
            ("value", "trainable"): f"value {'adapters' if method != 'none' else 'model weights'}",
            ("value", "optimizer"): "value optimizer state"}
    if method != "none":
        rows.update({("policy", "frozen"): "policy weights", ("value", "frozen"): "value model weights"})
    if method == "none":   # the frozen reference copy and reward model: 1/4 a rank, as planned
        rows.update({("reference", "frozen"): "reference policy", ("reward", "frozen"): "reward model"})
    assert_shards_as_planned(ranks, planned, rows)
    whole = planned_rows(config, 1)
    for got in ranks:
        assert ("reference" in got) == ("reward" in got) == (method == "none")
        if method == "none":   # sharded, not whole: less than half of the one-rank model on each rank
            assert got["reference"]["frozen"] < whole["reference policy"] / 2
            assert got["reward"]["frozen"] < whole["reward model"] / 2
