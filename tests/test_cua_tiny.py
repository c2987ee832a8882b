"""examples/cua_tiny.yaml as a user runs it: expert rows from the MiniWoB++ service, then SFT and multi-turn
GRPO of preset:vlm-tiny on CPU against the service on 127.0.0.1; the held-out success rate after GRPO is
clearly above the one after SFT. The fast tests check what the example reads: its task rows name the service's
tasks, and its held-out rows are evaluation instances only.
Slow (~20 minutes on 2 cores, needs Chromium): `.venv/bin/python -m pytest -m "slow and cua" tests/test_cua_tiny.py`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from cua_helpers import EnvServer, MiniWoBService, BrowserPool
from trainfit.config import expand_stages, load_config
from trainfit.config.rules import cross_field_errors

pytestmark = pytest.mark.cua
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "cua_tiny.yaml"
TASKS = ["click-test", "focus-text", "click-dialog"]


def _rows(path: str) -> list[dict]:
    return [json.loads(line) for line in (ROOT / path).read_text().splitlines()]


def test_example_rows_are_training_and_evaluation_instances_of_its_tasks():
    cfg = yaml.safe_load(EXAMPLE.read_text())
    train, held = _rows(cfg["task"]["path"]), _rows(cfg["task"]["eval_path"])
    assert {r["miniwob_task"] for r in train} == {r["miniwob_task"] for r in held} == set(TASKS)
    assert all(r.get("split", "train") == "train" for r in train) and all(r["split"] == "eval" for r in held)
    assert len(held) == cfg["task"]["num_eval"]
    # Evaluation seeds are MiniWoB seeds offset by the service (split "eval"): no held-out instance is trained on.
    assert len({(r["miniwob_task"], r["seed"]) for r in held}) == len(held)


def test_example_sft_stage_trains_on_files_and_evaluates_episodes():
    stages = expand_stages(load_config(EXAMPLE))
    assert [s.stage for s in stages] == ["sft", "grpo"]
    for s in stages:
        assert s.env.type == "http" and not cross_field_errors(s)
    sft = stages[0]
    assert sft.data.path and sft.task.name == "jsonl"
    # Without the environment the same stage would train on the task and ignore data.path: refused.
    plain = sft.model_copy(update={"env": sft.env.model_copy(update={"type": "none"})})
    assert any(r.code == "tf.data_and_task" for r in cross_field_errors(plain))


@pytest.mark.slow
def test_cua_tiny_example_grpo_raises_success_over_sft(tmp_path):
    from trainfit.envs.miniwob_rows import write_expert_rows

    cfg = yaml.safe_load(EXAMPLE.read_text())
    pool = BrowserPool(32)   # the example's --pool 32: one browser per episode of a GRPO step
    service = MiniWoBService(TASKS, pool, episode_timeout_s=600)
    server = EnvServer(service).start()
    try:
        # What `trainfit env expert miniwob --tasks ... --seeds 0-127` writes (the example's first command).
        rows, written, tried = write_expert_rows(service, TASKS, range(128), tmp_path / "data")
        assert written == tried == 3 * 128
        cfg["run_dir"] = str(tmp_path / "run")
        cfg["env"]["url"] = server.url
        cfg["stages"][0]["data"]["path"] = str(rows)
        cfg["logging"]["progress"] = False
        (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        p = subprocess.run([sys.executable, "-m", "trainfit.app.cli", "train", str(tmp_path / "cfg.yaml")],
                           capture_output=True, text=True, timeout=3600, cwd=ROOT, env=env)
    finally:
        server.stop()
        pool.close()
    assert p.returncode == 0, p.stderr[-3000:]
    acc = json.loads((tmp_path / "run" / "summary.json").read_text())["accuracy"]
    assert acc["before sft"] == 0.0            # a random policy writes no valid action
    assert acc["after sft"] > 0.0
    # A clear margin: 5 points, 8 of the 150 held-out episodes more than after SFT (a few are within its noise).
    assert acc["after grpo"] >= acc["after sft"] + 0.05
    assert "held-out accuracy" in p.stdout
