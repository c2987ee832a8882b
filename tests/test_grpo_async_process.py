"""rollout.worker=process (train/async_process.py) on the CPU (train.device=cpu): the async rollout worker in
a child process keeps the thread worker's guarantees. k = 0 is sync bit for bit; k = 1 samples exactly what
the thread worker samples (the versions are fixed, not timing-dependent); an error raised in the child is
raised in the trainer as itself; no child outlives its stage, however the stage ends."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

import pytest
import torch

from test_grpo_async import QUIET, assert_resumed_as_uninterrupted, grpo, run
from trainfit.train.run import run_pipeline

DATA = Path(__file__).parent / "data" / "rewards_for_tests.py"


@pytest.fixture(autouse=True)
def one_thread():
    """The trainer at 1 thread, as the child (train.cpu_threads=1 split 1 + 1): bit-equal float sums."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def workers_alive() -> list:
    return [p for p in multiprocessing.active_children() if p.name == "trainfit-rollout"]


def same_batches(a: list, b: list) -> None:
    """Sample for sample and metric for metric, but for the worker's timing and the probe's rounding."""
    def metrics(batch) -> dict:
        return {k: v for k, v in batch.metrics.items() if not k.startswith(("time_", "sync_logp"))}

    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert metrics(x) == metrics(y) and x.totals == y.totals and len(x.samples) == len(y.samples)
        for s, t in zip(x.samples, y.samples):
            assert s.keys() == t.keys()
            for k in s:
                assert torch.equal(s[k], t[k]) if isinstance(s[k], torch.Tensor) else s[k] == t[k], k


@pytest.mark.parametrize("extra", [{"grpo.num_iterations": 2, "train.max_steps": 4, "grpo.beta": 0.1},
                                   {"peft.method": "lora", "peft.r": 4}], ids=["iterations2-kl", "lora"])
def test_k0_process_equals_sync_bit_for_bit(tmp_path, extra):
    # iterations2-kl: a full fine-tune's reference model (shared with the child) and the proximal log-probs;
    # lora: the frozen base shared with the child, the adapters pushed.
    extra = {"train.cpu_threads": 1, **extra}
    w_sync, m_sync, _ = run(grpo(tmp_path, **extra), tmp_path / "sync")
    w_proc, m_proc, stage = run(grpo(tmp_path, **{"rollout.mode": "async", "rollout.worker": "process",
                                                  "rollout.max_staleness": 0, **extra}), tmp_path / "proc")
    assert all(torch.equal(w_sync[n], w_proc[n]) for n in w_sync), "final weights differ"
    train_sync = [m for m in m_sync if m["kind"] == "train"]
    train_proc = [m for m in m_proc if m["kind"] == "train"]
    assert len(train_sync) == len(train_proc) == extra.get("train.max_steps", 3)
    n = extra.get("grpo.num_iterations", 1)
    for a, b in zip(train_sync, train_proc):
        assert {k: b[k] for k in a} == a   # every sync metric, the same
        # each push probed across the processes: the child's engine against the trainer's weights
        assert b["step"] <= n or b["sync_logp_diff"] < 1e-4
        assert b["staleness_max"] == 0.0 and b["policy_version"] == (a["step"] - 1) // n
    assert stage.worker.most_queued <= 1 and stage.worker.most_snapshots == 0
    assert not workers_alive()   # the stage closed its worker at the last step


@pytest.mark.parametrize("extra", [{}, {"env.type": "tools", "task.chat": True, "rollout.max_turns": 2,
                                        "rollout.max_new_tokens": 8}], ids=["single-turn", "tools"])
