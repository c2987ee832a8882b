"""--gpu names: catalog names and their listed aliases in any case and punctuation, nothing else. A name
that only looks like a card (`a100-40`, `h1000`) exits 2 naming the nearest cards; it was once planned
as an A100 80GB and an H100 (a substring match)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from trainfit.app.cli import app
from trainfit.config import HardwareConfig
from trainfit.plan.hardware import CATALOG, RANKED, find_gpu, from_device_name, resolve_gpu

DEMO = "examples/demo.yaml"


@pytest.mark.parametrize("name,key", [
    ("h100", "h100-80gb"), ("H100-80GB", "h100-80gb"), ("H100 80GB", "h100-80gb"), ("a100-80gb", "a100-80gb"),
    ("A100_40GB", "a100-40gb"), ("rtx4090", "rtx4090"), ("RTX-4090", "rtx4090"), ("GeForce RTX 3090", "rtx3090"),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb"), ("H200", "h200"), ("h800", "h800-80gb"), ("H100 PCIe", "h100-pcie"),
    ("RTX A6000", "rtx-a6000"), ("L4", "l4"),
])
def test_catalog_names_and_aliases_in_any_case_and_punctuation(name, key):
    assert find_gpu(name).key == key


def test_every_listed_name_and_alias_resolves_to_its_own_card():
    for g in CATALOG.values():
        for name in (g.key, g.name, g.name.upper(), *g.aliases):
            assert find_gpu(name) is g, name


@pytest.mark.parametrize("name,nearest", [("a100-40", "a100-40gb (A100 40GB)"), ("h1000", "h100-80gb (H100 80GB)"),
                                          ("a100-80", "a100-80gb (A100 80GB)")])
def test_a_name_that_only_looks_like_a_card_is_refused_naming_the_nearest_first(name, nearest):
    with pytest.raises(ValueError) as e:
        find_gpu(name)
    msg = str(e.value)
    assert f"--gpu {name!r} is an unknown GPU" in msg
    assert msg.split("nearest: ")[1].startswith(nearest), msg
    assert "48GB" in msg  # the way to plan a card the catalog lacks


def test_cards_named_but_not_ranked_are_planned_with_their_own_numbers_and_hardware_keeps_its_nine():
    # Data-sheet numbers (dense BF16 TFLOP/s, memory GB/s, GPU link GB/s) of the cards added for their names.
    assert [(find_gpu(k).bf16_tflops, find_gpu(k).bandwidth_gbs, find_gpu(k).link_gbs) for k in
            ("h100-pcie", "h800", "l40", "l4", "a6000")] == [(756.0, 2000.0, 64.0), (989.0, 3350.0, 400.0),
                                                           (181.0, 864.0, 32.0), (121.0, 300.0, 32.0),
                                                           (154.8, 768.0, 32.0)]
    assert len(RANKED) == 9 and not {"h100-pcie", "h800-80gb", "l40", "l4", "rtx-a6000"} & {g.key for g in RANKED}


def test_a_memory_size_is_still_a_generic_card():
    assert find_gpu("48GB").memory == 48e9 and find_gpu("24GiB").memory == 24 * 2**30


def test_hardware_gpu_in_the_config_goes_through_the_same_resolver():
    with pytest.raises(ValueError, match="hardware.gpu 'h1000' is an unknown GPU.*hardware.gpu=48GB"):
        resolve_gpu(None, HardwareConfig(gpu="h1000"))
    assert resolve_gpu(None, HardwareConfig(gpu="H100-80GB"))[0].key == "h100-80gb"


def test_driver_device_names_match_the_model_number_as_a_whole_word():
    # Names NVML and torch report, which carry form factors the aliases do not list.
    assert from_device_name("NVIDIA H100 80GB HBM3").key == "h100-80gb"
    assert from_device_name("NVIDIA H100 PCIe").key == "h100-pcie"
    assert from_device_name("NVIDIA A100-PCIE-40GB").key == "a100-40gb"
    assert from_device_name("NVIDIA A100 80GB PCIe").key == "a100-80gb"
    assert from_device_name("NVIDIA GeForce RTX 4090").key == "rtx4090"
    assert from_device_name("NVIDIA L4").key == "l4" and from_device_name("NVIDIA L40").key == "l40"
    assert from_device_name("NVIDIA H1000") is None and from_device_name("NVIDIA RTX A5000") is None


@pytest.mark.parametrize("argv", [
    ["plan", DEMO, "--gpu", "a100-40"], ["fit", DEMO, "--gpu", "h1000"], ["doctor", "--no-machine", "--gpu", "h1000"],
])
def test_every_command_taking_gpu_exits_2_with_one_paragraph(argv):
    r = CliRunner().invoke(app, argv)
    out = r.output.strip()
    assert r.exit_code == 2, out
    assert "Traceback" not in out and "\n" not in out, out   # one paragraph, before any planning
    assert f"--gpu {argv[-1]!r} is an unknown GPU" in out and "nearest: " in out


def test_plan_json_gives_the_gpu_error_as_a_json_object():
    r = CliRunner().invoke(app, ["plan", DEMO, "--gpu", "h1000", "--json"])
    assert r.exit_code == 2
    err = json.loads(r.stdout)
    assert err["exit_code"] == 2 and "--gpu 'h1000' is an unknown GPU" in err["error"]


def test_a_detected_card_whose_driver_name_no_catalog_name_matches_is_planned_fitted_and_advised(monkeypatch):
    # NVML's "NVIDIA A100 80GB PCIe" is the A100 80GB by model number (from_device_name) but no name --gpu
    # takes: fit and the advice re-plan that card as itself (its measured memory), never by its driver name.
    from trainfit.config import load_config
    from trainfit.plan import hardware, plan
    from trainfit.plan.fit import fit

    base = CATALOG["a100-80gb"]
    card = hardware.GPU(base.key, "NVIDIA A100 80GB PCIe", 79 * 2 ** 30, base.bf16_tflops, base.bandwidth_gbs,
                        base.link_gbs, base.aliases, detected=True, free=79 * 2 ** 30)
    monkeypatch.setattr(hardware, "detect", lambda: [card])
    with pytest.raises(ValueError):
        find_gpu(card.name)
    assert resolve_gpu(hardware.replan_as(card)) == (card, "detected (NVML)")
    cfg = load_config(None, ["train.micro_batch_size=64"], base={
        "stage": "sft", "model": {"name": "preset:tiny"}, "task": {"name": "arithmetic"},
        "train": {"global_batch_size": 64, "max_steps": 2}, "data": {"max_seq_length": 8192}})
    p = plan(cfg)
    assert (p.gpu, p.gpu_source) == (card.name, "detected (NVML)")
    res = fit(cfg)
    assert res.card is card and res.best is not None and res.best.plan.budget == res.user.plan.budget
