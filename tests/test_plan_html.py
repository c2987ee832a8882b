"""`trainfit plan --html / --png`: the page's figure JSON holds the plan's numbers (each phase's stacked
components sum to the phase's planned bytes, the capacity and budget lines sit at the card's memory and the
budget, the peak marker at the peak), with a panel per stage for a pipeline and the notes beside the bars;
`--png` writes an image PIL opens. The numbers are compared with `plan --json` of the same call."""

import html
import json
import os
import re
import tempfile
from pathlib import Path

os.environ.setdefault("TRAINFIT_CACHE", tempfile.mkdtemp(prefix="trainfit-plan-test-"))

import pytest
from PIL import Image
from typer.testing import CliRunner

pytest.importorskip("plotly")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
GiB = 2 ** 30
FIGURE = re.compile(r'<script type="application/json" data-figure="([^"]+)">(.*?)</script>', re.DOTALL)


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _plan(tmp_path, example, *extra):
    from trainfit.app.cli import app

    page = tmp_path / "plan.html"
    r = CliRunner().invoke(app, ["plan", str(EXAMPLES / example), "--json", "--html", str(page), *extra])
    assert r.exit_code == 0, r.output + repr(r.exception)
    plans = json.loads(r.output)
    text = page.read_text(encoding="utf-8")
    figures = [(fid, json.loads(spec)) for fid, spec in FIGURE.findall(text)]
    return (plans if isinstance(plans, list) else [plans]), figures, text


def _aside(text: str, fid: str) -> str:
    """What the page holds between a stage's chart and its figure JSON: the aside beside the chart."""
    return text.split(f"id='{fid}'", 1)[1].split(f'data-figure="{fid}"', 1)[0]


def _check_stage(p: dict, fig: dict, aside: str) -> None:
    sums: dict[str, dict[str, float]] = {"gpu": {}, "cpu": {}}
    for t in fig["data"]:
        if t["type"] == "bar":
            axis, phase = t["meta"]["axis"], t["meta"]["phase"]
            sums[axis][phase] = sums[axis].get(phase, 0.0) + t["y"][0]
    assert set(sums["gpu"]) == set(p["phases"])    # a bar per planned phase, scoring included
    for phase, ph in p["phases"].items():
        assert sums["gpu"][phase] == pytest.approx(ph["total"] / GiB, rel=1e-9)
    # the CPU RAM bar per node beside them: the plan's cpu_ram
    assert sum(sums["cpu"].values()) == pytest.approx(p["cpu_ram"] / GiB, rel=1e-9)
    assert fig["layout"]["meta"]["cpu_ram_gib"] == pytest.approx(p["cpu_ram"] / GiB)
    shapes = {s["name"]: s for s in fig["layout"]["shapes"]}
    above = " ".join(a["text"] for a in fig["layout"]["annotations"] if a["name"] == "offscale")
    for line, gib in (("capacity", p["gpu_memory"] / GiB), ("budget", p["budget"] / GiB)):
        if line in shapes:   # a line on the scale, at its GiB
            assert shapes[line]["y0"] == shapes[line]["y1"] == pytest.approx(gib)
        else:                # a tiny config's bars keep a readable scale: the card is named above it
            assert f"{gib:,.2f} GiB" in above.replace("<br>", " ")
    (peak,) = [t for t in fig["data"] if (t.get("meta") or {}).get("role") == "peak"]
    peak_phase = max(p["phases"], key=lambda k: p["phases"][k]["total"])
    assert peak["meta"]["phase"] == peak_phase and peak["y"] == [pytest.approx(p["peak"] / GiB)]
    assert "<aside>" in aside               # the notes sit beside this stage's chart
    for note in p["notes"]:
        assert html.escape(note) in aside


