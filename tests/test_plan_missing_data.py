"""A local data path that is not on the planning machine yet (data a command generates first, as
examples/cua_tiny.yaml's expert rows) is planned at the length caps with a note, as a hub dataset that
cannot be reached is; `train --dry-run` and `train` still refuse it (exit 2). Preset model, no training."""

import json
from pathlib import Path

from typer.testing import CliRunner

from trainfit.app.cli import app
from trainfit.config import load_config
from trainfit.plan.lengths import data_lengths, missing_locally


def _config(tmp_path, data: str):
    cfg = {"stage": "sft", "run_dir": str(tmp_path / "run"), "model": {"name": "preset:tiny"},
           "data": {"path": data, "max_seq_length": 64}, "train": {"device": "cpu", "max_steps": 1}}
    path = tmp_path / "cfg.yaml"
    path.write_text(json.dumps(cfg))
    return path


def test_a_missing_local_path_is_planned_at_the_caps_and_refused_by_train(tmp_path, user_plan_cache):
    missing = str(tmp_path / "not_yet" / "rows.jsonl")
    cfg = _config(tmp_path, missing)
    lens = data_lengths(load_config(cfg))
    assert (lens.source, lens.seq) == ("caps", 64) and "is not on this machine" in lens.note
    plan = CliRunner().invoke(app, ["plan", str(cfg)])
    assert plan.exit_code == 0 and "is not on this machine (yet): planned at the length caps" in " ".join(
        plan.output.split()), plan.output
    for args in (["train", str(cfg), "--dry-run"], ["train", str(cfg)]):
        r = CliRunner().invoke(app, args)
        assert r.exit_code == 2 and "does not exist" in r.output, r.output
    assert not (tmp_path / "run").exists()


def test_what_counts_as_missing_here():
    assert missing_locally("runs/never_made_here/rows.jsonl")
    assert not missing_locally(str(Path(__file__).resolve().parents[1] / "examples" / "data" / "chat_sample.jsonl"))
    assert not missing_locally("runs/*/rows.jsonl")                     # a glob: train says what it matches
    assert not missing_locally("openai/gsm8k")                          # a hub id: its own note
