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


class EvalWatchingEngine(CopyEngine):
    """CopyEngine that notes, for each generation inside an evaluation, whether its copy holds the trainer's
    weights at that moment, and when it was put to sleep (vllm's sleep mode gives the card back to training)."""

    trainer = None
    events: list

    def generate(self, prompts, **kw):
        if getattr(self, "in_eval", False):
            theirs = dict(self.trainer.named_parameters())
            same = all(torch.equal(p, theirs[n]) for n, p in self.model.named_parameters())
            self.events.append(("eval generate", same))
        return super().generate(prompts, **kw)

    def sleep(self) -> None:
        self.events.append(("sleep", None))


@pytest.mark.parametrize("stage_name", ["grpo", "ppo"])
def test_an_engine_with_its_own_weights_is_pushed_the_trained_weights_before_each_evaluation(
        tmp_path, monkeypatch, stage_name):
    """An evaluation comes after optimizer steps, so an engine with its own copy of the weights (vllm, openai)
    still holds those of the last rollout: without a push it scores the model of a step before, and the
    final accuracy is not the saved model's. The push is probed, and a sleeping engine is put back to sleep."""
    import trainfit.train.stage as run   # where the stage's loading binds build_engine

    made = []

    def build_engine(rcfg, model, tokenizer, stop=(), workdir=None, model_cfg=None):
        made.append(EvalWatchingEngine(model, tokenizer, rcfg))
        made[-1].events = []
        return made[-1]

    monkeypatch.setattr(run, "build_engine", build_engine)
    cfg = tiny_config(tmp_path, stage_name, **{"train.max_steps": 2, "train.lr": 0.05, "train.eval_every": 1,
                                               "rollout.max_new_tokens": 4, "rollout.sync_tolerance": 1e-3,
                                               "task.num_eval": 4, "task.rewards": f"[{REWARD}]"})
    stage_dir = tmp_path / "stage"
    loaded, stage, _ = build_stage(cfg, stage_dir)
    eng = made[0]
    eng.trainer = stage.policy if stage_name == "ppo" else stage.model
    evaluate = stage.evaluate

    def watched(model):
        eng.in_eval = True
        try:
            return evaluate(model)
        finally:
            eng.in_eval = False

    stage.evaluate = watched
    train_stage(cfg, loaded, stage, stage_dir, resume=False, console=QUIET, faults=Faults(),
                save_final=lambda p: stage.save_final(p) if stage_name == "ppo"
                else save_pretrained(loaded, p, base_dir=stage_dir / "base"))
    evals = [e for e in eng.events if e[0] == "eval generate"]
    assert len(evals) >= 3                       # before training, after step 1, after step 2 (and the last)
    assert all(same for _, same in evals)        # every evaluation sampled the weights it reports on
    # Each evaluation ends with the engine asleep again: a sleep after the last evaluation's generation.
    assert eng.events[-1] == ("sleep", None)
