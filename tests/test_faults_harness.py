"""The fault-injection harness (bench/faults.py), its fast part: kill moments drawn again from the seed, the
comparison flagging a differing or non-finite tensor and lost or repeated metrics rows, the resume's metrics
truncation it found wrong, and one real SIGKILL + resume of a tiny CPU sft run (train.device=cpu) compared
with the uninterrupted one. The full harness is `make faults`, a benchmark."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from bench.faults import render_table
from bench.faults_compare import compare_metrics, compare_weights, verdict
from bench.faults_runner import draw_moments, faulted_run, preload, run_process
from bench.faults_stages import STAGES, overrides_for, write_config
from trainfit.train.report import MetricsLogger
from trainfit.train.run import run_pipeline  # noqa: F401 - imported here once, not in each forked run


def test_kill_moments_are_drawn_again_from_the_seed():
    first = draw_moments(7, "dpo", "kill", 10, wall_s=4.0)
    assert draw_moments(7, "dpo", "kill", 10, wall_s=4.0) == first
    assert all(0.0 <= t < 4.0 for t in first) and len(set(first)) == 10
    # Another seed, stage or kind draws other moments; a stage's draws do not depend on the others'.
    assert draw_moments(8, "dpo", "kill", 10, 4.0) != first
    assert draw_moments(7, "ppo", "kill", 10, 4.0) != first
    assert draw_moments(7, "dpo", "term", 10, 4.0) != first


def _weights(run: Path, tensors: dict) -> Path:
    (run / "final").mkdir(parents=True)
    save_file(tensors, str(run / "final" / "model.safetensors"))
    return run


def test_comparison_flags_a_differing_and_a_non_finite_tensor(tmp_path):
    w = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    ref = _weights(tmp_path / "ref", w)
    same = compare_weights(ref, _weights(tmp_path / "same", {k: v.clone() for k, v in w.items()}))
    assert same["tensors"] == 2 and same["differing"] == [] and same["non_finite"] == []
    # One value one float32 ulp away: differs; a bf16 inf: differs and is not finite.
    off = {"a": torch.nextafter(w["a"], torch.tensor(100.0)) * (torch.arange(6).reshape(2, 3) == 4) +
           w["a"] * (torch.arange(6).reshape(2, 3) != 4), "b": w["b"].clone()}
    off["b"][2] = float("inf")
    got = compare_weights(ref, _weights(tmp_path / "off", off))
    assert got["differing"] == ["final/model.safetensors:a", "final/model.safetensors:b"]
    assert got["non_finite"] == ["final/model.safetensors:b"]
    metrics = {"differing": [], "missing": [], "duplicated": [], "unreadable": 0}
    assert not verdict(got, metrics)["equal"] and not verdict(got, metrics)["consistent"]
    assert verdict(same, metrics) == {"lost": 0, "equal": True, "consistent": True}


def _rows(path: Path, rows: list, cut: str = "") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + cut)
    return path


def test_comparison_counts_missing_repeated_and_cut_rows_as_lost(tmp_path):
    train = [{"step": s, "kind": "train", "loss": 1.0 / s, "time": s, "step_time": 0.1} for s in (1, 2, 3)]
    ref = _rows(tmp_path / "ref", [{"step": 0, "kind": "eval", "accuracy": 0.0}, *train,
                                   {"step": 3, "kind": "eval", "accuracy": 0.5}])
    # Timings differ, the rest is equal: nothing differs.
    again = [{**r, "time": 99, "step_time": 9.9} for r in train]
    ok = compare_metrics(ref, _rows(tmp_path / "ok", [{"step": 0, "kind": "eval", "accuracy": 0.0}, *again,
                                                      {"step": 3, "kind": "eval", "accuracy": 0.5}]))
    assert ok == {"steps": 3, "duplicated": [], "missing": [], "unreadable": 0, "differing": []}
    bad = compare_metrics(ref, _rows(tmp_path / "bad", [train[0], {**train[2], "loss": 0.3},
                                                        {"step": 3, "kind": "eval", "accuracy": 0.5},
                                                        {"step": 3, "kind": "eval", "accuracy": 0.5}], cut='{"ste'))
    assert bad["missing"] == ["metrics.jsonl:2"] and bad["duplicated"] == ["metrics.jsonl:eval@3"]
    assert bad["unreadable"] == 1 and bad["differing"] == ["metrics.jsonl:train@3:loss"]
    assert verdict({"missing": [], "differing": [], "non_finite": [], "files": 1}, bad)["lost"] == 3


def test_resume_truncation_drops_the_redone_final_rows_and_a_cut_line(tmp_path):
    """Regression: a kill after the last step's final evaluation was logged (before the stage was marked done)
    left its eval row in place, and the resume logged it again; a line cut short by a kill broke the resume."""
    rows = [{"step": 5, "kind": "train"}, {"step": 5, "kind": "eval"}, {"step": 6, "kind": "train"},
            {"step": 6, "kind": "eval"}, {"step": 6, "kind": "memory"}, {"step": 7, "kind": "train"}]
    logger = MetricsLogger(_rows(tmp_path / "last", rows, cut='{"step": 7, "ki'))
    logger.truncate_after(6, redone=("eval", "memory"))
    kept = [json.loads(ln) for ln in logger.path.read_text().splitlines()]
    assert kept == rows[:3] and not logger.path.with_name("metrics.jsonl.tmp").exists()
    logger = MetricsLogger(_rows(tmp_path / "mid", rows, cut='{"step": 7, "ki'))
    logger.truncate_after(6)   # a checkpoint before the last step: its evaluation came before the checkpoint
    assert [json.loads(ln) for ln in logger.path.read_text().splitlines()] == rows[:5]


def test_table_says_what_a_non_exact_stage_compares():
    row = {"stage": "grpo-async", "kind": "kill", "faults": 3, "runs": 2, "recovered": 2, "equal": 1,
           "consistent": 2, "lost": 0, "deterministic": False, "why_not_exact": "two threads",
           "compared": "the step count", "command": "python -m bench.faults --stages grpo-async"}
    table = render_table({"rows": [row, {**row, "stage": "sft", "deterministic": True, "equal": 2}]})
    assert "| grpo-async | kill | 3 | 2/2 | 1/2 bit for bit; 2/2 consistent (*) | 0 |" in table
    assert "| sft | kill | 3 | 2/2 | 2/2 | 0 |" in table
    assert "- (*) grpo-async: two threads; compared: the step count." in table


def test_a_sigkilled_sft_run_resumes_equal_to_the_uninterrupted_one(tmp_path):
    """CPU (train.device=cpu): 3 steps of tiny sft, killed half-way through its uninterrupted wall time (a
    forked child, as the harness runs it), resumed with --resume-or-start: weights and metrics bit for bit."""
    if torch.cuda.is_initialized():
        pytest.skip("a forked child cannot use CUDA again")

    def config(name: str) -> Path:
        over = {**overrides_for(STAGES["sft"], tmp_path, tmp_path / name), "train.max_steps": 3}
        return write_config(over, tmp_path / f"{name}.yaml")

    ref = run_process(["train", str(config("ref"))], tmp_path / "ref.log", modules_out=tmp_path / "modules.txt")
    assert ref.rc == 0, ref.tail
    preload(tmp_path / "modules.txt")   # the two runs below start warm
    chain = faulted_run(config("cut"), tmp_path / "cut", signal.SIGKILL, iter([ref.wall_s / 2]), 1, tmp_path)
    assert chain["signals"] == 1 and chain["recovered"], chain
    assert [p["rc"] for p in chain["processes"]] == [-signal.SIGKILL, 0]
    ref_dir, cut_dir = tmp_path / "ref", tmp_path / "cut"
    got = verdict(compare_weights(ref_dir, cut_dir), compare_metrics(ref_dir, cut_dir))
    assert got == {"lost": 0, "equal": True, "consistent": True}


def _gone(pid: int) -> bool:
    """Ended: no such process, or a zombie waiting for its reaper."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="Linux: prctl(PR_SET_PDEATHSIG)")
def test_the_process_workers_child_ends_when_its_trainer_is_killed(tmp_path):
    """Regression: a SIGKILLed trainer (rollout.worker=process) left its worker running until the rollout in hand
    was done (the harness counted it outliving the run). Here a stand-in trainer forks a stand-in worker that
    makes the worker's call and then sleeps; killing the trainer ends the worker at once."""
    from trainfit.train.async_process import _die_with_trainer

    ready = tmp_path / "worker.pid"
    trainer = os.fork()
    if trainer == 0:
        worker = os.fork()
        if worker == 0:
            _die_with_trainer(os.getppid())
            ready.write_text(str(os.getpid()))
            time.sleep(60)
            os._exit(0)
        time.sleep(60)
        os._exit(0)
    while not ready.exists() or not ready.read_text():
        time.sleep(0.01)
    worker = int(ready.read_text())
    os.kill(trainer, signal.SIGKILL)
    os.waitpid(trainer, 0)
    for _ in range(500):
        if _gone(worker):
            break
        time.sleep(0.01)
    try:
        assert _gone(worker)
    finally:
        if not _gone(worker):
            os.kill(worker, signal.SIGKILL)
