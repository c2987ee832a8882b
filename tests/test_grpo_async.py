"""rollout.mode=async (train/async_rollout.py) on the CPU (train.device=cpu): k = 0 is sync bit for bit,
stale samples carry their version and behaviour log-probs and are corrected, pushes arrive, and the
worker's queue and snapshots stay within the bounds the planner sizes them by."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rich.console import Console

from conftest import tiny_config
from trainfit.models.save import save_pretrained
from trainfit.train.faults import Faults
from trainfit.train.loop import train_stage
from trainfit.train.report import read_metrics
from trainfit.train.run import build_stage

QUIET = Console(file=open("/dev/null", "w"))
REWARD = str(Path(__file__).parent / "data" / "rewards_for_tests.py") + ":length_reward"
# Values that only describe timing or memory (they differ between any two runs).
TIMING = ("step_time", "tokens_per_s", "time_", "cpu_rss", "gpu_mem")


def grpo(tmp_path, **kw):
    return tiny_config(tmp_path, "grpo", **{"task.rewards": f"[{REWARD}]", "train.max_steps": 3, "train.lr": 1e-2,
                                            "rollout.max_new_tokens": 6, "task.num_eval": 0, **kw})


def run(cfg, stage_dir: Path, keep: list | None = None):
    """Train the stage; returns (final weights, metrics rows, the stage)."""
    loaded, stage, _ = build_stage(cfg, stage_dir)
    if keep is not None:   # the batches the trainer was handed
        prepare = stage.prepare
        stage.prepare = lambda step: keep.append(prepare(step)) or keep[-1]
    train_stage(cfg, loaded, stage, stage_dir, resume=False, console=QUIET, faults=Faults(),
                save_final=lambda p: save_pretrained(loaded, p, base_dir=stage_dir / "base"))
    weights = {n: p.detach().clone() for n, p in loaded.model.named_parameters()}
    rows = [{k: v for k, v in m.items() if k != "time" and not k.startswith(TIMING)}
            for m in read_metrics(stage_dir / "metrics.jsonl")]
    return weights, rows, stage


@pytest.mark.parametrize("extra", [{"task.num_eval": 4}, {"peft.method": "lora", "peft.r": 4, "grpo.beta": 0.1},
                                   {"grpo.num_iterations": 2, "train.max_steps": 4, "grpo.beta": 0.1},
                                   # tool episodes: the worker's go on as each environment answers (as_ready)
                                   {"env.type": "tools", "task.chat": True, "rollout.max_turns": 2,
                                    "rollout.max_new_tokens": 8}],
                         ids=["full", "lora-kl", "iterations2", "tools"])
def test_k0_equals_sync_bit_for_bit(tmp_path, extra):
    w_sync, m_sync, _ = run(grpo(tmp_path, **extra), tmp_path / "sync")
    # sync_check auto: each push is probed (the probe samples from the worker's copy with its own seeds)
    w_async, m_async, stage = run(grpo(tmp_path, **{"rollout.mode": "async", "rollout.max_staleness": 0, **extra}),
                                  tmp_path / "async")
    assert w_sync.keys() == w_async.keys()
    assert all(torch.equal(w_sync[n], w_async[n]) for n in w_sync), "final weights differ"
    train_sync = [m for m in m_sync if m["kind"] == "train"]
    train_async = [m for m in m_async if m["kind"] == "train"]
    n = extra.get("grpo.num_iterations", 1)
    assert len(train_sync) == len(train_async) == extra.get("train.max_steps", 3)
    for a, b in zip(train_sync, train_async):
        # async adds only its own columns (all 0 staleness here); every sync metric is the same
        assert {k: b[k] for k in a} == a
        assert b["step"] <= n or b["sync_logp_diff"] < 1e-4
        # the version counts rollouts consumed: the weights at the start of the rollout's first step
        assert b["staleness_max"] == 0.0 and b["policy_version"] == (a["step"] - 1) // n
    if n > 1:   # the rollout was reused: ratios moved away from 1 on its second step, in both runs alike
        assert train_async[1]["ratio"] != 1.0
        assert "iw_mean" not in b     # no stale sample, no correction
    assert [m for m in m_sync if m["kind"] == "eval"] == [m for m in m_async if m["kind"] == "eval"]
    assert stage.worker.most_queued <= 1 and stage.worker.most_snapshots == 0


def test_k1_trains_on_samples_one_version_old_with_the_correction(tmp_path):
    kept: list = []
    cfg = grpo(tmp_path, **{"rollout.mode": "async", "rollout.max_staleness": 1, "rollout.sync_check": "always",
                            "rollout.off_policy": "tis", "rollout.importance_cap": 1.05})
    _, rows, stage = run(cfg, tmp_path / "k1", keep=kept)
    steps = [m for m in rows if m["kind"] == "train"]
    # Rollout 0 is sampled by version 0 (nothing older exists); rollout r > 0 by version r - 1.
    assert [m["policy_version"] for m in steps] == [0.0, 0.0, 1.0]
    assert [m["staleness_max"] for m in steps] == [0.0, 1.0, 1.0]
    assert [{s["version"] for s in b.samples} for b in kept] == [{0}, {0}, {1}]
    # Stale rollouts carry their behaviour log-probs (one per policy token); the fresh one none.
    assert "behav_logp" not in kept[0].samples[0]
    assert all(len(s["behav_logp"]) == sum(s["loss_mask"][1:]) for b in kept[1:] for s in b.samples)
    # Each push was probed: the worker's copy samples like the trainer (fp32 on one CPU: equal up to rounding).
    assert all(m["sync_logp_diff"] < 1e-4 for m in steps[1:])
    # The correction ran on the stale steps: weights spread around 1, some truncated at the cap of 1.05.
    for m in steps[1:]:
        assert m["iw_min"] < 1.0 < m["iw_max"] and 0.0 < m["iw_cut_frac"] < 1.0
    assert "iw_mean" not in steps[0]
    assert stage.worker.most_queued <= 1 and stage.worker.most_snapshots == 0


def test_iterations_take_ratios_against_the_trainers_weights_at_the_rollout(tmp_path):
    # grpo.num_iterations=2, k=1: rollout r serves steps 2r+1 and 2r+2 and is sampled by version r - 1 (the
    # weights at rollout r - 1's first step). Its PPO ratios are against the trainer's weights at rollout r's
    # first step (old_logp, the proximal policy), its behaviour weights against the sampler's (behav_logp).
    # A stale rollout's old_logp is the trainer's own forward at its first step, kept by the loss: the take
    # adds no forward of its own (time_logprobs_s stays 0 on the trainer, which samples nothing).
    import copy

    from trainfit.models.logprobs import store_rows

    cfg = grpo(tmp_path, **{"rollout.mode": "async", "rollout.max_staleness": 1, "grpo.num_iterations": 2,
                            "train.max_steps": 6, "rollout.sync_check": "never", "grpo.epsilon": 0.01})
    loaded, stage, _ = build_stage(cfg, tmp_path / "it2")
    weights, batches = {}, {}
    prepare = stage.prepare

    def logprobs_at(state: dict, samples: list[dict], key: str) -> list[dict]:
        model = copy.deepcopy(stage.model)
        model.load_state_dict(state)
        rows = [dict(x) for x in samples]
        with torch.no_grad():
            logp, mask, _ = stage._logprobs(model, rows)
        store_rows(rows, key, logp, mask)
        return rows

    def watched(step: int):
        batch = prepare(step)
        rnd = step // 2
        if step % 2 == 0:   # a rollout's first step: the trainer's weights now are version step // 2
            weights[rnd] = {n: p.detach().clone() for n, p in stage.model.state_dict().items()}
            batches[rnd] = batch
            if rnd > 0:   # taken without a proximal pass: its first step's forward is that pass
                assert all("old_logp" not in s for s in batch.samples)
        elif rnd > 0:     # its second step, after one update: ratios against version rnd, weights old/behav
            prox = logprobs_at(weights[rnd], batch.samples, "want_old")
            behav = logprobs_at(weights[rnd - 1], batch.samples, "want_behav")
            for s, p, b in zip(batch.samples, prox, behav):
                assert torch.allclose(s["old_logp"], p["want_old"], atol=1e-6)
                assert torch.allclose(s["behav_logp"], b["want_behav"], atol=1e-6)
        return batch

    stage.prepare = watched
    train_stage(cfg, loaded, stage, tmp_path / "it2", resume=False, console=QUIET, faults=Faults(),
                save_final=lambda p: save_pretrained(loaded, p, base_dir=tmp_path / "it2" / "base"))
    steps = [m for m in read_metrics(tmp_path / "it2" / "metrics.jsonl") if m["kind"] == "train"]
    assert [m["policy_version"] for m in steps] == [0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    assert [m["staleness_max"] for m in steps] == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    assert [{s["version"] for s in batches[r].samples} for r in range(3)] == [{0}, {0}, {1}]
    # The proximal and behaviour policies differ (an update lies between them) ...
    assert any(not torch.allclose(s["old_logp"], s["behav_logp"]) for s in batches[1].samples)
    # ... yet a rollout's first step is on-policy for the ratio: pi = pi_prox, ratio 1, nothing clipped;
    # its second step, after an update, clips against pi_prox.
    for first, second in ((steps[2], steps[3]), (steps[4], steps[5])):
        assert first["ratio"] == pytest.approx(1.0, abs=1e-6) and first["clip_frac"] == 0.0
        assert second["clip_frac"] > 0.0
        assert "iw_mean" in first and "iw_mean" in second   # the stale steps were reweighted
    assert "iw_mean" not in steps[0]
    assert stage.worker.most_queued <= 1
    # The trainer ran no log-prob forward of its own (the worker's, in its thread, are not the trainer's);
    # its wait is timed apart from its pushes.
    assert all(m.get("time_logprobs_s", 0.0) == 0.0 for m in steps)
    assert all("time_rollout_wait_s" in m for m in steps[::2])


def test_k2_pins_versions_and_bounds_snapshots(tmp_path):
    from trainfit.rollout.staleness import held_snapshots, queued_rollouts

    kept: list = []
    cfg = grpo(tmp_path, **{"rollout.mode": "async", "rollout.max_staleness": 2, "rollout.sync_check": "never",
                            "train.max_steps": 4})
    _, rows, stage = run(cfg, tmp_path / "k2", keep=kept)
    assert [{s["version"] for s in b.samples} for b in kept] == [{0}, {0}, {0}, {1}]
    assert stage.worker.most_queued <= queued_rollouts(2) and stage.worker.most_snapshots <= held_snapshots(2)


@pytest.mark.parametrize("extra", [{}, {"peft.method": "lora", "peft.r": 4}], ids=["full", "lora"])
def test_plan_holds_the_workers_copy_and_queue(tmp_path, extra):
    from trainfit.plan import plan
    from trainfit.rollout.staleness import held_snapshots, queued_rollouts
    from trainfit.train.async_rollout import RolloutWorker

    cfg = grpo(tmp_path, **{"rollout.mode": "async", "rollout.max_staleness": 2, **extra})
    _, stage, _ = build_stage(cfg, tmp_path / "s")
    worker = RolloutWorker(stage, start=0, last=0)   # samples nothing: only its copy is read
    worker.close()
    copied = sum(p.numel() * p.element_size() for p in worker._mine.values())
    shared = [n for n, p in worker.model.named_parameters() if not p.requires_grad]
    base = dict(stage.model.named_parameters())
    assert all(p is base[n] for n, p in worker.model.named_parameters() if n in shared)   # not copied
    p = plan(cfg, gpu="h100-80gb")
    items = {i.name: i for i in p.items}
    copy_item = next(i for n, i in items.items() if n.startswith("async worker's copy"))
    # The plan counts what the worker copies: every trainable tensor, no frozen one.
    assert copy_item.rollout == copy_item.train == copied
    snaps = next(i for n, i in items.items() if n.startswith("weights pushed while"))
    assert snaps.train == held_snapshots(2) * copied
    queue = next(i for n, i in items.items() if n.startswith("async queue"))
    assert f"({queued_rollouts(2)} rollout(s) x 8 samples" in queue.name and queue.cpu > 0
    if extra:
        assert shared and copied < sum(p.numel() * p.element_size() for p in base.values()) / 2


@pytest.mark.multiprocess
def test_sigkill_then_resume_continues_with_the_same_versions_and_samples(tmp_path):
    # grpo.num_iterations=2, k=1, 8 steps (rollouts 0-3), a checkpoint every 3 steps, killed after step 4:
    # the checkpoint at step 3 is in the middle of rollout 1 with rollout 2 (sampled by version 1) queued.
    # It keeps both, so the resumed run trains what an uninterrupted one does: the same versions, rewards
    # and losses.
    import signal

    from test_resume import killed_run, run_cli, write_config
    from trainfit.train import checkpoint as ckpt
    from trainfit.train.run import run_pipeline

    def cfg_for(name: str):
        return grpo(tmp_path, **{"run_dir": str(tmp_path / name), "train.max_steps": 8, "train.save_every": 3,
                                 "grpo.num_iterations": 2, "rollout.mode": "async", "rollout.max_staleness": 1,
                                 "rollout.sync_check": "never"})

    def train_rows(name: str) -> dict[int, dict]:
        return {m["step"]: m for m in read_metrics(tmp_path / name / "metrics.jsonl") if m["kind"] == "train"}

    run_pipeline(cfg_for("ref"), console=QUIET)
    expected = train_rows("ref")
    assert [expected[s]["policy_version"] for s in range(1, 9)] == [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 2.0, 2.0]

    config = write_config(cfg_for("cut"), tmp_path / "cut.yaml")
    killed = killed_run(config, "--fault", "kill_after_step:4")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    latest = ckpt.latest_checkpoint(tmp_path / "cut" / "checkpoints")
    assert latest.name == "step-000003"
    state = ckpt.safe_load(latest / "stage-rank0.pt")["stage"]
    assert state["buffer_round"] == 1 and sorted(state["queue"]) == [2]
    assert {s["version"] for s in state["queue"][2].samples} == {1}
    resumed = run_cli(config, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert_resumed_as_uninterrupted(train_rows("cut"), expected, steps=8)
    assert (tmp_path / "cut" / "final" / "model.safetensors").is_file()


def assert_resumed_as_uninterrupted(got: dict, expected: dict, steps: int) -> None:
    """The resumed run's train rows (step -> metrics) against the uninterrupted run's: every step there, the
    same policy versions, staleness and rewards, and the same losses to float rounding."""
    assert sorted(got) == list(range(1, steps + 1))
    for step in range(1, steps + 1):
        for key in ("policy_version", "staleness_max", "reward", "reward_std"):
            assert got[step][key] == expected[step][key], (step, key)
        assert got[step]["loss"] == pytest.approx(expected[step]["loss"], rel=1e-6, abs=1e-7), step


def test_tool_episodes_run_in_the_worker(tmp_path):
    # Multi-turn episodes (env.type=tools) go through the same rollout code in the worker: the stale step's
    # episode rows carry behaviour log-probs for exactly their policy tokens (environment tokens have none).
    kept: list = []
    cfg = grpo(tmp_path, **{"env.type": "tools", "task.chat": True, "rollout.max_turns": 2,
                            "rollout.max_new_tokens": 8, "task.num_eval": 0, "train.max_steps": 2,
                            "rollout.mode": "async", "rollout.max_staleness": 1, "rollout.sync_check": "never"})
    _, rows, _ = run(cfg, tmp_path / "tools", keep=kept)
    steps = [m for m in rows if m["kind"] == "train"]
    assert [m["staleness_max"] for m in steps] == [0.0, 1.0] and "env_failed" in steps[1]
    assert all(len(s["behav_logp"]) == sum(s["loss_mask"][1:]) for s in kept[1].samples)


def test_staleness_is_logged_when_every_sample_is_left_out(tmp_path):
    # A constant reward: every advantage is 0 and (beta = 0) every sample is left out of the step, yet the
    # rollout's version is still one behind from step 2 on.
    constant = str(Path(__file__).parent / "data" / "rewards_for_tests.py") + ":constant_reward"
    kept: list = []
    cfg = grpo(tmp_path, **{"task.rewards": f"[{constant}]", "rollout.mode": "async", "rollout.sync_check": "never"})
    _, rows, _ = run(cfg, tmp_path / "zero", keep=kept)
    steps = [m for m in rows if m["kind"] == "train"]
    assert all(not b.samples for b in kept)
    assert [m["staleness_max"] for m in steps] == [0.0, 1.0, 1.0]
