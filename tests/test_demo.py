"""The demo as a user runs it: SFT then GRPO, and GRPO must beat the post-SFT held-out accuracy.
Slow (minutes): `.venv/bin/python -m pytest -m slow tests/test_demo.py`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_grpo_beats_sft(tmp_path):
    p = subprocess.run([sys.executable, "-m", "trainfit.app.cli", "train", str(ROOT / "examples/demo.yaml"), "train.device=cpu",
                        f"run_dir={tmp_path}", "logging.progress=false"],
                       capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:]
    acc = json.loads((tmp_path / "summary.json").read_text())["accuracy"]
    assert acc["after grpo"] > acc["after sft"] > acc["before sft"]
    assert "held-out accuracy" in p.stdout
    assert (tmp_path / "metrics.png").is_file()
    assert (tmp_path / "1-grpo" / "final" / "model.safetensors").is_file()
