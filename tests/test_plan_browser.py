"""`trainfit plan --html` pages opened in headless Chromium: the labels plotly.js drew (their real bounding
boxes, read from the page) overlap neither each other nor the peak marker, and none but a block's own label sits
on a bar; the CPU RAM bar and the header are drawn. `browser` tests: deselected by `make test`, run by
`make test-cua` (Chromium is the OS's)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.browser import Page, have_chromium  # noqa: E402

pytestmark = [pytest.mark.browser, pytest.mark.skipif(not have_chromium(), reason="needs Chromium")]

# Per figure: each annotation's role and box (its text), the peak marker's box, and the bars' boxes.
BOXES = """Array.from(document.querySelectorAll('.chart')).map(function (d) {
  var box = function (e) { var r = e.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; };
  var notes = d.layout.annotations;
  return {id: d.id,
          labels: Array.from(d.querySelectorAll('g.annotation')).map(function (g) {
            var t = g.querySelector('text');
            return {role: notes[+g.getAttribute('data-index')].name, text: t.textContent, box: box(t)};
          }),
          peak: Array.from(d.querySelectorAll('.scatterlayer path.point')).map(box),
          bars: Array.from(d.querySelectorAll('.barlayer path')).map(box),
          axes: Array.from(d.querySelectorAll('.g-ytitle, .g-y2title')).map(function (e) { return e.textContent; })};
})"""


def _overlap(a, b, tol=0.5) -> bool:
    return a[0] < b[2] - tol and b[0] < a[2] - tol and a[1] < b[3] - tol and b[1] < a[3] - tol


@pytest.mark.parametrize("example,gpu", [("ppo_7b_full.yaml", None), ("sft_7b_zero2_offload.yaml", "a800-80gb"),
                                         ("cua_grpo_single_gpu.yaml", "h200")])
def test_plan_page_labels_do_not_overlap(tmp_path, monkeypatch, example, gpu):
    from typer.testing import CliRunner

    from trainfit.app.cli import app

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    page_path = tmp_path / "plan.html"
    r = CliRunner().invoke(app, ["plan", str(ROOT / "examples" / example), *(["--gpu", gpu] if gpu else []),
                                 "--json", "--html", str(page_path)])
    assert r.exit_code == 0, r.output + repr(r.exception)
    p = json.loads(r.output)
    with Page(page_path) as page:
        page.settle(1.0)
        (fig,) = page.eval(BOXES)
        assert page.errors == []
    labels, (peak,) = fig["labels"], fig["peak"]
    assert len(labels) > 20 and fig["bars"]
    boxes = [(lb["text"], lb["box"]) for lb in labels] + [("peak marker", peak)]
    assert [(a, b) for i, (a, ba) in enumerate(boxes) for b, bb in boxes[i + 1:] if _overlap(ba, bb)] == []
    on_bars = [lb["text"] for lb in labels if lb["role"] != "block" and any(_overlap(lb["box"], b) for b in fig["bars"])]
    assert on_bars == []
    texts = " ".join(lb["text"] for lb in labels)
    assert "Parallelism:" in texts and "Parameters" in texts and "needed on the training machine" in texts
    assert any("CPU RAM per node" in a for a in fig["axes"])     # the CPU RAM bar's axis, beside the GPU's
    if p["cpu_ram"]:   # the offload, in GiB as the text plan prints it
        assert f"{p['cpu_ram'] / 2 ** 30:,.2f} GiB" in texts