def test_plan_html_single_stage_holds_the_plan_and_png_is_written(tmp_path):
    png = tmp_path / "plan.png"
    plans, figures, text = _plan(tmp_path, "cua_grpo_single_gpu.yaml", "--gpu", "h200", "--png", str(png))
    (p,), ((fid, fig),) = plans, figures
    assert fid == "plan-0-grpo" and p["gpu_memory"] and p["notes"]
    _check_stage(p, fig, _aside(text, fid))
    assert f"id='{fid}'" in text and "Plotly.newPlot" in text   # plotly.js inlined with its loader
    with Image.open(png) as im:
        assert im.format == "PNG" and im.width > 600 and im.height > 300


def test_plan_html_pipeline_has_a_panel_per_stage(tmp_path):
    plans, figures, text = _plan(tmp_path, "dpo_tiny.yaml", "--gpu", "rtx4090")
    assert [p["stage"] for p in plans] == ["sft", "dpo"]
    assert [fid for fid, _ in figures] == ["plan-0-sft", "plan-1-dpo"]
    assert "scoring" in plans[1]["phases"]            # DPO's reference forward: the scoring bar is checked too
    for p, (fid, fig) in zip(plans, figures):
        assert fig["layout"]["meta"]["stage"] == p["stage"]
        _check_stage(p, fig, _aside(text, fid))


def _invoke_html(tmp_path, *args):
    from trainfit.app.cli import app

    page = tmp_path / "page.html"
    r = CliRunner().invoke(app, [*args, "--json", "--html", str(page)])
    assert r.exit_code == 0, r.output + repr(r.exception)
    return json.loads(r.output), {fid: json.loads(spec) for fid, spec in FIGURE.findall(page.read_text())}


def _setups(fig: dict) -> dict:
    return {t["meta"]["what"]: t for t in fig["data"]}


def test_hardware_html_shows_every_setup_peak_and_step_time(tmp_path):
    rows, figures = _invoke_html(tmp_path, "hardware", str(EXAMPLES / "qwen3_4b_grpo_4bit.yaml"))
    t = _setups(figures["setups"])
    assert t["peak_gib"]["y"] == [r["setup"] for r in rows] and len(rows) > 8
    assert t["peak_gib"]["x"] == [pytest.approx(r["peak_gb"]) if r["peak_gb"] is not None else None for r in rows]
    assert t["budget_gib"]["x"] == [pytest.approx(r["budget_gb"]) if r["budget_gb"] is not None else None
                                    for r in rows]
    assert t["step_s"]["x"] == [pytest.approx(r["step_s"]) if r["step_s"] is not None else None for r in rows]


def test_fit_html_shows_your_config_beside_the_fitted_one(tmp_path):
    d, figures = _invoke_html(tmp_path, "fit", str(EXAMPLES / "qwen3_4b_grpo_4bit.yaml"), "--gpu", "rtx4090",
                              "-o", str(tmp_path / "fitted"))
    t = _setups(figures["setups"])
    assert t["peak_gib"]["y"][:2] == ["your config", "fitted"]
    assert t["peak_gib"]["x"][:2] == [pytest.approx(d["user"]["peak_gib"]), pytest.approx(d["fitted"]["peak_gib"])]
    assert t["step_s"]["x"][:2] == [pytest.approx(d["user"]["step_s_estimate"]),
                                    pytest.approx(d["fitted"]["step_s_estimate"])]
    # the two plans below, each its own panel with its peak
    assert [figures[f"plan-{i}-grpo"]["layout"]["meta"]["peak_gib"] for i in (0, 1)] == \
        [pytest.approx(d["user"]["peak_gib"]), pytest.approx(d["fitted"]["peak_gib"])]


@pytest.mark.parametrize("cmd", ["plan", "fit", "hardware"])
def test_html_into_a_missing_folder_is_a_user_error(tmp_path, cmd):
    from trainfit.app.cli import app

    r = CliRunner().invoke(app, [cmd, str(EXAMPLES / "qwen3_4b_grpo_4bit.yaml"), "--html",
                                 str(tmp_path / "nowhere" / "page.html")])
    assert r.exit_code == 2 and "--html" in r.output and "does not exist" in r.output
    assert r.exception is None or isinstance(r.exception, SystemExit)   # no traceback
