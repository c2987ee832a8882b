"""FSDP2's CPU offload (distributed.strategy=fsdp, distributed.offload_params=true): what `train` accepts and
refuses, the planner's rows (every shard leaves the GPU columns for the CPU RAM column, the gathered layers and
activations stay), its step time (PCIe copies, the optimizer stepping in CPU RAM) and what `fit` offers.

The 4-rank runs (one rank's numbers, each rank's shards and where they live, a cut run resumed) are in
test_fsdp_adapters.py, marked fsdp."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import tiny_config
from plan_rows_helpers import check_rows
from trainfit.config import load_config
from trainfit.plan import plan

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# 7B full SFT (bf16, AdamW) under FSDP2 over 4 GPUs, the example's own DeepSpeed settings off.
FSDP_7B = ["distributed.strategy=fsdp", "distributed.zero_stage=0", "distributed.offload_optimizer=false",
           "distributed.num_gpus=4"]
OFFLOAD = ["distributed.offload_params=true"]

pytestmark = pytest.mark.usefixtures("user_plan_cache")  # offline, the run's own planner cache


def plan_7b(*overrides: str, gpu: str = "a100-80gb"):
    cfg = load_config(EXAMPLES / "sft_7b_zero2_offload.yaml", [*FSDP_7B, *overrides])
    return cfg, plan(cfg, gpu=gpu, suggest=False, from_data=False)


def test_train_runs_fsdp_offload_with_offload_params_and_refuses_the_rest_in_one_paragraph(tmp_path):
    from trainfit.models.runnable import refusal

    base = tiny_config(tmp_path, "sft", **{"distributed.strategy": "fsdp", "distributed.num_gpus": 4,
                                           "train.micro_batch_size": 2})
    for ok in (OFFLOAD, [*OFFLOAD, "distributed.offload_optimizer=true"], [*OFFLOAD, "peft.method=lora"],
               [*OFFLOAD, "stage=grpo", "grpo.num_generations=2"]):
        assert refusal(base, ok) is None, ok
    refused = {  # overrides: what the one paragraph names
        ("distributed.offload_optimizer=true",): ("distributed.offload_optimizer=true", "distributed.offload_params=true"),
        (*OFFLOAD, "distributed.num_gpus=1", "train.micro_batch_size=8"): ("one process", "distributed.num_gpus"),
        (*OFFLOAD, "train.optimizer=adamw_8bit"): ("train.optimizer=adamw_8bit", "train.optimizer=adamw,"),
    }
    for overrides, words in refused.items():
        msg = refusal(base, list(overrides))
        assert msg and "\n" not in msg.strip() and all(w in msg for w in words), (overrides, msg)


def test_fsdp_offload_moves_every_shard_from_the_gpu_rows_to_cpu_ram():
    cfg, on = plan_7b(*OFFLOAD)
    _, off = plan_7b()
    rows_on, rows_off = {i.name: i for i in on.items}, {i.name: i for i in off.items}
    n = on.params // 4   # parameters per rank's shards (7.6B over 4 ranks)
    for name in ("policy weights (bf16)", "policy optimizer state"):
        assert rows_on[name].train == rows_on[name].rollout == 0 and rows_off[name].cpu == 0
        assert rows_on[name].cpu == rows_off[name].train, name   # the same shard, now in CPU RAM
    assert 1.99 * n < rows_on["policy weights (bf16)"].cpu < 2.01 * n          # bf16
    assert 3.99 * n < rows_on["policy optimizer state"].cpu < 4.01 * n         # two bf16 moments
    # The gradients' shards: resident on the GPU while accumulating without offload, in CPU RAM with it.
    accum = on.accumulation
    grads_off = rows_off[f"policy gradients (accumulating over {accum} micro-steps)"]
    assert rows_on["policy gradients (shards in CPU RAM)"].cpu == grads_off.train and 1.99 * n < grads_off.train
    assert not any(i.train for i in on.items if i.name.startswith("policy gradients"))
    # What stays on the GPU: each layer gathered (and the next prefetched) for its compute, the activations.
    for name in ("FSDP gathered layers",):
        assert rows_on[name].train == rows_off[name].train > 0
    assert on.peak <= off.peak - sum(rows_off[k].train for k in ("policy weights (bf16)", "policy optimizer state"))
    # CPU RAM per node: 4 ranks' shards of weights, gradients and moments, plus one tensor's step temporaries.
    shards = sum(rows_on[k].cpu for k in ("policy weights (bf16)", "policy gradients (shards in CPU RAM)",
                                          "policy optimizer state"))
    temps = rows_on["policy optimizer-step temporaries (the offloaded step runs on the CPU)"].cpu
    assert on.cpu_ram == 4 * (shards + temps) and off.cpu_ram == 0
    assert 0 < temps < 0.2 * shards   # the for-loop AdamW's two temporaries of the largest shard
    check_rows(on, cfg)


def test_fsdp_offload_work_counts_the_pcie_copies_and_the_cpu_step():
    from trainfit.plan.states import States
    from trainfit.plan.steptime import fsdp_offload_work

    # Per rank: 100 bytes of weight shards, 10 of adapter shards, 10 of gradient shards, 20 of moments.
    # PCIe a step, accumulation 3: 3 x (2 x 110 weights to the GPU + 10 gradients back) = 690.
    # CPU AdamW: 2 x (10 weights + 20 moments) read and written + 10 gradients read + 2 x 20 temporaries = 110.
    st = States(cpu_weights=100, cpu_adapters=10, cpu_grads=10, cpu_optimizer=20)
    assert fsdp_offload_work(st, 3) == {"offload_bytes": 690.0, "cpu_optimizer_bytes": 110.0}


def test_fsdp_offload_costs_step_time_and_fit_takes_it_only_where_nothing_faster_fits():
    from trainfit.models.runnable import refusal
    from trainfit.plan import hardware
    from trainfit.plan.fit import Allow, fit
    from trainfit.plan.fit_candidate import estimate

    card = hardware.find_gpu("a100-80gb")
    cfg_on, on = plan_7b(*OFFLOAD)
    cfg_off, off = plan_7b()
    t_on, t_off = estimate(on, cfg_on, card), estimate(off, cfg_off, card)
    assert t_on.comm > t_off.comm and t_on.train > t_off.train   # PCIe copies; the optimizer on the CPU
    # 7B full SFT on 2 x A100 40GB: FSDP alone misses; with offload allowed, fit offloads what train runs.
    cfg = load_config(EXAMPLES / "sft_7b_zero2_offload.yaml", FSDP_7B)
    small = fit(cfg, gpu="a100-40gb", num_gpus=2, allow=Allow(offload=True)).best
    d = small.cfg.distributed
    assert (d.strategy, d.offload_params, d.offload_optimizer) == ("fsdp", True, True)
    assert refusal(small.cfg) is None and small.plan.cpu_ram > 0
    # On 4 x A100 80GB FSDP fits without offload: offload allowed but not taken (it is slower).
    big = fit(cfg, gpu="a100-80gb", num_gpus=4, allow=Allow(offload=True)).best
    assert big.cfg.distributed.strategy == "fsdp" and not big.cfg.distributed.offload_params
