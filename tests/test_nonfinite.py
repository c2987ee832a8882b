"""The non-finite guard (train/nonfinite.py), on CPU (train.device=cpu) with preset:tiny: an injected NaN loss or
gradient skips the optimizer step in every stage (weights and learning rate unchanged across it, metrics.jsonl
records it, the run finishes finite); train.max_bad_steps of them in a row stop the run with exit 1 and a paragraph
that says what to try, the last checkpoint finite; no checkpoint is written from non-finite weights."""

from __future__ import annotations

import importlib.util
import math
import multiprocessing
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from conftest import tiny_config
from test_distributed import final_params, stage_cfg, train, write
from test_dpo import dpo_config
from test_ppo import ppo_cfg
from test_resume import QUIET, write_config
from test_rm import pairs_file, rm_config
from trainfit.app.cli import app
from trainfit.config import ConfigError
from trainfit.core.dist import SINGLE, Ranks
from trainfit.train import checkpoint as ckpt
from trainfit.train.faults import Faults
from trainfit.train.loop import train_stage
from trainfit.train.nonfinite import NonFiniteGuard, NonFiniteStop
from trainfit.train.report import read_metrics
from trainfit.train.run import build_stage, run_pipeline

REWARD = str(Path(__file__).parent / "data" / "rewards_for_tests.py") + ":length_reward"


class Snapshots(Faults):
    """The injected faults of `spec`, and the trainable weights after every step."""

    def __init__(self, spec: str, model):
        super().__init__(spec)
        self.model = model
        self.after: dict[int, torch.Tensor] = {}

    def after_step(self, step: int) -> None:
        self.after[step] = torch.cat([p.detach().flatten().clone() for p in self.model.parameters()
                                      if p.requires_grad])


def stage_config(tmp_path: Path, stage: str, **over):
    three = {"train.max_steps": 3, **over}
    few = {"task.num_eval": 4}   # the held-out evaluations before and after stay short
    if stage in ("dpo", "rm"):   # a few pairs: the held-out evaluations before and after stay short
        pairs = str(pairs_file(tmp_path / "pairs.jsonl", n=24))
        make = dpo_config if stage == "dpo" else rm_config
        return make(tmp_path / "data", **{"data.path": pairs, "train.global_batch_size": 4,
                                          "train.micro_batch_size": 4, **three})
    if stage == "ppo":
        return ppo_cfg(tmp_path, **few, **three)
    extra = {"task.rewards": f"[{REWARD}]"} if stage == "grpo" else {}
    return tiny_config(tmp_path, stage, **{"train.global_batch_size": 4, "train.micro_batch_size": 4,
                                           **few, **extra, **three})


@pytest.mark.parametrize("stage,fault", [("sft", "nan_loss"), ("dpo", "nan_loss"), ("rm", "nan_grad"),
                                         ("grpo", "nan_loss"), ("ppo", "nan_grad")])
def test_one_nan_step_is_skipped_and_the_run_finishes_finite(tmp_path, stage, fault):
    cfg = stage_config(tmp_path, stage)
    stage_dir = tmp_path / "stage"
    loaded, st, _ = build_stage(cfg, stage_dir)
    faults = Snapshots(f"{fault}:2", loaded.model)
    train_stage(cfg, loaded, st, stage_dir, resume=False, console=QUIET, faults=faults, save_final=lambda p, **_: p)

    w = faults.after
    assert torch.equal(w[2], w[1])               # the skipped step changed no weight
    assert not torch.equal(w[3], w[2])           # the next one trains again
    assert torch.isfinite(w[3]).all()
    rows = {m["step"]: m for m in read_metrics(stage_dir / "metrics.jsonl") if m["kind"] == "train"}
    assert rows[2]["skipped_nonfinite"] == 1
    assert rows[2]["nonfinite"] == ("loss,grad_norm" if fault == "nan_loss" else "grad_norm")
    assert "skipped_nonfinite" not in rows[1] and "skipped_nonfinite" not in rows[3]
    assert rows[2]["lr"] == rows[1]["lr"] != rows[3]["lr"]   # the schedule stood still with the weights
    assert math.isfinite(rows[3]["loss"]) and math.isfinite(rows[3]["grad_norm"])


def test_max_bad_steps_in_a_row_stop_the_run_and_keep_the_checkpoint_finite(tmp_path):
    cfg = tiny_config(tmp_path, "sft", **{"train.max_steps": 6, "train.save_every": 1, "train.max_bad_steps": 2,
                                          "train.global_batch_size": 4, "train.micro_batch_size": 4})
    config = write_config(cfg, tmp_path / "c.yaml")
    out = CliRunner().invoke(app, ["train", str(config), "--fault", "nan_loss:3-4"])
    assert out.exit_code == 1, out.output
    said = " ".join(out.output.split())
    assert "train.max_bad_steps=2: steps 3-4 in a row had a non-finite loss" in said
    assert "stops at step 4" in said and "train.lr" in said and "bf16 rather than fp16" in said
    assert "data around that step" in said and "Traceback" not in out.output

    run = Path(cfg.run_dir)
    latest = ckpt.latest_checkpoint(run / "checkpoints")
    assert latest is not None and latest.name == "step-000003"   # the stop writes none at step 4
    weights = load_file(str(latest / "model.safetensors"))
    assert all(torch.isfinite(v).all() for v in weights.values())
    rows = [m for m in read_metrics(run / "metrics.jsonl")]
    assert [m["step"] for m in rows if m.get("skipped_nonfinite")] == [3, 4]
    assert rows[-1]["kind"] == "stop" and "train.max_bad_steps" in rows[-1]["message"]
    assert not (run / "final").exists()


