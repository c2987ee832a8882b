"""Small things users notice: counts agree with their nouns ("1 device", "8 GPUs", "1 combination pruned"), a
plan over its budget says by how much rather than printing a negative headroom, and `--json` gives its
errors as a JSON object. On the tiny preset, planned for cards named by size (no GPU needed)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from rich.console import Console
from typer.testing import CliRunner

from trainfit.app.cli import app
from trainfit.config import ConfigError, load_config
from trainfit.config.words import count

BASE = {"stage": "sft", "model": {"name": "preset:tiny"}, "task": {"name": "arithmetic"},
        "train": {"global_batch_size": 8, "micro_batch_size": 8, "device": "cpu"}}


def test_count_agrees_with_its_noun():
    assert [count(n, "device") for n in (0, 1, 2)] == ["0 devices", "1 device", "2 devices"]
    assert count(1, "planner call") == "1 planner call" and count(3, "entry", "entries") == "3 entries"


def test_the_batch_rule_says_one_device():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.micro_batch_size=3"], base=BASE)
    assert "(train.global_batch_size=8 / 1 device)" in str(e.value)


def test_fit_says_gpus_planner_calls_and_pruned_combinations_in_agreement():
    from trainfit.app.fit_report import explain, knobs
    from trainfit.plan.fit import fit

    eight = load_config(None, ["distributed.num_gpus=8", "train.global_batch_size=64"], base=BASE)
    assert knobs(eight)["micro-batch"] == "8 x accum 1 x 8 GPUs"
    assert knobs(load_config(None, [], base=BASE))["micro-batch"] == "8 x accum 1 x 1 GPU"
    res = fit(load_config(None, [], base=BASE), gpu="h100")
    last = explain(dataclasses.replace(res, plan_calls=1, pruned=1))[-1]
    assert last.startswith("Searched with 1 planner call (1 combination pruned) in "), last
    last = explain(dataclasses.replace(res, plan_calls=3, pruned=0))[-1]
    assert last.startswith("Searched with 3 planner calls (0 combinations pruned) in "), last


def test_a_plan_over_its_budget_says_by_how_much():
    from trainfit.plan import plan
    from trainfit.plan.report import render

    p = plan(load_config(None, [], base=BASE), gpu="0.01GB", suggest=False)   # a card far too small
    assert p.headroom < 0
    console = Console(record=True, width=200)
    render(p, console)
    text = console.export_text()
    over = f"{-p.headroom / 2**30:,.2f}"
    assert f"DOES NOT FIT - peak {p.peak / 2**30:,.2f} GiB (over the budget by {over} GiB)" in text, text
    assert "headroom -" not in text and "1 GPU" in text and "1 GPUs" not in text


def test_plan_json_gives_a_config_error_as_a_json_object(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("stage: sft\nmodel: {name: 'preset:tiny'}\ntask: {name: arithmetic}\ngrpo: {group_size: 8}\n")
    r = CliRunner().invoke(app, ["plan", str(cfg), "--json"])
    assert r.exit_code == 2
    err = json.loads(r.stdout)
    assert err == {"error": "Unknown config key 'grpo.group_size': trainfit calls the group size "
                            "grpo.num_generations: write grpo.num_generations=8.", "exit_code": 2}
