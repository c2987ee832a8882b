"""The engine interface's log-probs, and the sync check that stops training on a stale engine."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from rich.console import Console

from conftest import tiny_config
from trainfit.config import ModelConfig, PeftConfig, RolloutConfig
from trainfit.models.policy import load_policy
from trainfit.models.save import save_pretrained
from trainfit.rollout.base import RolloutEngine, StaleEngineError
from trainfit.rollout.hf import HFEngine
from trainfit.rollout.sync_check import check_sync
from trainfit.train.faults import Faults
from trainfit.models.logprobs import sequence_logprobs, single_turn_sample
from trainfit.train.loop import train_stage
from trainfit.train.report import read_metrics
from trainfit.train.run import build_stage

CPU = torch.device("cpu")
REWARD = str(Path(__file__).parent / "data" / "rewards_for_tests.py") + ":length_reward"
QUIET = Console(file=open("/dev/null", "w"))


@pytest.fixture(scope="module")
def tiny():
    return load_policy(ModelConfig(name="preset:tiny"), PeftConfig(), CPU, seed=0)


class StaleCopyEngine(HFEngine):
    """An engine with its own copy of the weights whose sync forgets to copy them (the bug to catch)."""

    shares_weights = False

    def __init__(self, model, tokenizer, cfg):
        super().__init__(copy.deepcopy(model), tokenizer, cfg)
        self.syncs = 0

    def sync(self, model) -> None:
        self.syncs += 1


class CopyEngine(StaleCopyEngine):
    """The same, with a sync that does copy the weights."""

    def sync(self, model) -> None:
        self.syncs += 1
        self.model.load_state_dict(model.state_dict())


@pytest.mark.parametrize("temperature,greedy", [(0.7, False), (1.0, True)])
def test_hf_engine_logprobs_equal_the_trainers(tiny, temperature, greedy):
    eng = HFEngine(tiny.model, tiny.tokenizer, RolloutConfig(max_new_tokens=6, temperature=temperature))
    assert isinstance(eng, RolloutEngine)
    prompts = [[19, 13, 20], [5, 6, 7, 8, 9], [30]]
    outs = eng.generate(prompts, seeds=[1, 2, 3], greedy=greedy, logprobs=True)
    samples = [single_turn_sample(p, o.token_ids) for p, o in zip(prompts, outs)]
    # The trainer scores greedy tokens at T = 1 (the engine's convention for greedy).
    logp, mask, _ = sequence_logprobs(tiny.model, samples, 0, CPU, 1.0 if greedy else temperature)
    for i, o in enumerate(outs):
        assert len(o.logprobs) == len(o.token_ids) == 6
        assert torch.allclose(torch.tensor(o.logprobs), logp[i][mask[i]], atol=1e-5)
    assert eng.generate(prompts, seeds=[1, 2, 3], greedy=greedy)[0].logprobs is None  # only when asked


def test_check_sync_passes_for_the_same_weights_and_catches_stale_ones(tiny):
    cfg = RolloutConfig(max_new_tokens=4)
    model = copy.deepcopy(tiny.model)
    eng = StaleCopyEngine(model, tiny.tokenizer, cfg)
    report = check_sync(eng, model, tiny.tokenizer, CPU, n_prompts=3, tolerance=1e-3)
    assert report.tokens == 3 * 16 and report.mean_abs_diff < 1e-4
    with torch.no_grad():  # the trainer moves on; the engine keeps the old weights
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    eng.sync(model)
    with pytest.raises(StaleEngineError, match="does not sample from the trained weights"):
        check_sync(eng, model, tiny.tokenizer, CPU, n_prompts=3, tolerance=1e-3)
    good = CopyEngine(model, tiny.tokenizer, cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    good.sync(model)
    assert check_sync(good, model, tiny.tokenizer, CPU, n_prompts=3, tolerance=1e-3).mean_abs_diff < 1e-4


def _grpo_with_engine(tmp_path, engine_cls, monkeypatch):
    import trainfit.train.stage as run   # where the stage's loading binds build_engine

    made = []

    def build_engine(rcfg, model, tokenizer, stop=(), workdir=None, model_cfg=None):
        made.append(engine_cls(model, tokenizer, rcfg))
        return made[-1]

    monkeypatch.setattr(run, "build_engine", build_engine)
    cfg = tiny_config(tmp_path, "grpo", **{"train.max_steps": 3, "train.lr": 0.05, "rollout.max_new_tokens": 4,
                                           "rollout.sync_tolerance": 1e-3, "task.num_eval": 0,
                                           "task.rewards": f"[{REWARD}]"})
    stage_dir = tmp_path / "stage"
    loaded, stage, _ = build_stage(cfg, stage_dir)
    return cfg, loaded, stage, stage_dir, made


def _train(cfg, loaded, stage, stage_dir):
    train_stage(cfg, loaded, stage, stage_dir, resume=False, console=QUIET, faults=Faults(),
                save_final=lambda p: save_pretrained(loaded, p, base_dir=stage_dir / "base"))


def test_grpo_stops_on_a_stale_engine_before_training_on_its_samples(tmp_path, monkeypatch):
    cfg, loaded, stage, stage_dir, made = _grpo_with_engine(tmp_path, StaleCopyEngine, monkeypatch)
    with pytest.raises(StaleEngineError, match="before step 2"):
        _train(cfg, loaded, stage, stage_dir)
    steps = [m for m in read_metrics(stage_dir / "metrics.jsonl") if m["kind"] == "train"]
    assert [m["step"] for m in steps] == [1]      # step 1 trained (engine fresh), step 2 never ran
    assert steps[0]["sync_logp_diff"] < 1e-4


def test_grpo_with_a_syncing_engine_checks_every_round(tmp_path, monkeypatch):
    cfg, loaded, stage, stage_dir, made = _grpo_with_engine(tmp_path, CopyEngine, monkeypatch)
    _train(cfg, loaded, stage, stage_dir)
    steps = [m for m in read_metrics(stage_dir / "metrics.jsonl") if m["kind"] == "train"]
    assert len(steps) == 3 and made[0].syncs == 3
    assert all(m["sync_logp_diff"] < 1e-4 for m in steps)