def test_a_finite_step_resets_the_count(tmp_path):
    # 2 bad, 1 good, 2 bad with max_bad_steps=3: never 3 in a row, so the run finishes.
    cfg = stage_config(tmp_path, "sft", **{"train.max_steps": 5, "train.max_bad_steps": 3})
    loaded, st, _ = build_stage(cfg, tmp_path / "s")
    faults = Snapshots("nan_loss:1-2,nan_grad:4-5", loaded.model)
    train_stage(cfg, loaded, st, tmp_path / "s", resume=False, console=QUIET, faults=faults,
                save_final=lambda p, **_: p)
    assert torch.equal(faults.after[5], faults.after[3]) and not torch.equal(faults.after[3], faults.after[2])


def test_a_checkpoint_of_nonfinite_weights_is_refused(tmp_path):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    kw = dict(model=model, is_peft=False, optimizer=opt, scheduler=sched, stage_state={}, keep=2)
    ckpt.save_checkpoint(tmp_path, 1, **kw)
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteStop, match=r"checkpoint of step 2 was not written: .*NaN or inf values \(weight\)"):
        ckpt.save_checkpoint(tmp_path, 2, **kw)
    assert ckpt.latest_checkpoint(tmp_path).name == "step-000001" and not (tmp_path / "step-000002").exists()


class _Logger:
    def __init__(self):
        self.rows = []

    def log(self, step, metrics, kind="train"):
        self.rows.append((step, kind, metrics))

    def close(self):
        pass


def test_deepspeed_steps_are_read_not_redone():
    guard = NonFiniteGuard(2, SINGLE, QUIET, _Logger())
    # fp16: the loss scaler's overflow skip with a finite loss is logged, not counted as a bad batch.
    assert guard.deepspeed_skipped(1.0, float("inf"), applied=False, fp16=True)
    assert guard.record(1, True) == {"skipped_nonfinite": 1, "nonfinite": "loss_scale_overflow"}
    assert guard.in_a_row == 0
    # bf16: the engine skipped a NaN loss's step: counted; the second in a row stops the run.
    assert guard.deepspeed_skipped(float("nan"), float("inf"), applied=False, fp16=False)
    guard.record(2, True)
    guard.stop_if_due(2, lambda: None)
    assert guard.deepspeed_skipped(float("nan"), float("nan"), applied=False, fp16=False)
    guard.record(3, True)
    with pytest.raises(NonFiniteStop, match="train.max_bad_steps=2: steps 2-3 in a row"):
        guard.stop_if_due(3, lambda: None)
    # A non-finite step the engine applied (fp32: no overflow check) cannot be undone: stop at once.
    with pytest.raises(NonFiniteStop, match="applied the step"):
        guard.deepspeed_skipped(float("nan"), 1.0, applied=True, fp16=False)
    assert not guard.deepspeed_skipped(1.0, 1.0, applied=True, fp16=False)


def test_max_bad_steps_is_at_least_one(tmp_path):
    with pytest.raises(ConfigError, match=r"train.max_bad_steps=0.*at least 1"):
        tiny_config(tmp_path, "sft", **{"train.max_bad_steps": 0})
    assert tiny_config(tmp_path, "sft").train.max_bad_steps == 5
    with pytest.raises(ConfigError, match="nan_loss:STEP"):
        Faults("nan_loss:2-x")


def _rank_verdict(rank: int, init: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    # Only rank 1's loss share is NaN; the gradient norm (global after DDP's all-reduce) is finite.
    guard = NonFiniteGuard(5, Ranks(rank, 2), QUIET, _Logger())
    skip = guard.check(float("nan") if rank else 0.5, 1.0)
    Path(f"{out}.{rank}").write_text(f"{skip} {','.join(guard.what)}")
    dist.destroy_process_group()


def test_every_rank_skips_when_one_ranks_loss_is_nan(tmp_path):
    # Two gloo ranks in forked children (no fresh interpreter's imports): both must skip the same step.
    ctx = multiprocessing.get_context("fork")
    init, out = f"file://{tmp_path / 'rendezvous'}", str(tmp_path / "verdict")
    procs = [ctx.Process(target=_rank_verdict, args=(r, init, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert [Path(f"{out}.{r}").read_text() for r in (0, 1)] == ["True loss", "True loss"]


@pytest.mark.deepspeed  # a training run under DeepSpeed: `make test-deepspeed`
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs the deepspeed extra")
def test_zero2_skips_the_nan_step_once_as_the_plain_loop_does(tmp_path):
    # ZeRO-2 steps inside the engine, whose own check drops the NaN step; the guard reads that and holds the
    # schedule. The result equals the plain loop's with the same fault: no second step, no schedule drift.
    config = write(stage_cfg(tmp_path, "sft", "z2"), tmp_path / "c.yaml")
    run_pipeline(stage_cfg(tmp_path, "sft", "plain"), console=QUIET, fault="nan_loss:2")
    zero2 = train(config, "distributed.strategy=deepspeed", "distributed.zero_stage=2",
                  "--fault", "nan_loss:2")
    assert zero2.returncode == 0, zero2.stderr[-3000:]
    rows = {m["step"]: m for m in read_metrics(tmp_path / "z2" / "metrics.jsonl") if m["kind"] == "train"}
    assert rows[2]["skipped_nonfinite"] == 1 and rows[2]["lr"] == rows[1]["lr"]
    a, b = final_params(tmp_path / "plain"), final_params(tmp_path / "z2")
    assert (a - b).norm() / a.norm() < 1e-5
