"""What `fit` returns, `train` runs: every fitted config for the shipped examples on a grid of GPUs is
accepted by `trainfit train --dry-run`, and `--dry-run` refuses what `train` refuses."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from typer.testing import CliRunner

from trainfit.core import extras
from trainfit.app.cli import app
from trainfit.config import expand_stages, load_config, to_yaml
from trainfit.plan import plan
from trainfit.plan.fit import Allow, fit
from trainfit.models.runnable import not_trainable, stage_not_trainable

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SINGLE_STAGE = sorted(p.name for p in EXAMPLES.glob("*.yaml")
                      if len(expand_stages(c := load_config(p))) == 1
                      and not stage_not_trainable(c.stage, c.rl_models))
GRID = [("rtx4090", 1), ("a100-40gb", 2), ("h200", 1)]
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None


pytestmark = pytest.mark.usefixtures("user_plan_cache")  # offline, the run's own planner cache


def dry_run(cfg, tmp_path: Path, hub_cache, *args: str):
    # The examples' hub models resolve from a cache holding their catalog config.json: the dry run
    # checks that train would find them (no weights are read).
    hub_cache.catalog(cfg)
    path = tmp_path / "fitted.yaml"
    path.write_text(to_yaml(cfg.model_copy(update={"run_dir": str(tmp_path / "run")})))
    return CliRunner().invoke(app, ["train", str(path), "--dry-run", *args])


@pytest.mark.parametrize("example", SINGLE_STAGE)
def test_every_fitted_config_is_accepted_by_train(tmp_path, example, hub_cache, target_machine):
    cfg = load_config(EXAMPLES / example)
    fitted = waiting = 0  # accepted by the dry run / stopped only on a package not installed here
    for gpu, gpus in GRID:
        res = fit(cfg, gpu=gpu, num_gpus=gpus, allow=Allow(True, True, True))
        for cand in [c for c in (res.best, *res.alternatives) if c is not None]:
            assert not_trainable(cand.cfg) is None, (gpu, gpus, cand.overrides)
            # Train runs it on the machine fit planned for: its GPUs, and (no --cpu-ram-gb given) a node
            # with the CPU RAM the plan counts for offload.
            target_machine(cand.cfg.distributed.num_gpus, cand.plan.cpu_ram)
            r = dry_run(cand.cfg, tmp_path, hub_cache)
            gone = extras.missing(cand.cfg)
            if gone:
                # train runs it once the extra is installed; here it stops on exactly that, nothing else.
                assert r.exit_code == 2 and extras.message(gone[0])[:50] in " ".join(r.output.split()), r.output
                waiting += 1
                continue
            assert r.exit_code == 0, (gpu, gpus, cand.overrides, r.output)
            assert "would train 1 stage into" in r.output
            fitted += 1
    assert fitted or waiting, f"{example}: nothing fitted on any of {GRID}"


def test_dry_run_refuses_what_train_refuses(tmp_path, hub_cache):
    # A stage the trainer does not run, and settings it does not run: exit 2 with the reason, as train.
    for name, over in (("ppo_7b_full.yaml", ["distributed.zero_stage=2", "model.quantization=4bit",
                                              "peft.method=lora"]),
                       ("sft_7b_zero2_offload.yaml", ["distributed.offload_params=true"]),
                       ("grpo_lora.yaml", ["rl_models.reward_model=preset:tiny"])):
        cfg = load_config(EXAMPLES / name, over)
        r = dry_run(cfg, tmp_path, hub_cache)
        assert r.exit_code == 2 and not_trainable(cfg).split(";")[0] in " ".join(r.output.split())
    # A finished run in run_dir is refused without --resume / --overwrite, exactly as train refuses it.
    cfg = load_config(EXAMPLES / "grpo_lora.yaml")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "summary.json").write_text("{}")
    assert dry_run(cfg, tmp_path, hub_cache).exit_code == 2
    assert dry_run(cfg, tmp_path, hub_cache, "--overwrite").exit_code == 0
    assert (tmp_path / "run" / "summary.json").exists()  # a dry run removes nothing


def test_one_card_7b_full_sft_is_fitted_for_an_a800_and_accepted_by_train(tmp_path, hub_cache, target_machine):
    # The guides' one-card case: a 7B full SFT on one A800 80GB needs ZeRO-2 with the optimizer in CPU RAM.
    out = tmp_path / "fit"
    r = CliRunner().invoke(app, ["fit", str(EXAMPLES / "sft_7b_zero2_offload.yaml"), "--gpu", "a800-80gb",
                                 "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "not run" not in r.output and "CPU RAM" in r.output
    cfg = load_config(out / "config.yaml")
    d = cfg.distributed
    assert cfg.engine() == "deepspeed" and d.offload_optimizer and cfg.world_size == 1 and cfg.peft.method == "none"
    assert (out / "ds_config.json").is_file()
    target_machine(1, plan(cfg, suggest=False).cpu_ram)  # one A800 on a node with the RAM the plan counts
    ran = dry_run(cfg, tmp_path, hub_cache)
    if not HAS_DEEPSPEED:
        assert ran.exit_code == 2 and "trainfit[deepspeed]" in ran.output, ran.output
        return
    assert ran.exit_code == 0, ran.output
    assert f"deepspeed ZeRO-{d.zero_stage}" in ran.output and "FITS" in ran.output and "A800" in ran.output
