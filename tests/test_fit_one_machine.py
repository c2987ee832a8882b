"""One-machine runs are not changed by the multi-node search: every shipped example plans the same peaks as
before it (tests/data/example_peaks.json, written from the planner before vLLM tensor parallel, FSDP and
node counts were searched), and fit's new knobs stay out of configs they cannot apply to."""

import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("TRAINFIT_CACHE", tempfile.mkdtemp(prefix="trainfit-fit-test-"))

import pytest

from trainfit.config import expand_stages, load_config
from trainfit.plan import plan
from trainfit.plan.fit_space import _combos, tp_sizes, Allow

ROOT = Path(__file__).resolve().parents[1]
PEAKS = json.loads((ROOT / "tests" / "data" / "example_peaks.json").read_text())


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.parametrize("key", sorted(PEAKS))
def test_every_example_plans_the_peaks_it_planned_before(key):
    name, _, index = key.partition("#")
    p = plan(expand_stages(load_config(ROOT / "examples" / name))[int(index)], suggest=False)
    want = PEAKS[key]
    got = {"peak": p.peak, "rollout": p.phases["rollout"].total if "rollout" in p.phases else None,
           "train": p.phases["train"].total, "cpu_ram": p.cpu_ram, "fits": p.fits}
    assert got == want


def test_tensor_parallel_sizes_divide_kv_heads_node_gpus_and_ranks():
    # Qwen2.5-7B: 28 attention heads, 4 KV heads. vLLM GRPO on 8 GPUs a node: 1, 2, 4.
    cfg = load_config(ROOT / "examples" / "grpo_gsm8k.yaml", ["model.name=Qwen/Qwen2.5-7B-Instruct",
                                                              "rollout.engine=vllm", "distributed.num_gpus=8"])
    assert tp_sizes(cfg) == [1, 2, 4]
    # 6 GPUs a node: gcd(4, 28, 6) = 2.
    assert tp_sizes(load_config(ROOT / "examples" / "grpo_gsm8k.yaml", [
        "model.name=Qwen/Qwen2.5-7B-Instruct", "rollout.engine=vllm", "distributed.num_gpus=6",
        "train.global_batch_size=48"])) == [1, 2]
    # HF generation, or a single GPU: the user's own value only.
    assert tp_sizes(load_config(ROOT / "examples" / "grpo_gsm8k.yaml")) == [1]


def test_fsdp_is_offered_from_ddp_only_where_train_runs_it():
    def strategies(*ovs):
        cfg = load_config(ROOT / "examples" / "ppo_7b_full.yaml", list(ovs))
        return {c["distributed.strategy"] for c in _combos(cfg, Allow(), {})}
    # PPO runs under FSDP (policy and critic sharded), so fit offers it from DDP; a quantized base, which
    # train refuses under FSDP (config/rules.py), is not offered it.
    assert "fsdp" in strategies("distributed.strategy=ddp", "distributed.zero_stage=0")
    qlora = load_config(ROOT / "examples" / "qwen3_4b_grpo_4bit.yaml",
                        ["distributed.num_gpus=2", "distributed.strategy=ddp"])
    assert qlora.model.quantization != "none"
    assert "fsdp" not in {c["distributed.strategy"] for c in _combos(qlora, Allow(), {})}
    grpo = load_config(ROOT / "examples" / "grpo_gsm8k.yaml", ["distributed.num_gpus=8", "peft.method=none"])
    assert "fsdp" in {c["distributed.strategy"] for c in _combos(grpo, Allow(), {})}
    # From DeepSpeed (fp32 master weights) FSDP would change the math: not offered.
    assert "fsdp" not in strategies()


def test_hardware_adds_nodes_only_where_one_node_does_not_fit_and_stops_at_the_first_that_fits(monkeypatch):
    from trainfit.plan import setups
    from trainfit.plan.hardware import find_gpu
    from trainfit.plan.setups import rank_setups

    # The planner's fix of a row that does not fit is tested in test_advice_holds.py; here none is found,
    # so a row counts as fitting by itself only (and the test plans a few rows, not their fixes).
    monkeypatch.setattr(setups, "_fix", lambda cfg, p, g, n: {"overrides": [], "fits": False, "peak_gb": None,
                                                             "change": "", "why": "not searched here"})
    # Full GRPO of Qwen2.5-0.5B under FSDP: 12.7 GiB on one GPU, 10.6 over 2 nodes of one, 9.5 over 4.
    cfg = load_config(ROOT / "examples" / "grpo_gsm8k.yaml", ["peft.method=none", "distributed.strategy=fsdp"])
    small, big = find_gpu("12GB"), find_gpu("h100")
    rows = rank_setups(cfg, gpus=[small, big], counts=(1,), nodes=(2, 4, 8))
    one = {r["gpu"]: r for r in rows if r["num_nodes"] == 1 and "async" not in r["setup"]}
    assert one[big.key]["fits"] and not any(r["num_nodes"] > 1 for r in rows if r["gpu"] == big.key)
    nodes = [r for r in rows if r["gpu"] == small.key and r["num_nodes"] > 1]
    assert not one[small.key]["fits"] and nodes
    # A 12 GB card (11.2 GiB, budget 10.1): 2 nodes do not fit, 4 do, and 8 are not planned.
    assert sorted((r["num_nodes"], r["fits"]) for r in nodes) == [(2, False), (4, True)]
    assert all(r["setup"].startswith(f"{r['num_nodes']} nodes x 1 x ") for r in nodes)
