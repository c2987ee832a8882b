"""Shared helpers: small configs on the tiny preset, and a CUDA skip for @pytest.mark.gpu tests."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Some test modules point TRAINFIT_CACHE at a fresh folder when imported; this is the one the run
# started with (the user's cache, where the 7B/8B examples' traces may already be warm).
START_CACHE = os.environ.get("TRAINFIT_CACHE")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs one pytest worker per core (pytest-xdist): one torch thread each, and the runs
    # a test starts as subprocesses (CLI, torchrun ranks) inherit one thread too, so workers never
    # oversubscribe the cores.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
else:
    torch.set_num_threads(min(2, torch.get_num_threads()))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def send_json(handler, code: int, data: bytes) -> None:
    """Reply from a test HTTP server's request handler with a JSON body."""
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def tiny_config(tmp_path, stage: str = "sft", **overrides):
    """A validated Config for a few fast steps on preset:tiny; `overrides` are dotted keys."""
    from trainfit.config import load_config

    base = {
        "stage": stage,
        "run_dir": str(tmp_path / "run"),
        "model": {"name": "preset:tiny"},
        "task": {"name": "arithmetic", "max_operand": 9, "num_eval": 16},
        "train": {"global_batch_size": 8, "micro_batch_size": 8, "max_steps": 2, "lr": 1e-3,
                  "device": "cpu"},
        "grpo": {"num_generations": 4},
        "rollout": {"max_new_tokens": 4},
        "logging": {"tensorboard": False, "progress": False, "plot": False},
    }
    return load_config(None, [f"{k}={v}" for k, v in overrides.items()], base=base)


@pytest.fixture
def deepspeed_config_parser(monkeypatch):
    """DeepSpeed's own config validation (skips without deepspeed): parse(path, world) -> DeepSpeedConfig.
    The world size comes from an mpu stand-in, since torch.distributed is not initialised in a test."""
    def make():
        pytest.importorskip("deepspeed")
        from deepspeed.runtime import config as ds_config

        monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)

        class MPU:
            def __init__(self, world):
                self.world = world

            def get_data_parallel_world_size(self):
                return self.world

        return lambda path, world: ds_config.DeepSpeedConfig(str(path), mpu=MPU(world))
    return make


@pytest.fixture
def user_plan_cache(monkeypatch):
    """Offline, with the planner cache the run started with (see START_CACHE)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    if START_CACHE is None:
        monkeypatch.delenv("TRAINFIT_CACHE", raising=False)
    else:
        monkeypatch.setenv("TRAINFIT_CACHE", START_CACHE)
