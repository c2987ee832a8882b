"""What a run records about itself: per-step phase times and memory, planned vs used memory per
phase in metrics.jsonl and summary.json (numbers, not strings), and tables readable when piped."""

from __future__ import annotations

import io
import json
import time

import torch
from rich.console import Console

from conftest import tiny_config
from trainfit.train import memstats
from trainfit.train.report import MetricsLogger, print_table, read_metrics, summary_table
from trainfit.train.run import run_pipeline

QUIET = Console(file=io.StringIO())
GiB = 1024 ** 3


def test_grpo_run_records_phase_times_memory_and_planned_vs_used(tmp_path):
    # beta > 0: a reference forward runs in the scoring phase and every sample is trained.
    cfg = tiny_config(tmp_path, "grpo", **{"grpo.beta": 0.04})
    run_pipeline(cfg, console=QUIET)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        for bucket in ("generate", "rewards", "logprobs", "forward_backward", "optimizer"):
            assert isinstance(r[f"time_{bucket}_s"], float) and r[f"time_{bucket}_s"] >= 0.0
        assert r["time_generate_s"] > 0 and r["time_forward_backward_s"] > 0
        # On CPU the used figure is the process's sampled RSS, named so (never gpu_mem_* here).
        for ph in ("rollout", "scoring", "train"):
            assert r[f"cpu_rss_sampled_{ph}_gib"] > 0.05   # a torch process holds > 50 MiB
        assert r["cpu_rss_sampled_gib"] >= max(r[f"cpu_rss_sampled_{ph}_gib"] for ph in ("rollout", "train"))
        assert not any(k.startswith("gpu_mem") for k in r)
    mem_rows = [r for r in rows if r["kind"] == "memory"]
    assert len(mem_rows) == 1 and mem_rows[0]["step"] == 2

    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    stage = summary["stages"][0]
    phases = stage["memory"]["phases"]
    assert set(phases) == {"rollout", "scoring", "train"}
    # The planned figures are the planner's own for this config (its allocated bytes per phase).
    from trainfit.plan import plan

    p = plan(cfg, suggest=False)
    assert p.phases["train"].step in ("policy forward/backward", "optimizer step")
    assert abs(phases["train"]["planned_gib"] - p.phases["train"].allocated / GiB) < 1e-6
    assert abs(phases["rollout"]["planned_gib"] - p.phases["rollout"].allocated / GiB) < 1e-6
    resident = p.phases["train"].allocated - max(p.substeps.values())
    assert abs(phases["scoring"]["planned_gib"] - (resident + p.substeps["reference forward"]) / GiB) < 1e-6
    for m in phases.values():
        assert isinstance(m["planned_gib"], float) and isinstance(m["used_gib"], float)
        assert m["error"] is None  # CPU RSS is not the plan's tensor bytes: no error claimed
    assert "RSS" in stage["memory"]["basis"]
    assert stage["memory"]["time_s"]["generate"] > 0


def test_summary_json_holds_numbers_and_memory_per_stage(tmp_path):
    cfg = tiny_config(tmp_path, "sft", **{"stages": "[{stage: sft}, {stage: grpo}]"})
    run_pipeline(cfg, console=QUIET)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    sft, grpo = summary["stages"]
    for s in (sft, grpo):
        assert isinstance(s["steps"], int) and isinstance(s["seconds"], float) and isinstance(s["loss"], float)
        assert isinstance(s["accuracy_before"], float) and isinstance(s["accuracy_after"], float)
        assert 0.0 <= s["accuracy_after"] <= 1.0
    assert isinstance(grpo["reward"], float) and sft["reward"] is None
    assert set(sft["memory"]["phases"]) == {"train"}        # SFT has no rollout
    assert {"forward_backward", "optimizer", "data"} <= set(sft["memory"]["time_s"])
    assert all(isinstance(v, float) for v in summary["accuracy"].values())


def test_a_failing_planner_never_stops_training(tmp_path, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("planner broke")

    monkeypatch.setattr(memstats, "plan", broken)   # the planner as memstats calls it
    cfg = tiny_config(tmp_path, "sft", **{"train.max_steps": 1})
    run_pipeline(cfg, console=QUIET)
    mem = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r["kind"] == "memory"][0]
    assert "planner broke" in mem["plan_error"] and mem["planned_train_gib"] is None
    assert mem["used_train_gib"] > 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stages"][0]["memory"]["phases"]["train"]["planned_gib"] is None


def test_step_meter_attributes_peaks_and_time_to_phases():
    meter = memstats.StepMeter("cpu")
    with meter.step():
        with memstats.phase("rollout", "generate"):
            x = torch.ones(64 * 1024 * 1024 // 4 * 4)   # 256 MiB, held for a few samples
            time.sleep(0.05)
            del x
        with memstats.phase("train", "optimizer"):
            time.sleep(0.01)
    m = meter.step_metrics()
    assert m["cpu_rss_sampled_rollout_gib"] - m["cpu_rss_sampled_train_gib"] > 0.2
    assert m["cpu_rss_sampled_gib"] >= m["cpu_rss_sampled_rollout_gib"]
    assert m["time_generate_s"] >= 0.05 and 0.01 <= m["time_optimizer_s"] < m["time_generate_s"]
    # Outside a measured step, marking a phase does nothing.
    with memstats.phase("rollout", "generate"):
        pass
    assert meter.stage_time["generate"] == m["time_generate_s"]


def test_summary_table_is_not_wrapped_when_piped():
    out = io.StringIO()
    console = Console(file=out, width=80)   # not a terminal: rich would fit 80 columns
    path = "/a/rather/long/run/directory/that/does/not/fit/in/eighty/columns/0-sft/final"
    rows = [{"stage": "sft", "steps": 1500, "seconds": 115.2, "accuracy_before": 0.0, "accuracy_after": 0.286,
             "loss": 0.51234, "reward": None, "output": path}]
    print_table(console, summary_table(rows))
    text = out.getvalue()
    assert any("accuracy before" in ln and "final reward" in ln for ln in text.splitlines())
    assert any(path in ln and "28.6%" in ln and "0.5123" in ln for ln in text.splitlines())
    assert console.width == 80   # the console is left as it was


def test_metrics_jsonl_keeps_small_and_large_values_at_full_precision(tmp_path):
    # A DPO margin of 8.4321e-06 read back as 8e-06 with six decimals, 4.2e-08 as 0.0, and a token count
    # rounded to significant digits would lose its units: every value comes back exactly as logged.
    values = {"margin": 8.4321e-06, "tiny": 4.2e-08, "loss": 0.6931471824645996, "tokens": 123456789.0, "steps": 3}
    logger = MetricsLogger(tmp_path)
    logger.log(1, values)
    row, = read_metrics(tmp_path / "metrics.jsonl")
    assert {k: row[k] for k in values} == values
