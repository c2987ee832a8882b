"""PPO's / GRPO's frozen models (the reference copy, the reward model) are sharded like the trained module
when it is sharded over several ranks (FSDP2, ZeRO-3), whole otherwise: one rule (Config.frozen_sharding)
for the trainer (train/frozen.py) and the planner (plan/frozen.py). Plans of tiny presets, no model; the
ranks' real shards are checked against these rows in test_ppo_fsdp.py (make test-fsdp)."""

import pytest

from trainfit.core.dist import Ranks
from trainfit.models.shapes import arch_facts, locate
from trainfit.plan import plan
from trainfit.plan.states import model_states, parallel_of
from trainfit.train import frozen

from conftest import tiny_config

FULL_RM = {"ppo.kl_coef": 0.05, "rl_models.reward_model": "preset:small", "rl_models.reward_dtype": "fp32",
           "train.device": "cpu"}


def ppo(tmp_path, **over):
    return tiny_config(tmp_path, "ppo", **{**FULL_RM, "train.global_batch_size": 8, "train.micro_batch_size": 2,
                                           **over})


@pytest.mark.parametrize("over,want", [
    ({"distributed.num_gpus": 4, "distributed.strategy": "fsdp"}, "fsdp"),
    ({"distributed.num_gpus": 4, "distributed.strategy": "deepspeed", "distributed.zero_stage": 3}, "zero3"),
    ({"distributed.num_gpus": 4, "distributed.strategy": "deepspeed", "distributed.zero_stage": 2}, ""),
    ({"distributed.num_gpus": 4, "distributed.strategy": "ddp"}, ""),
    ({"distributed.num_gpus": 1, "distributed.strategy": "deepspeed", "distributed.zero_stage": 3}, ""),
])
def test_frozen_models_are_sharded_only_where_the_trained_module_is(tmp_path, over, want):
    assert ppo(tmp_path, **over).frozen_sharding() == want


def rows(p) -> dict:
    """The frozen models' resident rows by group (a peak sub-step's own items aside)."""
    return {i.group: i for i in p.items if i.name.startswith(("reference policy", "reward model"))}


@pytest.mark.parametrize("strategy", [["distributed.strategy=fsdp"],
                                      ["distributed.strategy=deepspeed", "distributed.zero_stage=3"]])
def test_sharded_frozen_rows_are_the_trained_rows_shard_arithmetic_plus_their_gathered_layers(tmp_path, strategy):
    over = dict(s.split("=") for s in strategy)
    four = ppo(tmp_path, **{"distributed.num_gpus": 4, **over})
    one = ppo(tmp_path, **{"distributed.num_gpus": 1})
    p4, p1 = plan(four, suggest=False, from_data=False), plan(one, suggest=False, from_data=False)
    par = parallel_of(four)
    pol = arch_facts(locate("preset:tiny"))
    rm = arch_facts(locate("preset:small"))
    ref4 = model_states(pol, dtype=four.model.dtype, trainable="none", par=par)
    rm4 = model_states(rm, dtype="fp32", trainable="none", head_params=rm.hidden, drop_lm_head=True, par=par)
    r4, r1 = rows(p4), rows(p1)
    # Per rank: the whole model's bytes split 4 ways, as the policy's own weights row is.
    assert r4["reference"].train == ref4.weights == r1["reference"].train // 4
    assert r4["reward"].train == rm4.weights == r1["reward"].train // 4
    assert r4["reference"].rollout == r4["reference"].train and r4["reward"].rollout == r4["reward"].train
    # Their forwards gather a layer (and the prefetched one) whole: the scoring sub-steps grow by that.
    assert ref4.gathered and rm4.gathered
    assert p4.substeps["reference forward"] - p1.substeps["reference forward"] == ref4.gathered
    assert p4.substeps["reward forward"] - p1.substeps["reward forward"] == rm4.gathered
    assert any(f"{par.sharding} over 4 ranks" in n and "sharded like the policy" in n for n in p4.notes)


def test_a_single_gpu_and_a_ddp_plan_keep_the_frozen_models_whole(tmp_path):
    cfg = ppo(tmp_path)
    one = plan(cfg, suggest=False, from_data=False)
    ddp = plan(ppo(tmp_path, **{"distributed.num_gpus": 4, "distributed.strategy": "ddp"}),
               suggest=False, from_data=False)
    whole = model_states(arch_facts(locate("preset:tiny")), dtype=cfg.model.dtype, trainable="none").weights
    assert rows(one)["reference"].train == rows(ddp)["reference"].train == whole
    assert "reference forward" in one.substeps and one.substeps["reference forward"] == ddp.substeps["reference forward"]
    assert any("whole on every rank" in n and "DDP" in n for n in ddp.notes)


def test_even_chunks_give_every_rank_as_many_forwards_as_the_busiest(monkeypatch):
    items = list(range(5))
    # Alone (or whole models): the chunks as they are.
    assert list(frozen.even_chunks(items, 2, Ranks(), collective=True)) == [([0, 1], True), ([2, 3], True),
                                                                            ([4], True)]
    # Another rank has 5 chunks: this one repeats its last chunk twice, as forwards whose results are dropped.
    monkeypatch.setattr(frozen, "all_gather_objects", lambda n, ranks: [n, 5])
    got = list(frozen.even_chunks(items, 2, Ranks(rank=0, world=2), collective=True))
    assert got == [([0, 1], True), ([2, 3], True), ([4], True), ([4], False), ([4], False)]
    assert len(list(frozen.even_chunks(items, 2, Ranks(rank=0, world=2), collective=False))) == 3


def test_offload_frozen_plans_the_shards_in_cpu_ram_and_is_refused_where_nothing_is_sharded(tmp_path):
    from trainfit.config import ConfigError

    fsdp = {"distributed.num_gpus": 4, "distributed.strategy": "fsdp"}
    on = plan(ppo(tmp_path, **fsdp, **{"rl_models.offload_frozen": True}), suggest=False, from_data=False)
    off = plan(ppo(tmp_path, **fsdp), suggest=False, from_data=False)
    for group in ("reference", "reward"):
        assert rows(on)[group].train == rows(on)[group].rollout == 0
        assert rows(on)[group].cpu == rows(off)[group].train > 0
    # Their forwards still gather each layer on the GPU.
    assert on.substeps["reference forward"] == off.substeps["reference forward"]
    assert any("in CPU RAM" in n for n in on.notes) and not any("in CPU RAM" in n for n in off.notes)
    # ZeRO-3's offload_params offloads them with the policy (one ZeRO-3 config for every engine).
    z3 = ppo(tmp_path, **{"distributed.num_gpus": 4, "distributed.strategy": "deepspeed", "distributed.zero_stage": 3,
                          "distributed.offload_params": True})
    assert z3.frozen_offload() and not ppo(tmp_path, **fsdp, **{"distributed.offload_params": True}).frozen_offload()
    with pytest.raises(ConfigError, match="rl_models.offload_frozen=true"):
        ppo(tmp_path, **{"distributed.num_gpus": 4, "distributed.strategy": "ddp", "rl_models.offload_frozen": True})
