"""The command line answers plain errors and a warm plan without importing torch, transformers or peft.

Each case is a real `trainfit` process (bench/cli_latency.py's `run_cli`, which reports the heavy modules
the process imported, however it exits). No timing is asserted here: bench/cli_latency.py measures it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bench.cli_latency import HEAVY, run_cli

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SFT = str(EXAMPLES / "sft_chat.yaml")         # preset:tiny, a local JSONL file
PRETRAIN = str(EXAMPLES / "pretrain.yaml")    # preset:tiny packed at the cap: one trace, no tokenizer to build


@pytest.fixture
def env(tmp_path, monkeypatch) -> dict:
    # The run's planner cache (tests/conftest.py), so a plan made in this process is warm for the CLI.
    monkeypatch.setenv("TRAINFIT_CACHE", os.environ.get("TRAINFIT_CACHE") or str(tmp_path / "cache"))
    return {**os.environ, "HF_HUB_OFFLINE": "1"}


def _answers_without_heavy_imports(args: list[str], env: dict, rc: int, says: str) -> None:
    r = run_cli(args, env)
    assert r["rc"] == rc, r
    assert says in r["stderr"], r
    assert r["heavy_imported"] == [], f"{' '.join(args)} imported {r['heavy_imported']} (none of {HEAVY} expected)"


def test_config_error_imports_no_torch(env):
    _answers_without_heavy_imports(["plan", SFT, "train.lr_typo=1"], env, 2, "train.lr_typo")


def test_missing_data_file_imports_no_torch(env, tmp_path):
    args = ["train", SFT, f"data.path={tmp_path / 'missing.jsonl'}", f"run_dir={tmp_path / 'run'}", "--dry-run"]
    _answers_without_heavy_imports(args, env, 2, "does not exist")


def test_unknown_model_dir_imports_no_torch(env, tmp_path):
    _answers_without_heavy_imports(["plan", SFT, f"model.name={tmp_path / 'no-such-model'}"], env, 2, "was not found")


def test_unknown_gpu_imports_no_torch(env, tmp_path):
    _answers_without_heavy_imports(["fit", SFT, "--gpu", "no-such-gpu", "-o", str(tmp_path / "fit")], env, 2,
                                   "unknown GPU")


def test_warm_plan_imports_no_torch(env):
    # A first plan warms the run's cache on disk (made by the CLI itself: a plan made in this process may be
    # answered from an in-memory memo of an earlier test and write nothing there); the second is warm.
    assert run_cli(["plan", PRETRAIN], env)["rc"] == 0
    r = run_cli(["plan", PRETRAIN], env)
    assert r["rc"] == 0, r
    assert r["heavy_imported"] == [], f"a warm plan imported {r['heavy_imported']}"
