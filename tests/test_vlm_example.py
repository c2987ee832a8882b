"""examples/vlm_tiny.yaml as a user runs it: SFT then GRPO on the shapes task with preset:vlm-tiny on a
CPU; after SFT held-out accuracy is well above chance (25%) and GRPO raises it further. The fast tests
check the task behind it: a held-out set large enough to measure that, never trained on.
Slow (minutes): `.venv/bin/python -m pytest -m slow tests/test_vlm_example.py`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainfit.tasks.shapes import QUAD, SIZE, ShapesTask

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "vlm_tiny.yaml"


def _key(ex) -> tuple:
    return tuple(map(tuple, ex.fields["layout"]))


def test_example_holds_out_enough_distinct_images_never_trained_on():
    num_eval = yaml.safe_load(EXAMPLE.read_text())["task"]["num_eval"]
    assert num_eval >= 200   # one item is at most half a point of accuracy
    task = ShapesTask(seed=0, num_eval=num_eval)
    held = [_key(ex) for ex in task.eval_examples()]
    assert len(set(held)) == num_eval
    # Far more layouts than any run trains on (SFT + GRPO prompts are a few thousand).
    assert ShapesTask.num_layouts() > 1000 * num_eval
    train = {_key(task.train_example(i)) for i in range(2000)}
    assert len(train) > 1900 and not train & set(held)


def test_training_stream_skips_a_held_out_layout_it_draws(monkeypatch):
    import trainfit.tasks.shapes as shapes

    task = ShapesTask(seed=0, num_eval=8)
    held = task._eval[0][0]
    drawn = iter([held, held])   # the stream's first draws are a held-out layout
    real = shapes._layout
    monkeypatch.setattr(shapes, "_layout", lambda rng: next(drawn, None) or real(rng))
    ex = task.train_example(0)
    assert _key(ex) != held


def test_layouts_keep_each_shape_inside_one_quadrant():
    task = ShapesTask(seed=1, num_eval=300)
    quads = set()
    for ex in task.eval_examples():
        boxes = ex.fields["layout"]
        q = [((x0 // QUAD), (y0 // QUAD)) for _, _, x0, y0, _ in boxes]
        for (_, _, x0, y0, s), (qx, qy) in zip(boxes, q):
            assert (x0 + s - 1) // QUAD == qx and (y0 + s - 1) // QUAD == qy and x0 + s <= SIZE
        assert q[0] != q[1]
        quads.add(tuple(q))
    assert len(quads) == 12   # side by side, stacked and diagonal, both orders


@pytest.mark.slow
def test_vlm_example_sft_then_grpo_raises_held_out_accuracy(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "trainfit.app.cli", "train", str(EXAMPLE), "train.device=cpu",
                        f"run_dir={tmp_path}", "logging.progress=false"],
                       capture_output=True, text=True, timeout=1800, cwd=ROOT, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    acc = json.loads((tmp_path / "summary.json").read_text())["accuracy"]
    assert acc["after sft"] >= 0.45   # chance is 0.25
    assert acc["after grpo"] > acc["after sft"]
    assert "held-out accuracy" in p.stdout