def test_k1_process_samples_what_the_thread_samples(tmp_path, extra):
    # tools: multi-turn episodes in the child, each going on as its environment answers (as the thread's)
    kept_thread: list = []
    kept_proc: list = []
    common = {"rollout.mode": "async", "rollout.max_staleness": 1, "rollout.sync_check": "always",
              "train.max_steps": 4, "train.cpu_threads": 1, **extra}
    w_thread, m_thread, _ = run(grpo(tmp_path, **common), tmp_path / "thread", keep=kept_thread)
    w_proc, m_proc, stage = run(grpo(tmp_path, **{**common, "rollout.worker": "process"}), tmp_path / "proc",
                                keep=kept_proc)
    # The same rollouts, sample for sample (token ids, versions, behaviour log-probs, advantages), ...
    assert [{s["version"] for s in b.samples} for b in kept_proc] == [{0}, {0}, {1}, {2}]
    assert all("behav_logp" in s for b in kept_proc[1:] for s in b.samples)
    same_batches(kept_thread, kept_proc)
    # ... the same steps and weights.
    def rows(metrics: list) -> list:   # the probe's difference: equal up to rounding, each side's own forward
        return [{k: v for k, v in m.items() if not k.startswith("sync_logp")} for m in metrics if m["kind"] == "train"]

    assert rows(m_thread) == rows(m_proc)
    assert all(torch.equal(w_thread[n], w_proc[n]) for n in w_thread)
    steps = [m for m in m_proc if m["kind"] == "train"]
    assert [m["staleness_max"] for m in steps] == [0.0, 1.0, 1.0, 1.0]
    assert all(m["sync_logp_diff"] < 1e-4 for m in steps[1:])
    assert stage.worker.most_queued <= 1
    assert not workers_alive()


def test_an_error_in_the_child_is_the_thread_workers_error_and_the_child_ends(tmp_path):
    # The child scores a rollout with a reward that raises: the trainer raises what the thread worker
    # raises (type and message), and the stage's end (run_stage's `finally`) leaves no child behind.
    errors = {}
    for worker in ("thread", "process"):
        cfg = grpo(tmp_path, **{"task.rewards": f"[{DATA}:failing_reward]", "rollout.mode": "async",
                                "rollout.worker": worker, "rollout.sync_check": "never",
                                "run_dir": str(tmp_path / worker)})
        with pytest.raises(RuntimeError, match="no `answer` field") as e:
            run_pipeline(cfg, console=QUIET)
        errors[worker] = e.value
    assert type(errors["process"]) is type(errors["thread"]) and str(errors["process"]) == str(errors["thread"])
    assert "failing_reward" in str(errors["process"].__cause__)   # the child's traceback
    assert not workers_alive()


@pytest.mark.multiprocess
def test_a_config_error_in_the_child_exits_2_with_its_paragraph(tmp_path):
    # The child rebuilds the stage from the config; a reward file that fails to load there is the user's
    # ConfigError, raised by the trainer: `trainfit train` exits 2 with the paragraph, no traceback.
    from test_resume import run_cli, write_config

    reward = Path(__file__).parent / "data" / "rewards_worker_process_fails.py"
    cfg = grpo(tmp_path, **{"task.rewards": f"[{reward}:length_reward]", "rollout.mode": "async",
                            "rollout.worker": "process", "rollout.sync_check": "never"})
    r = run_cli(write_config(cfg, tmp_path / "c.yaml"))
    out = " ".join((r.stdout + r.stderr).split())
    assert r.returncode == 2, out[-2000:]
    assert "Traceback" not in out
    assert "task.rewards" in out and "cannot be loaded in the rollout worker process" in out
    assert "fix the error in that file" in out


def processes_with(marker: str) -> list[int]:
    """This user's processes whose environment holds `marker` (a variable the test set: its descendants)."""
    pids = []
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in env.read_bytes():
                pids.append(int(env.parent.name))
        except OSError:
            pass
    return pids


