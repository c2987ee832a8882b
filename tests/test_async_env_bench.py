"""bench/async_env.py: the configs it runs cua_tiny's GRPO stage with (the stand-in screenshot service or the
MiniWoB++ browsers from an SFT model) are valid trainfit configs with the stage's settings, and a run's
record is read from its metrics rows; no browser, no training."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from bench import async_env
from trainfit.config.schema import validate

ROOT = Path(__file__).resolve().parents[1]
CUA = yaml.safe_load((ROOT / "examples" / "cua_tiny.yaml").read_text())
GRPO = next(s for s in CUA["stages"] if s["stage"] == "grpo")
URL = "http://127.0.0.1:8779"


def test_miniwob_runs_start_from_the_sft_model_and_evaluate_the_held_out_set(tmp_path):
    sft = tmp_path / "sft" / "final"
    sync = validate(async_env.stage_config(URL, None, tmp_path / "s", "sync", 1, sft=sft))
    run = validate(async_env.stage_config(URL, None, tmp_path / "a", "async", 1, sft=sft))
    for cfg in (sync, run):
        assert cfg.model.name == str(sft) and cfg.model.init == "pretrained"
        assert cfg.train.max_steps == GRPO["train"]["max_steps"] == 120
        assert cfg.task.num_eval == CUA["task"]["num_eval"] == 150
        assert Path(cfg.task.eval_path).is_file() and Path(cfg.task.path).is_file()
        assert cfg.env.url == URL and cfg.grpo.num_iterations == GRPO["grpo"]["num_iterations"]
    assert (sync.rollout.mode, run.rollout.mode, run.rollout.max_staleness) == ("sync", "async", 1)
    # a rehearsal shortens both
    short = validate(async_env.stage_config(URL, 4, tmp_path / "t", "async", 1, sft=sft, num_eval=10))
    assert (short.train.max_steps, short.task.num_eval) == (4, 10)


def test_screens_runs_keep_random_weights_and_no_evaluation(tmp_path):
    cfg = validate(async_env.stage_config(URL, 16, tmp_path, "sync", 1))
    assert cfg.model.name == CUA["model"]["name"] and cfg.task.num_eval == 0 and cfg.task.eval_path is None


def test_the_sft_stage_is_cua_tinys_against_the_given_service(tmp_path):
    sft = next(s for s in CUA["stages"] if s["stage"] == "sft")
    cfg = validate(async_env.sft_config(URL, tmp_path))
    assert cfg.stage == "sft" and cfg.train.max_steps == sft["train"]["max_steps"] == cfg.train.eval_every
    assert cfg.train.seed == 0 and cfg.env.url == URL and cfg.task.num_eval == 150
    assert cfg.data.path == str(ROOT / sft["data"]["path"])


def _rows(async_: bool) -> list[dict]:
    """Metrics rows of a 2-rollout run with 2 optimizer steps a rollout, evaluated at its start and end."""
    rows = [{"kind": "eval", "step": 0, "time": 100.0, "success": 0.30}]
    for step in range(4):
        row = {"kind": "train", "step": step + 1, "time": 110.0 + 10 * step, "step_time": 9.0,
               "reward": [0.5, 0.9][step // 2], "time_generate_s": 3.0 if step % 2 == 0 else 0.0}
        if async_:
            row |= {"staleness_mean": float(step >= 2), "staleness_max": float(step >= 2),
                    "time_rollout_wait_s": 1.0, "time_async_rollout_s": 4.0}
            if step >= 2:
                row |= {"iw_mean": 1.0, "iw_max": 1.5, "iw_min": 0.5, "iw_cut_frac": 0.0}
        rows.append(row)
    return rows + [{"kind": "eval", "step": 4, "time": 200.0, "success": 0.42}]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_runs_record_has_its_success_rewards_waits_and_staleness(mode, tmp_path):
    cfg = async_env.stage_config(URL, 4, tmp_path, mode, 1, sft=tmp_path, num_eval=150)
    cfg["grpo"]["num_iterations"] = 2
    r = async_env.summarize(_rows(mode == "async"), cfg)
    assert (r["success_start"], r["success"], r["eval_n"]) == (0.30, 0.42, 150)
    assert r["rewards"] == [0.5, 0.9] and r["reward_mean"] == pytest.approx(0.7)
    assert r["steps"] == 4 and r["samples"] == 2 * 32 and r["train_s"] == 36.0
    assert r["loop_s"] == 40.0   # the first evaluation's row to the last step's: the final evaluation left out
    assert r["times"]["time_generate_s"] == 6.0
    if mode == "async":
        assert (r["staleness_mean"], r["staleness_max"]) == (0.5, 1.0)
        assert r["rollout_wait_s"] == 4.0 and r["worker_rollout_s"] == 8.0   # the worker's time counted once a rollout
        assert "time_async_rollout_s" not in r["times"]
        assert (r["iw_min"], r["iw_max"]) == (0.5, 1.5)
    else:
        assert r["rollout_s"] == 6.0 and "staleness_max" not in r


def test_the_browser_probe_plays_a_rollouts_episodes_to_their_last_turn():
    # the stand-in service (no browser) never ends an episode: 32 episodes x (reset + 3 turns)
    server = async_env.serve_screens(16, 16)
    try:
        r = async_env.browsers_only(server.url)
    finally:
        server.stop()
    turns = CUA["rollout"]["max_turns"]
    assert r["mode"] == "browsers" and r["requests"] == 32 * (1 + turns) == 128
    assert 0 < r["request_mean_s"] <= r["request_max_s"] <= r["rollout_s"]
