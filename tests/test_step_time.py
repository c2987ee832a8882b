"""The calibrated step-time estimate (trainfit/plan/steptime.py) against the H100 trainer runs.

Each trainer case of bench/results/gpu_h100_2026-11-22.json is rebuilt as tests/test_plan_h100.py
rebuilds it, planned on h100-80gb, and its estimate compared with the measured median step (the
first, warm-up step left out). The constants in plan/data/efficiency.json were fitted on these same
runs by bench/calibrate.py, so this checks that the model and the stored constants describe them;
bench/calibrate.py prints the leave-one-out errors.
"""

import statistics

import pytest
from test_plan_h100 import CASES, bpe_tokenizer, build_cases

from trainfit.config import validate
from trainfit.plan import plan
from trainfit.plan.hardware import find_gpu, roofline_step
from trainfit.plan.steptime import estimate


@pytest.fixture(scope="module")
def h100_cases(tmp_path_factory):
    return build_cases(tmp_path_factory.mktemp("h100-steps"), bpe_tokenizer())


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c["case"] for c in CASES])
def test_estimate_within_30_percent_of_h100_steps(h100_cases, index):
    case, raw = h100_cases[index]
    p = plan(validate(raw), gpu="h100-80gb", suggest=False)
    st = estimate(p.work, find_gpu("h100-80gb"), p.world)
    measured = statistics.median(case["step_time_s"][1:])
    assert abs(st.total / measured - 1) <= 0.30, f"{case['case']}: estimated {st.total:.3f} s, measured {measured:.3f} s"
    assert st.basis.startswith("calibrated on H100 80GB, 2026-11-22")
    # The roofline alone is what this replaces: at least 1.5x under every measured step.
    assert roofline_step(p.work, find_gpu("h100-80gb"), p.world).total * 1.5 < measured


def test_uncalibrated_gpu_gets_a_labelled_estimate(h100_cases):
    case, raw = next((c, r) for c, r in h100_cases if r["stage"] == "grpo")
    p = plan(validate({**raw, "hardware": {"gpu": "rtx4090"}}), gpu="rtx4090", suggest=False)
    card = find_gpu("rtx4090")
    st = estimate(p.work, card, 1)
    assert "uncalibrated" in st.basis and "RTX 4090" in st.basis
    assert st.total > roofline_step(p.work, card, 1).total > 0
    # Decoding is host-bound (the same seconds per layer on any card); training scales with the card.
    h100 = estimate(p.work, find_gpu("h100-80gb"), 1)
    assert st.train > h100.train and st.rollout == pytest.approx(h100.rollout, rel=0.2)


def test_hardware_and_fit_print_the_basis(tmp_path):
    import json
    from pathlib import Path

    from typer.testing import CliRunner

    from trainfit.app.cli import app

    example = Path(__file__).resolve().parents[1] / "examples" / "qwen3_8b_grpo_lora_h200.yaml"
    r = CliRunner().invoke(app, ["hardware", str(example), "--json"])
    assert r.exit_code == 0, r.output
    rows = [x for x in json.loads(r.output) if x["step_s"]]
    by_gpu = {x["gpu"]: x["step_basis"] for x in rows}
    assert by_gpu["h100-80gb"].startswith("calibrated on H100") and "uncalibrated" in by_gpu["h200"]
    r = CliRunner().invoke(app, ["fit", str(example), "--gpu", "h100", "-o", str(tmp_path / "f"), "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    assert res["fitted"]["step_s_basis"].startswith("calibrated on H100 80GB")
    assert "calibrated on H100 80GB" in res["step_time_note"]
