"""The planner, fit and hardware with distributed.rollout_gpus: per-device memory (plan/memory.py), the
overlapped step estimate (hardware.StepTime, work.py) and sync against async splits (plan/split.py)."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from trainfit.app.cli import app
from trainfit.config import load_config
from trainfit.plan import plan
from trainfit.plan.hardware import CATALOG, StepTime, find_gpu, roofline_step
from trainfit.plan.split import SplitOption, compare_splits, suggest_split
from trainfit.plan.steptime import estimate

pytestmark = pytest.mark.usefixtures("user_plan_cache")   # offline, the run's own planner cache

BASE = {"stage": "grpo", "model": {"name": "preset:tiny"}, "task": {"name": "arithmetic"},
        "train": {"global_batch_size": 32, "micro_batch_size": 8}, "grpo": {"num_generations": 8, "beta": 0.04},
        "rollout": {"max_new_tokens": 64}}
SPLIT = ["rollout.mode=async", "distributed.num_gpus=2", "distributed.rollout_gpus=1"]
H100 = CATALOG["h100-80gb"]


def cfg(*overrides: str):
    return load_config(None, list(overrides), base=BASE)


def test_overlapped_step_takes_the_longer_of_rollout_and_training():
    # H100 data sheet: 989 TFLOP/s bf16, 3350 GB/s, 900 GB/s link.
    work = {"decode_steps": 3000, "decode_flops_per_step": 0.0,
            "decode_bytes_per_step": 3.35e9,       # 3.35e9 / 3350e9 = 1 ms a step -> rollout 3000 x 1 ms = 3.0 s
            "train_flops": 2 * 989e12,             # 2.0 s of training
            "push_bytes": 9e9}                     # 9e9 / 900e9 = 0.01 s to push the weights (comm)
    st = roofline_step(work, H100, 1)
    assert (st.rollout, st.train, st.comm) == pytest.approx((3.0, 2.0, 0.01))
    assert st.total == pytest.approx(3.0 + 2.0 + 0.01)          # in turn: the sum
    st = roofline_step({**work, "rollout_overlaps": True}, H100, 1)
    assert st.total == pytest.approx(3.0)                        # max(3.0, 2.0 + 0.01)
    st = roofline_step({**work, "rollout_overlaps": True, "train_flops": 4 * 989e12}, H100, 1)
    assert st.total == pytest.approx(4.01)                       # max(3.0, 4.0 + 0.01)


def test_plan_sizes_the_rollout_gpu_and_the_training_gpu_apart():
    one, split = plan(cfg(), gpu="h100"), plan(cfg(*SPLIT), gpu="h100")
    assert one.devices == {} and split.devices == {"train": [0], "rollout": [1]}
    items = {i.name: i for i in split.items}
    weights = next(i.train for i in one.items if i.name.startswith("policy weights"))
    copy = items["async worker's copy of the policy (whole, on the rollout GPU)"]
    ref = next(i for i in split.items if i.name.startswith("reference policy (frozen copy"))
    kv = next(i for i in split.items if i.name.startswith("KV cache"))
    # The worker's copy is whole on its GPU (full fine-tuning: every weight), the reference is there too
    # (only the worker scores with it), and so is the KV cache; none of them is on the training GPU.
    assert (copy.rollout, copy.train) == (weights, 0)
    assert ref.rollout == weights and ref.train == 0
    assert kv.rollout > 0 and kv.train == 0
    # The trainer's states are on the training GPU only.
    pol = next(i for i in split.items if i.name.startswith("policy weights"))
    assert (pol.rollout, pol.train) == (0, weights)
    # The rollout GPU's scoring phase: what it holds through both phases plus the reference forward.
    resident = copy.rollout + ref.rollout + (kv.rollout if "CUDA graphs" in kv.name else 0)
    assert split.phases["scoring"].allocated == resident + split.substeps["reference forward"]
    # The training GPU no longer holds the reference copy nor the engine's cache.
    assert split.phases["train"].allocated < one.phases["train"].allocated


def test_split_work_moves_the_reference_forward_and_adds_the_push():
    one = plan(cfg("rollout.mode=async"), gpu="h100").work   # the same step on one device (1 process)
    split = plan(cfg(*SPLIT), gpu="h100").work
    moved = split["prefill_flops"] - one["prefill_flops"]
    assert moved > 0 and split["train_flops"] == pytest.approx(one["train_flops"] - moved)
    assert split["rollout_overlaps"] is True and "rollout_overlaps" not in one
    p = plan(cfg(*SPLIT), gpu="h100")
    assert split["push_bytes"] == p.trainable_params * 4    # full fine-tuning of the fp32 preset: 4 bytes a weight
    k0 = plan(cfg(*SPLIT, "rollout.max_staleness=0"), gpu="h100").work
    assert k0["rollout_overlaps"] is False                  # k = 0 waits for the push: in turn


def test_compare_splits_times_each_split_and_suggests_only_what_train_runs():
    two = compare_splits(cfg("distributed.num_gpus=2"), H100)
    assert [(o.rollout_gpus, o.train_gpus, o.runs) for o in two] == [(0, 2, True), (1, 1, True)]
    mine = plan(cfg(*SPLIT), gpu="h100")
    assert two[1].step.total == pytest.approx(estimate(mine.work, H100, 1).total)   # timed as it is planned
    assert two[1].step.overlapped and two[1].fits
    four = compare_splits(cfg("distributed.num_gpus=4"), H100)
    assert [o.rollout_gpus for o in four] == [0, 1, 2, 3]
    assert not any(o.runs for o in four[1:])                # one rollout GPU beside one training GPU only
    # 2 of 4 GPUs rolling out, not run yet: its rollout is the sync rollout on 2 GPUs (the batch over 2),
    # its training the sync training on the other 2, overlapped: max(rollout, train + comm).
    st, sync2 = four[2].step, two[0].step
    assert (st.rollout, st.train, st.comm) == (sync2.rollout, sync2.train, sync2.comm)
    assert st.total == max(sync2.rollout, sync2.train + sync2.comm)
    assert suggest_split(four) is None or suggest_split(four).rollout_gpus == 0


def _opt(k: int, total: float, runs=True, fits=True) -> SplitOption:
    return SplitOption(k, 2 - k, StepTime(total, 0.0, 0.0), fits, runs)


def test_suggestion_is_the_fastest_run_and_fitting_split_beyond_the_tie():
    assert suggest_split([_opt(0, 10.0), _opt(1, 9.8)]).rollout_gpus == 1   # 2% faster
    assert suggest_split([_opt(0, 10.0), _opt(1, 9.95)]) is None            # within 1%: sync stays
    assert suggest_split([_opt(0, 10.0), _opt(1, 5.0, runs=False)]) is None
    assert suggest_split([_opt(0, 10.0), _opt(1, 5.0, fits=False)]) is None
    assert suggest_split([_opt(0, 10.0, fits=False), _opt(1, 12.0)]).rollout_gpus == 1   # sync does not fit
    # from an async config: back to sync when sync is faster beyond the tie
    assert suggest_split([_opt(0, 9.8), _opt(1, 10.0)], current=1).rollout_gpus == 0
    assert suggest_split([_opt(0, 9.95), _opt(1, 10.0)], current=1) is None


def test_fit_and_hardware_show_the_splits(tmp_path):
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump({**BASE, "distributed": {"num_gpus": 2}}))
    res = CliRunner().invoke(app, ["fit", str(path), "--gpu", "h100", "--json", "-o", str(tmp_path / "out")])
    assert res.exit_code == 0, res.output
    d = json.loads(res.output)
    assert [s["setup"] for s in d["splits"]] == ["sync: 2 GPU(s) roll out and train in turn",
                                                  "async: 1 rollout GPU(s) + 1 training GPU(s)"]
    fastest = min(d["splits"], key=lambda s: s["step_s"])
    sync = d["splits"][0]["step_s"]
    want = fastest if fastest["rollout_gpus"] and fastest["step_s"] * 1.01 < sync else None
    assert d["split_suggestion"] == want
    for s in d["splits"]:   # what is marked as run, the config accepts as written (a refusal raises)
        assert s["runs"] and cfg(*s["overrides"]).distributed.rollout_gpus == s["rollout_gpus"]
    res = CliRunner().invoke(app, ["hardware", str(path), "--json"])
    assert res.exit_code == 0, res.output
    rows = [r for r in json.loads(res.output) if "async" in r["setup"]]
    # one async row per card, at 2 GPUs only: the split `train` runs
    assert rows and {r["num_gpus"] for r in rows} == {2} and len(rows) == len({r["gpu"] for r in rows})
    assert all("distributed.rollout_gpus=1" in r["note"] for r in rows)
    assert find_gpu("h100").key in {r["gpu"] for r in rows}


def test_chart_names_each_phase_by_its_gpu_and_its_segments_sum_to_it():
    from trainfit.plan.chart import bars

    c = bars(plan(cfg(*SPLIT), gpu="h100"))
    assert [b.phase for b in c.bars] == ["rollout (GPU 1)", "scoring (GPU 1)", "train (GPU 0)"]
    assert c.peak_phase in [b.phase for b in c.bars] and "1 training GPU + 1 rollout GPU" in c.title
    for b in c.bars:
        assert sum(s.gib for s in b.segments) == pytest.approx(b.total_gib)


def test_async_sharing_the_planned_gpu_runs_in_turn_and_says_so():
    from trainfit.plan.memory import verdict

    def overlapped(c) -> bool:
        return estimate(plan(c, gpu="h100").work, find_gpu("h100"), c.world_size).overlapped

    shared = plan(cfg("rollout.mode=async"), gpu="h100")   # train.device=auto on the card planned
    assert verdict(shared) == "FITS" and shared.problems == []
    note = next(n for n in shared.notes if "shares cuda" in n)
    assert "distributed.rollout_gpus=1" in note
    # One card: sampling queues behind training, so the step is timed as the sum, as sync's is.
    assert not overlapped(cfg("rollout.mode=async")) and overlapped(cfg(*SPLIT))
    assert not any("shares" in n for n in plan(cfg("rollout.mode=async", "train.device=cpu"), gpu="h100").notes)
    assert not any("shares" in n for n in plan(cfg(*SPLIT), gpu="h100").notes)
