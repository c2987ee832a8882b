"""GRPO end to end with the agent pieces: the openai engine against `trainfit serve`, multi-turn tool use,
and a simulated user."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from rich.console import Console

from conftest import tiny_config
from serve_helpers import serve_subprocess
from trainfit.config import ModelConfig, PeftConfig
from trainfit.envs import turn_seed
from trainfit.models.policy import load_policy
from trainfit.models.save import save_pretrained
from trainfit.rollout.hf import HFEngine
from trainfit.rollout.sync_check import check_sync
from trainfit.train.faults import Faults
from trainfit.train.loop import train_stage
from trainfit.train.report import read_metrics
from trainfit.train.run import build_stage

CPU = torch.device("cpu")
QUIET = Console(file=open("/dev/null", "w"))
REWARD = str(Path(__file__).parent / "data" / "rewards_for_tests.py") + ":length_reward"


def _train(cfg, loaded, stage, stage_dir):
    train_stage(cfg, loaded, stage, stage_dir, resume=False, console=QUIET, faults=Faults(),
                save_final=lambda p: save_pretrained(loaded, p, base_dir=stage_dir / "base"))
    return [m for m in read_metrics(stage_dir / "metrics.jsonl") if m["kind"] == "train"]


def _served_base(tmp_path) -> Path:
    """preset:tiny saved as the base `trainfit serve` serves and the LoRA policy trains on."""
    save_pretrained(load_policy(ModelConfig(name="preset:tiny"), PeftConfig(), CPU), tmp_path / "base")
    return tmp_path / "base"


def _openai_grpo(tmp_path, base: Path, url: str, **over):
    """Three GRPO steps of a LoRA on `base` whose rollouts the server at `url` samples (rollout.engine=openai)."""
    return tiny_config(tmp_path, "grpo", **{
        "model.name": str(base), "peft.method": "lora", "peft.r": 4, "rollout.engine": "openai",
        "rollout.base_url": url, "rollout.health_timeout_s": 90, "rollout.max_new_tokens": 6,
        "task.rewards": f"[{REWARD}]", "task.num_eval": 0, "train.max_steps": 3, "train.lr": 0.05,
        "rollout.sync_tolerance": 1e-3, **over})


def test_grpo_with_the_openai_engine_against_trainfit_serve(tmp_path):
    base = _served_base(tmp_path)
    with serve_subprocess(base, tmp_path / "server.log", "--batch-wait-ms", "20") as (url, _):
        cfg = _openai_grpo(tmp_path, base, url)
        stage_dir = tmp_path / "stage"
        loaded, stage, _ = build_stage(cfg, stage_dir)
        engine = stage.engine
        assert engine.name == "openai" and not engine.shares_weights
        before = check_sync(engine, loaded.model, loaded.tokenizer, CPU, n_prompts=3, tolerance=1e-3)
        steps = _train(cfg, loaded, stage, stage_dir)
        assert [m["step"] for m in steps] == [1, 2, 3]
        # Every rollout came from a synced adapter whose log-probs matched the trainer's.
        assert all(m["sync_logp_diff"] < 1e-3 for m in steps)
        assert engine.model_name.startswith("trainfit-v")
        served_before = engine.model_name
        # After the last optimizer step: push once more; the server's log-probs move with the training...
        probe_old = engine.generate([[19, 13, 20]], seeds=[0], max_new_tokens=8, logprobs=True, temperature=1.0)[0]
        engine.sync(loaded.model)
        assert engine.model_name != served_before
        probe_new = engine.generate([[19, 13, 20]], seeds=[0], max_new_tokens=8, logprobs=True, temperature=1.0)[0]
        if probe_new.token_ids == probe_old.token_ids:
            assert max(abs(a - b) for a, b in zip(probe_new.logprobs, probe_old.logprobs)) > 1e-3
        # ...and match the trainer's on the probe batch.
        after = check_sync(engine, loaded.model, loaded.tokenizer, CPU, n_prompts=3, tolerance=1e-3)
        assert after.mean_abs_diff < 1e-3 and before.mean_abs_diff < 1e-3
        engine.close()


@pytest.mark.parametrize("worker", ["thread", "process"])
def test_async_grpo_with_the_openai_engine_pushes_each_version_to_the_server(tmp_path, worker):
    """rollout.mode=async with the openai engine: the worker pushes each policy version's adapter to the server
    under names of its own, the server samples the rollouts, and the probe after each push proves it samples
    from that version (not the base, not the trainer's newer weights). The trainer's engine pushes its own
    adapter before each evaluation on the same server; neither unloads the other's."""
    base = _served_base(tmp_path)
    with serve_subprocess(base, tmp_path / "server.log", "--batch-wait-ms", "20") as (url, _):
        cfg = _openai_grpo(tmp_path, base, url, **{"rollout.mode": "async", "rollout.max_staleness": 1,
                                                   "rollout.worker": worker, "rollout.sync_check": "always",
                                                   "task.num_eval": 4})
        stage_dir = tmp_path / "stage"
        loaded, stage, _ = build_stage(cfg, stage_dir)
        steps = _train(cfg, loaded, stage, stage_dir)
        assert [m["step"] for m in steps] == [1, 2, 3]
        assert [m["policy_version"] for m in steps] == [0.0, 0.0, 1.0]   # rollout r by version max(0, r - 1)
        # Version 0 at the worker's start and the pushes of versions 1-2 were each probed on the server against
        # the trainer's weights of that version.
        assert all(m["sync_logp_diff"] < 1e-3 for m in steps)
        served = stage.engine.models()
        assert any(n.startswith("trainfit-async-v") for n in served)   # the worker's latest version
        assert any(re.fullmatch(r"trainfit-v\d+", n) for n in served)  # the trainer's, for the evaluations
        # The last evaluation sampled the trained weights through the trainer's adapter.
        assert check_sync(stage.engine, loaded.model, loaded.tokenizer, CPU, n_prompts=3, tolerance=1e-3)
        stage.engine.close()


class ToolScriptEngine(HFEngine):
    """The tiny random model cannot call tools; this engine scripts the policy's turns (a calculator call,
    then the answer: right for even seeds, off by one for odd) and records exactly what it returned."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.returned: list[tuple[list[int], list[int]]] = []   # (prompt ids, returned ids)

    def generate(self, prompts, *, seeds=None, greedy=False, **kw):
        outs = []
        for p, s in zip(prompts, seeds or [0] * len(prompts)):
            text = self.tokenizer.decode(p)
            results = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", text, re.S)
            if not results:
                expr = re.findall(r"<\|im_start\|>user\n(.*?)=<\|im_end\|>", text, re.S)[-1]
                reply = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>' % expr
            else:
                value = int(float(results[-1]))
                reply = str(value if s % 2 == 0 else value + 1)
            ids = self.tokenizer(reply, add_special_tokens=False)["input_ids"] + [self.eos_id]
            self.returned.append((list(p), ids))
            outs.append(self._finish(ids))
        return outs


def test_multi_turn_tool_use_grpo_masks_only_the_policys_tokens(tmp_path, monkeypatch):
    import trainfit.train.stage as run   # where the stage's loading binds build_engine

    made = []
    monkeypatch.setattr(run, "build_engine", lambda rcfg, model, tok, stop=(), workdir=None, model_cfg=None:
                        made.append(ToolScriptEngine(model, tok, rcfg)) or made[-1])
    cfg = tiny_config(tmp_path, "grpo", **{
        "env.type": "tools", "task.chat": True, "rollout.max_turns": 3, "rollout.max_new_tokens": 48,
        "task.num_eval": 4, "train.max_steps": 1, "train.global_batch_size": 8, "train.micro_batch_size": 4,
        "train.lr": 1e-2, "peft.method": "lora", "peft.r": 4})
    stage_dir = tmp_path / "stage"
    loaded, stage, _ = build_stage(cfg, stage_dir)
    before = {n: p.detach().clone() for n, p in loaded.model.named_parameters() if p.requires_grad}
    steps = _train(cfg, loaded, stage, stage_dir)
    eng = made[0]
    samples = stage.buffer.samples
    assert len(samples) == 8
    for smp in samples:
        ids, mask = smp["input_ids"], smp["loss_mask"]
        # Each episode: two policy turns; the tokens under loss are exactly what the engine returned,
        # in order, and every other token (system/tools block, user, tool result, template) is masked.
        policy = [t for t, m in zip(ids, mask) if m]
        # (each group repeats its prompt, and evaluation ran the same tasks: keep distinct matches)
        turns = sorted({(len(p), tuple(r)) for p, r in eng.returned
                        if ids[:len(p)] == p and ids[len(p):len(p) + len(r)] == r})
        turns = [list(r) for _, r in turns]
        assert len(turns) == 2 and policy == turns[0] + turns[1]
        runs = re.findall(r"1+", "".join(map(str, mask)))
        assert [len(x) for x in runs] == [len(t) for t in turns]
    records = [json.loads(x) for x in (stage_dir / "transcripts.jsonl").read_text().splitlines()]
    assert len(records) == 8 and all(r["turns"] == 2 and not r["failed"] for r in records)
    roles = [m["role"] for m in records[0]["messages"]]
    assert roles[-4:] == ["user", "assistant", "tool", "assistant"]
    # The reward is the task's check of the final answer against the calculator's (true) result.
    right = [float(r["messages"][-1]["content"] == r["messages"][-2]["content"]) for r in records]
    assert [r["reward"] for r in records] == right and steps[0]["reward"] == pytest.approx(sum(right) / 8)
    assert 0 < sum(right) < 8   # rewards differ within groups, so the adapters learn
    assert any(not torch.equal(before[n], p) for n, p in loaded.model.named_parameters() if p.requires_grad)
    # Held-out evaluation runs greedy episodes (seed i for example i) and judges the final answer.
    ev = [m for m in read_metrics(stage_dir / "metrics.jsonl") if m["kind"] == "eval"]
    expected = sum(turn_seed(i, 1) % 2 == 0 for i in range(4)) / 4
    assert ev and ev[-1]["accuracy"] == pytest.approx(expected) and ev[-1]["eval_turns"] == 2


def test_tool_use_grpo_runs_with_the_real_engine(tmp_path):
    cfg = tiny_config(tmp_path, "grpo", **{
        "env.type": "tools", "task.chat": True, "rollout.max_turns": 2, "rollout.max_new_tokens": 8,
        "task.num_eval": 0, "train.max_steps": 1, "train.global_batch_size": 8, "train.micro_batch_size": 8})
    stage_dir = tmp_path / "stage"
    loaded, stage, _ = build_stage(cfg, stage_dir)
    steps = _train(cfg, loaded, stage, stage_dir)
    assert len(steps) == 1 and "env_failed" in steps[0]
    for smp in stage.buffer.samples:
        assert len(smp["input_ids"]) == len(smp["loss_mask"]) <= cfg.episode_tokens()
        assert 0 < sum(smp["loss_mask"]) <= 2 * 8


def test_simulated_user_grpo_shares_the_policy_weights(tmp_path):
    data = Path(__file__).resolve().parents[1] / "examples" / "data" / "customer_service.jsonl"
    cfg = tiny_config(tmp_path, "grpo", **{
        "env.type": "simulated_user", "task.name": "jsonl", "task.path": str(data), "task.chat": True,
        "task.num_eval": 0, "env.domains": "[airline, retail]", "env.tasks_per_domain": 2,
        "env.user_max_new_tokens": 6, "rollout.max_turns": 2, "rollout.max_new_tokens": 6,
        "peft.method": "lora", "peft.r": 4, "train.max_steps": 1, "train.global_batch_size": 8,
        "train.micro_batch_size": 8})
    stage_dir = tmp_path / "stage"
    loaded, stage, _ = build_stage(cfg, stage_dir)
    n_params = sum(p.numel() for p in loaded.model.parameters())
    steps = _train(cfg, loaded, stage, stage_dir)
    assert len(steps) == 1
    assert sum(p.numel() for p in loaded.model.parameters()) == n_params   # no second model was loaded
    records = [json.loads(x) for x in (stage_dir / "transcripts.jsonl").read_text().splitlines()]
    assert records and all(r["turns"] >= 1 for r in records)
    domains = {stage.task.train_example(i).fields["domain"] for i in range(8)}
    assert domains <= {"airline", "retail"}