@pytest.mark.multiprocess
def test_sigkill_then_resume_keeps_the_queue_with_the_process_worker(tmp_path, monkeypatch):
    # As test_grpo_async's sigkill test, with the child process: grpo.num_iterations=2, k=1, a checkpoint
    # at step 3 (mid rollout 1, rollout 2 queued), killed after step 4. The resumed run trains what an
    # uninterrupted one does; the reference is the thread worker's (the process samples what it samples).
    import signal

    from test_resume import killed_run, write_config
    from trainfit.train import checkpoint as ckpt
    from trainfit.train.report import read_metrics

    def cfg_for(name: str, worker: str):
        return grpo(tmp_path, **{"run_dir": str(tmp_path / name), "train.max_steps": 8, "train.save_every": 3,
                                 "grpo.num_iterations": 2, "rollout.mode": "async", "rollout.max_staleness": 1,
                                 "rollout.sync_check": "never", "rollout.worker": worker, "train.cpu_threads": 1})

    def train_rows(name: str) -> dict[int, dict]:
        return {m["step"]: m for m in read_metrics(tmp_path / name / "metrics.jsonl") if m["kind"] == "train"}

    run_pipeline(cfg_for("ref", "thread"), console=QUIET)
    expected = train_rows("ref")
    marker = f"TRAINFIT_TEST_KILLED_RUN={tmp_path.name}"
    monkeypatch.setenv(*marker.split("="))   # inherited by the killed trainer and its rollout worker process
    killed = killed_run(write_config(cfg_for("cut", "process"), tmp_path / "cut.yaml"), "--fault", "kill_after_step:4")
    monkeypatch.delenv(marker.split("=")[0])
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    # The trainer died without closing its worker: the child sees the pipe close and exits on its own.
    for _ in range(300):
        if not processes_with(marker):
            break
        time.sleep(0.1)
    assert not processes_with(marker), "the rollout worker process outlived its killed trainer"
    state = ckpt.safe_load(ckpt.latest_checkpoint(tmp_path / "cut" / "checkpoints") / "stage-rank0.pt")["stage"]
    assert state["buffer_round"] == 1 and sorted(state["queue"]) == [2]
    assert {s["version"] for s in state["queue"][2].samples} == {1}
    run_pipeline(cfg_for("cut", "process"), resume=True, console=QUIET)
    assert_resumed_as_uninterrupted(train_rows("cut"), expected, steps=8)
    assert not workers_alive()


def test_plan_holds_what_the_process_adds(tmp_path):
    # LoRA: the child shares the trainer's frozen base (moved to shared memory, not copied) and copies the
    # adapters; the plan adds, to the thread worker's items, the push buffer (the adapters once more), the
    # whole policy the child loads at its start, and the child's runtime.
    from trainfit.plan import plan
    from trainfit.rollout.staleness import WORKER_PROCESS_RUNTIME
    from trainfit.train.async_process import start_worker
    from trainfit.train.run import build_stage

    extra = {"rollout.mode": "async", "rollout.max_staleness": 1, "peft.method": "lora", "peft.r": 4}
    cfg = grpo(tmp_path, **{**extra, "rollout.worker": "process"})
    _, stage, _ = build_stage(cfg, tmp_path / "s")
    worker = start_worker(stage, start=0, last=0)   # samples nothing: only what it holds is read
    worker.close()
    assert not workers_alive()
    frozen = [p for p in stage.model.parameters() if not p.requires_grad]
    assert frozen and all(p.is_shared() for p in frozen)
    assert not any(p.is_shared() for p in stage.model.parameters() if p.requires_grad)   # the trainer's own
    pushed = sum(t.numel() * t.element_size() for t in worker._buffer.values())
    whole = sum(t.numel() * t.element_size() for t in [*stage.model.parameters(), *stage.model.buffers()])
    items = {i.name: i for i in plan(cfg, gpu="h100-80gb").items}
    thread = {i.name for i in plan(grpo(tmp_path, **extra), gpu="h100-80gb").items}
    added = {n: i for n, i in items.items() if n not in thread}
    assert set(added) == {"async worker process's push buffer (shared memory)",
                          "async worker process's policy as loaded, at its start",
                          "async worker process's interpreter, libraries, tokenizer and task"}
    assert added["async worker process's push buffer (shared memory)"].train == pushed
    copy = next(i for n, i in items.items() if n.startswith("async worker's copy"))
    assert copy.train == pushed   # the child's own copy, as the thread's
    assert added["async worker process's policy as loaded, at its start"].rollout == whole
    assert added["async worker process's interpreter, libraries, tokenizer and task"].cpu == WORKER_PROCESS_RUNTIME


@pytest.mark.multiprocess
def test_a_child_killed_without_an_answer_is_an_error_naming_its_exit(tmp_path):
    import os
    import signal

    from trainfit.train.run import build_stage

    cfg = grpo(tmp_path, **{"rollout.mode": "async", "rollout.worker": "process", "rollout.sync_check": "never"})
    _, stage, _ = build_stage(cfg, tmp_path / "s")
    stage.prepare(0)
    os.kill(stage.worker._proc.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=r"rollout worker process .* ended without an answer \(exit code -9\)"):
        for step in (1, 2):
            stage.prepare(step)
    stage.close()
    assert not workers_alive()
