"""Every row of a text plan is true (issue 46): the rows add up and name what they hold
(plan_rows_helpers.check_rows, which test_plan_memory runs on every example on its own card; here a few
on a second card), offloaded states keep their own rows, frozen models are planned as the trainer
places them, and the rows say FSDP or ZeRO-3 as the config shards. Plans only, no model."""

import os
import tempfile
from pathlib import Path

os.environ.setdefault("TRAINFIT_CACHE", tempfile.mkdtemp(prefix="trainfit-plan-test-"))

import pytest

from trainfit.config import expand_stages, load_config
from trainfit.plan import plan
from trainfit.plan.components import states_items
from trainfit.plan.states import States

from plan_rows_helpers import check_rows

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# The example's own card (hardware.gpu, else the default) and a smaller one: the vLLM envelope, the
# suggestions' starting point and the verdict change with the card, the rows' arithmetic must not.
SECOND_GPU = "a100-40gb"


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


# A few examples on a second card (each example is checked on its own card by test_plan_memory's
# test_every_example_plans): offload, ZeRO-3 PPO with four models, a colocated vLLM engine, FSDP.
ON_SECOND_GPU = ["sft_7b_zero2_offload.yaml", "ppo_7b_full.yaml", "qwen3_8b_grpo_lora_h200.yaml",
                 "qwen3_vl_8b_sft_4gpu.yaml"]


@pytest.mark.parametrize("name", ON_SECOND_GPU)
def test_the_rows_add_up_on_a_second_card(name):
    for stage_cfg in expand_stages(load_config(EXAMPLES / name)):
        check_rows(plan(stage_cfg, gpu=SECOND_GPU, suggest=False), stage_cfg)


def test_offloaded_states_stay_on_their_own_rows():
    # ZeRO-3 with offload_params and offload_optimizer: the weights row holds the bf16 weights' partition
    # only; the moments and the fp32 masters keep their own rows, in CPU RAM.
    cfg = load_config(EXAMPLES / "sft_7b_zero2_offload.yaml", ["distributed.zero_stage=3",
                                                                 "distributed.offload_params=true"])
    p = plan(cfg, suggest=False, from_data=False)
    rows = {i.name: i for i in p.items}
    weights, opt = rows["policy weights (bf16)"], rows["policy optimizer state"]
    master = rows["policy fp32 master weights"]
    n = p.params // p.world
    assert weights.train == 0 and 1.9 * n < weights.cpu < 2.1 * n          # bf16: 2 bytes a parameter
    assert opt.train == 0 and 7.9 * n < opt.cpu < 8.1 * n                  # two fp32 moments
    assert master.train == 0 and 3.9 * n < master.cpu < 4.1 * n            # fp32 masters
    check_rows(p, cfg)


def test_states_items_give_each_offloaded_kind_its_row():
    st = States(weights=0, adapters=0, cpu_weights=100, cpu_adapters=10, cpu_optimizer=80, cpu_master=40,
                cpu_step_temp=5)
    items = []
    states_items(items, "policy", st, "policy weights (bf16)", rl=False, accum=1)
    cpu = {i.name: i.cpu for i in items}
    assert cpu == {"policy weights (bf16)": 100, "policy adapters (fp32)": 10, "policy optimizer state": 80,
                   "policy fp32 master weights": 40,
                   "policy optimizer-step temporaries (the offloaded step runs on the CPU)": 5,
                   "policy communication buckets": 0}
    assert sum(cpu.values()) == st.cpu


def test_frozen_models_are_planned_as_the_trainer_spreads_them():
    # ppo_7b_full: ZeRO-3 over 8 GPUs partitions the policy and critic, and the reference copy and the reward
    # model with them (train/frozen.py): 1/8 of the whole each (tests/test_frozen_sharding.py checks the sum).
    p = plan(load_config(EXAMPLES / "ppo_7b_full.yaml"), suggest=False, from_data=False)
    rows = {i.group: i for i in p.items if i.group in ("reference", "reward") and i.train}
    one = plan(load_config(EXAMPLES / "ppo_7b_full.yaml", ["distributed.num_gpus=1"]), suggest=False, from_data=False)
    rows1 = {i.group: i for i in one.items if i.group in ("reference", "reward") and i.train}
    assert rows["reference"].train == rows1["reference"].train // 8 and rows["reward"].train == rows1["reward"].train // 8
    assert any("sharded like the policy" in n for n in p.notes)
    assert not any("Frozen models" in n for n in one.notes)   # one rank: nothing to say
    # the reward model's row names the count the parameters line gives it
    frozen = next(c for c in p.counts if c.model == "reward model")
    from trainfit.plan.counts import count_text

    assert f"reward model ({count_text(frozen.params)} " in rows["reward"].name


@pytest.mark.parametrize("over,name", [([], "FSDP gathered layers"),
                                       (["distributed.strategy=deepspeed", "distributed.zero_stage=3"],
                                        "ZeRO-3 gathered layers")])
def test_the_gathered_layers_row_names_what_shards_them(over, name):
    # qwen3_vl_8b_sft_4gpu.yaml shards with FSDP and peaks in forward/backward, where the layers are gathered.
    p = plan(load_config(EXAMPLES / "qwen3_vl_8b_sft_4gpu.yaml", over), suggest=False, from_data=False)
    assert p.phases["train"].step == "policy forward/backward"
    gathered = [i.name for i in p.items if "gathered layers" in i.name]
    assert gathered == [name]


def test_doctor_gives_the_plans_cpu_ram_as_plan_prints_it():
    # One number, one unit, one function (plan.items.gib): doctor's finding and plan's table agree.
    from typer.testing import CliRunner

    from trainfit.app.cli import app
    from trainfit.plan.items import gib

    path = EXAMPLES / "sft_7b_zero2_offload.yaml"
    p = plan(load_config(path), suggest=False)
    r = CliRunner().invoke(app, ["doctor", str(path), "--cpu-ram-gb", "64", "--no-machine"])
    text = " ".join(r.output.split())
    assert f"keeps {gib(p.cpu_ram)} GiB per node in CPU RAM" in text and "59.60 GiB" in text, text  # 64e9 bytes
