"""The plan and fit pages (`plan --html`, `fit --html`), and report.html and replay.html of short real CPU runs
(train.device=cpu), opened in headless Chromium: no console error, the charts plotly.js drew hold the plan's and
metrics.jsonl's numbers (read from each chart div's data, not from pixels), and the episode replay shows its
screenshots with the click drawn where it landed.
`browser` tests: deselected by `make test`, run by `make test-cua` (Chromium is the OS's)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.browser import Page, have_chromium  # noqa: E402
from report_helpers import assert_curves_hold_metrics, demo_run, screen_run  # noqa: E402
from trainfit.train.report import read_metrics  # noqa: E402
from trainfit.train.report_html import write_report  # noqa: E402

pytestmark = [pytest.mark.browser, pytest.mark.skipif(not have_chromium(), reason="needs Chromium")]

DRAWN = """Array.from(document.querySelectorAll('.chart')).map(function (d) {
  return {id: d.id, svg: d.querySelectorAll('.main-svg').length,
          traces: (d.data || []).map(function (t) { return {meta: t.meta, x: Array.from(t.x), y: Array.from(t.y)}; })};
})"""


def test_demo_report_renders_and_its_charts_hold_the_metrics(tmp_path):
    run = tmp_path / "demo"
    r = demo_run(run)
    assert r.exit_code == 0, r.output + repr(r.exception)
    with Page(run / "report.html") as page:
        page.settle(1.0)
        charts = page.eval(DRAWN)
        assert page.errors == []
    assert [c["id"] for c in charts] == ["fig-curves", "fig-memory", "fig-time", "fig-throughput"]
    assert all(c["svg"] >= 1 and c["traces"] for c in charts)   # plotly.js drew every chart
    by_id = {c["id"]: c["traces"] for c in charts}
    assert_curves_hold_metrics(by_id["fig-curves"], run)
    for name in ("0-sft", "1-grpo"):
        rows = read_metrics(run / name / "metrics.jsonl")
        train = [m for m in rows if m["kind"] == "train"]
        (mem,) = [m for m in rows if m["kind"] == "memory"]
        for t in by_id["fig-memory"]:
            if t["meta"]["stage"] == name:
                ph = t["meta"]["phase"]
                want = ([mem[f"planned_{ph}_gib"]] * 2 if t["meta"]["what"] == "planned"
                        else [m[f"cpu_rss_sampled_{ph}_gib"] for m in train])
                assert t["y"] == want


def test_screen_run_replay_shows_its_screenshots(tmp_path):
    r = screen_run(tmp_path / "run")
    assert r.exit_code == 0, r.output + repr(r.exception)
    with Page(tmp_path / "run" / "report.html") as page:
        page.settle(0.5)
        href = page.eval("document.getElementById('replay-link').href")
        assert page.errors == []
    assert href.endswith("/replay.html")
    with Page(tmp_path / "run" / "replay.html") as page:
        page.eval("document.querySelectorAll('img').forEach(function (i) { i.loading = 'eager'; })")
        shots = page.eval("""new Promise(function (done) {
          var imgs = Array.from(document.querySelectorAll('section.episode img'));
          var check = function () {
            if (imgs.every(function (i) { return i.complete; })) {
              done(imgs.map(function (i) { return [i.naturalWidth, i.naturalHeight]; }));
            } else { setTimeout(check, 50); }
          };
          check();
        })""")
        sections = page.eval("document.querySelectorAll('section.episode').length")
        assert page.errors == []
    assert sections == 8 and len(shots) >= 8 and all(s == [160, 120] for s in shots)


def test_click_lands_where_the_action_says_and_the_filter_hides_by_reward(tmp_path):
    from PIL import Image

    screens = tmp_path / "screens"
    screens.mkdir()
    sha = "ab" * 32
    Image.new("RGB", (200, 100), (255, 255, 255)).save(screens / f"{sha[:32]}.png")
    eps = [{"step": 1, "reward": r, "turns": 1, "messages": [
        {"role": "user", "content": "Click.<image>", "image_hashes": [sha]},
        {"role": "assistant", "content": "click(150, 25)"}]} for r in (1.0, -0.1)]
    (tmp_path / "transcripts.jsonl").write_text("".join(json.dumps(e) + "\n" for e in eps))
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "kind": "train", "loss": 1.0}) + "\n")
    write_report(tmp_path)
    with Page(tmp_path / "replay.html") as page:
        page.settle(0.5)
        where = page.eval("""(function () {
          var s = document.querySelector('section.episode'), img = s.querySelector('img').getBoundingClientRect();
          var c = s.querySelector('circle.click').getBoundingClientRect();
          return [(c.left + c.width / 2 - img.left) / img.width, (c.top + c.height / 2 - img.top) / img.height];
        })()""")
        page.eval("var f = document.getElementById('max-reward'); f.value = '0'; f.dispatchEvent(new Event('input'))")
        shown = page.eval("Array.from(document.querySelectorAll('section.episode'))"
                          ".filter(function (s) { return s.style.display !== 'none'; })"
                          ".map(function (s) { return s.dataset.reward; })")
        assert page.errors == []
    assert where == pytest.approx([150 / 200, 25 / 100], abs=0.01)
    assert shown == ["-0.1"]


def test_plan_page_renders_a_panel_per_stage_with_the_plans_numbers(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from trainfit.app.cli import app

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    page_path = tmp_path / "plan.html"
    r = CliRunner().invoke(app, ["plan", str(ROOT / "examples" / "dpo_tiny.yaml"), "--gpu", "rtx4090", "--json",
                                 "--html", str(page_path)])
    assert r.exit_code == 0, r.output + repr(r.exception)
    plans = json.loads(r.output)
    with Page(page_path) as page:
        page.settle(1.0)
        charts = page.eval("""Array.from(document.querySelectorAll('.chart')).map(function (d) {
          var sums = {};
          (d.data || []).forEach(function (t) {
            if (t.type === 'bar' && t.meta.axis === 'gpu') sums[t.meta.phase] = (sums[t.meta.phase] || 0) + t.y[0];
          });
          var line = d.layout.shapes.filter(function (s) { return s.name === 'capacity'; });
          return {id: d.id, svg: d.querySelectorAll('.main-svg').length, sums: sums,
                  capacity: line.length ? line[0].y0 : null,
                  above: Array.from(d.querySelectorAll('g.annotation')).map(function (g) { return g.textContent; })};
        })""")
        assert page.errors == []
    assert [c["id"] for c in charts] == ["plan-0-sft", "plan-1-dpo"]
    for p, c in zip(plans, charts):
        assert c["svg"] >= 1   # plotly.js drew it
        card = p["gpu_memory"] / 2 ** 30   # on the scale as a line, or named above a tiny config's scale
        assert c["capacity"] == pytest.approx(card) if c["capacity"] is not None else \
            any(a.startswith("above the scale") and f"{card:,.2f} GiB" in a for a in c["above"])
        assert c["sums"] == {ph: pytest.approx(v["total"] / 2 ** 30, rel=1e-9) for ph, v in p["phases"].items()}


def test_fit_page_draws_the_setups_and_both_plans(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from trainfit.app.cli import app

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    page_path = tmp_path / "fit.html"
    r = CliRunner().invoke(app, ["fit", str(ROOT / "examples" / "qwen3_4b_grpo_4bit.yaml"), "--gpu", "rtx4090",
                                 "-o", str(tmp_path / "fitted"), "--html", str(page_path)])
    assert r.exit_code == 0, r.output + repr(r.exception)
    with Page(page_path) as page:
        page.settle(1.0)
        drawn = page.eval("Array.from(document.querySelectorAll('.chart')).map(function (d) {"
                          " return [d.id, d.querySelectorAll('.main-svg').length, (d.data || []).length]; })")
        assert page.errors == []
    assert [d[0] for d in drawn] == ["setups", "plan-0-grpo", "plan-1-grpo"]
    assert all(svg >= 1 and traces for _, svg, traces in drawn)
