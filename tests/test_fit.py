"""`trainfit fit`: configs that do not fit a card get a fitted config that the planner says FITS, the
planner's suggestions and fit agree, nothing-fits reports the missing GiB, exported files are
consistent (train_batch_size = micro x accum x world), and GRPO groups constrain the micro-batches.

The 7B/8B examples are planned from the architecture catalog (no download); their activation traces
are read from the planner's cache, so a warm run of this file takes a few seconds.
"""

import importlib.util
import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from trainfit.config import ConfigError, apply_override, load_config, validate
from trainfit.plan import plan
from trainfit.plan.fit import TIE, Allow, divisors, fit, override_list, vllm_waves

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# 7B full SFT on one GPU without DeepSpeed: ~75 GiB (bf16 weights, gradients, AdamW moments).
FULL_7B = ("sft_7b_zero2_offload.yaml", "distributed.strategy=auto", "distributed.zero_stage=0",
           "distributed.offload_optimizer=false")


pytestmark = pytest.mark.usefixtures("user_plan_cache")  # offline, the run's own planner cache


@pytest.fixture
def trainer_runs_offload(monkeypatch):
    """fit's and the planner's search with every parallel setting allowed, so the offload branches are
    checked whatever runnable.py says."""
    import trainfit.plan.fit_space as fit_mod   # fit's search space (plan/fit_space.py) asks runnable.py
    import trainfit.plan.suggest as suggest_mod

    monkeypatch.setattr(fit_mod, "parallel_not_trainable", lambda *a, **k: None)
    monkeypatch.setattr(suggest_mod, "parallel_not_trainable", lambda *a, **k: None)


def cfg_of(name, *overrides):
    return load_config(EXAMPLES / name, list(overrides))


def applied(cfg, overrides):
    raw = cfg.model_dump()
    for ov in overrides:
        raw = apply_override(raw, ov)
    return validate(raw)


def assert_fixed_kept(user, fitted):
    """What fit never changes."""
    for section, key in (("train", "global_batch_size"), ("model", "name"), ("data", "max_seq_length"),
                         ("rollout", "max_new_tokens"), ("rollout", "max_prompt_length"),
                         ("grpo", "num_generations"), ("task", "name")):
        assert getattr(getattr(fitted, section), key) == getattr(getattr(user, section), key), (section, key)
    assert fitted.stage == user.stage


def test_7b_full_sft_that_does_not_fit_a_4090_is_fitted_for_an_h200():
    cfg = cfg_of(*FULL_7B)
    assert plan(cfg, gpu="rtx4090", suggest=False).fits is False
    res = fit(cfg, gpu="h200")
    b = res.best
    assert b is not None and b.fits and b.tier == 0
    # Planned again from the fitted config alone (hardware.gpu records the card): FITS, same card.
    again = plan(b.cfg)
    assert again.fits and again.gpu == "H200 141GB" and again.peak == b.plan.peak
    assert_fixed_kept(cfg, b.cfg)
    assert b.cfg.peft.method == "none" and b.cfg.train.optimizer == "adamw"  # not allowed to change


def test_on_a_4090_the_method_changes_only_when_allowed(monkeypatch):
    # Without liger-kernel installed (as on a CPU machine): train.fused_head=auto plans the plain head
    # (plan/head.py planned_fused_head), so bounding the logits is a change fit must make. Where Liger
    # imports, auto already plans its fused head on a CUDA card and fit leaves the head as it is.
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else real(name, *a))
    cfg = cfg_of(*FULL_7B)
    res = fit(cfg, gpu="rtx4090")
    assert res.best is None and res.closest is not None
    # 24 GiB card, 10% margin: ~75 GiB of states and optimizer step cannot fit without a change of
    # method or offload; the result says which opt-in would make it fit.
    # (The closest plan uses the fused LM head and micro-batch 1: ~61 GiB, still ~40 GiB over.)
    assert res.missing == res.closest.plan.peak - res.closest.plan.budget > 35 * 2**30
    assert res.would_fit_with  # e.g. ["--allow-method", "--allow-offload"]
    res = fit(cfg, gpu="rtx4090", allow=Allow(method=True))
    b = res.best
    # LoRA alone does not fit (the planner's single changes say QLoRA), but LoRA with the logits
    # bounded (log-probs in chunks, or the fused head) does: fit combines changes and keeps the base
    # in bf16.
    assert b is not None and b.tier == 2 and b.overrides["peft.method"] == "lora"
    assert b.cfg.model.quantization == "none"
    assert b.cfg.train.logits_chunk_rows or b.cfg.train.fused_head == "chunked"
    assert not plan(applied(cfg, ["peft.method=lora"]), gpu="rtx4090", suggest=False).fits
    assert plan(b.cfg).fits
    assert plan(applied(cfg, override_list(b.overrides)), gpu="rtx4090", suggest=False).fits
    assert_fixed_kept(cfg, b.cfg)


def test_nothing_fits_reports_the_closest_plan_and_missing_gib(tmp_path):
    from trainfit.app.cli import app

    cfg = cfg_of(*FULL_7B)
    res = fit(cfg, gpu="4GB", allow=Allow(True, True, True))
    assert res.best is None and res.closest is not None and not res.closest.fits
    # Nothing searched is smaller than the closest, and the missing bytes are its overshoot.
    assert res.missing == res.closest.plan.peak - res.closest.plan.budget > 0
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["fit", str(EXAMPLES / FULL_7B[0]), *FULL_7B[1:], "--gpu", "4GB", "--allow-method",
                                 "--allow-offload", "--allow-optimizer", "-o", str(out)])
    assert r.exit_code == 1, r.output
    assert "Nothing fits" in r.output and f"{res.missing / 2**30:.1f} GiB missing" in r.output
    assert not out.exists()  # no files for a plan that does not fit


def _fits_of_suggestions(cfg, gpu, n=3):
    p = plan(cfg, gpu=gpu)
    assert p.fits is False
    return [s for s in p.suggestions if s.fits][:n]


def _allow_for(overrides) -> Allow:
    keys = {o.split("=")[0] for o in overrides}
    return Allow(method=bool(keys & {"peft.method", "model.quantization"}),
                 offload=any(o in ("distributed.offload_optimizer=true", "distributed.offload_params=true")
                             for o in overrides),
                 optimizer="train.optimizer" in keys)


@pytest.mark.parametrize("name,overrides,gpu,gpus", [
    (FULL_7B[0], FULL_7B[1:], "64GB", 1),
    (FULL_7B[0], FULL_7B[1:], "a100-40gb", 2),
    (FULL_7B[0], FULL_7B[1:], "rtx4090", 4),
    ("qwen3_8b_grpo_lora_h200.yaml", (), "a100-40gb", 1),
])
def test_planner_suggestions_and_fit_agree(name, overrides, gpu, gpus):
    cfg = cfg_of(name, *overrides, f"distributed.num_gpus={gpus}")
    tops = _fits_of_suggestions(cfg, gpu)
    assert tops
    for s in tops:
        sug_cfg = applied(cfg, s.overrides)
        assert plan(sug_cfg, gpu=gpu, suggest=False).fits  # a fitting suggestion, applied, FITS
        # fit allowed what the suggestion changes finds a plan at least as good: the same or a
        # smaller change of what is trained (tier), and within a tier no slower (same estimate).
        res = fit(cfg, gpu=gpu, allow=_allow_for(s.overrides))
        b = res.best
        assert b is not None and plan(b.cfg).fits
        mine = fit(sug_cfg, gpu=gpu).user  # the suggestion's own estimate, computed the same way
        tier = 3 if sug_cfg.model.quantization != cfg.model.quantization else (
            2 if sug_cfg.peft.method != cfg.peft.method else (1 if sug_cfg.train.optimizer != cfg.train.optimizer else 0))
        assert b.tier <= tier, (s.change, b.overrides)
        if b.tier == tier:
            assert b.step.total <= mine.step.total * (1 + TIE), (s.change, b.overrides)


def test_top_suggestion_is_what_fit_chooses_when_one_change_is_enough(trainer_runs_offload):
    # On one 64 GB card the 7B full SFT is over (weights, gradients and fused AdamW's bf16 moments
    # alone take ~57 GiB of the 57.6 GiB budget): the planner's first fitting change is ZeRO-2 with
    # the optimizer offloaded (same math), which is fit's choice too; fit also drops checkpointing,
    # which the offload leaves room for.
    cfg = cfg_of(*FULL_7B)
    top = _fits_of_suggestions(cfg, "64GB", 1)[0]
    assert "offload" in top.change
    b = fit(cfg, gpu="64GB", allow=Allow(offload=True)).best
    assert set(top.overrides) <= set(override_list(b.overrides)) | {"distributed.zero_stage=2"}
    assert b.cfg.distributed.zero_stage == 2 and b.cfg.distributed.offload_optimizer
    assert plan(b.cfg).fits and not plan(b.cfg).suggestions


def test_cli_writes_consistent_files(tmp_path, monkeypatch, deepspeed_config_parser):
    from trainfit.app.cli import app
    from trainfit.app.doctor.lint_deepspeed import batch_findings, find_auto

    out = tmp_path / "fitted"
    # strategy=deepspeed keeps the search in DeepSpeed (from DDP, FSDP would fit too): its files are the subject
    r = CliRunner().invoke(app, ["fit", str(EXAMPLES / FULL_7B[0]), *FULL_7B[1:], "distributed.strategy=deepspeed",
                                 "--gpu", "a100-40gb", "--num-gpus", "8", "-o", str(out), "--json"])
    assert r.exit_code == 0, r.output
    res = json.loads(r.output)
    assert res["fits"] and res["fitted"]["verdict"] == "FITS" and res["user"]["verdict"] == "DOES NOT FIT"
    assert res["fitted"]["step_s_estimate"] > 0 and "estimate" in res["step_time_note"]
    fitted = load_config(out / "config.yaml")
    bp = fitted.batch_plan()
    assert plan(fitted).fits and fitted.world_size == 8
    ds = json.loads((out / "ds_config.json").read_text())
    assert ds["train_batch_size"] == 32 == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 8
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (bp.micro_batch, bp.accumulation)
    assert ds["zero_optimization"]["stage"] == fitted.distributed.zero_stage > 0
    assert find_auto(ds) == [] and batch_findings(ds, 8, "test", "ds_config.json") == []
    acc = yaml.safe_load((out / "accelerate.yaml").read_text())
    assert acc["num_processes"] == 8 and acc["distributed_type"] == "DEEPSPEED"
    launch = (out / "launch.sh").read_text()
    assert "deepspeed --num_gpus 8" in launch and '"$HERE/config.yaml"' in launch
    parse = deepspeed_config_parser()
    parsed = parse(out / "ds_config.json", 8)
    assert parsed.train_batch_size == parsed.train_micro_batch_size_per_gpu * parsed.gradient_accumulation_steps * 8


def test_single_gpu_fit_writes_a_plain_launch(tmp_path, monkeypatch):
    from trainfit.app.cli import app

    out = tmp_path / "f"
    r = CliRunner().invoke(app, ["fit", str(EXAMPLES / "qwen3_8b_grpo_lora_h200.yaml"), "-o", str(out)])
    assert r.exit_code == 0, r.output
    # Where the files go is said first, before the search (issue 36); by default <config>-fit/ here.
    assert r.output.startswith(f"fit: if a config fits, it is written with its launch files to {out}/;"), r.output
    monkeypatch.chdir(tmp_path)
    here = CliRunner().invoke(app, ["fit", str(EXAMPLES / "qwen3_8b_grpo_lora_h200.yaml"), "--gpu", "1GB"])
    assert here.exit_code == 1 and " ".join(here.output.split()).startswith(
        f"fit: if a config fits, it is written with its launch files to qwen3_8b_grpo_lora_h200-fit/ (in {tmp_path})")
    assert not (tmp_path / "qwen3_8b_grpo_lora_h200-fit").exists()  # nothing fits 1 GB: nothing written
    assert "est. step s (uncalibrated on H200" in r.output and "FITS" in r.output and "estimate" in r.output
    # vLLM is the training machine's package: fit lists it, installed here or not (issue 36).
    assert "Needed on the training machine: vllm (rollout.engine=vllm" in " ".join(r.output.split())
    assert "trainfit train" in (out / "launch.sh").read_text() and not (out / "ds_config.json").exists()


def test_grpo_groups_constrain_the_micro_batches():
    # 64 completions = 8 prompts x 8 generations. On 2 GPUs each holds 32 (4 whole groups): the
    # micro-batches searched divide 32. On 16 GPUs each would hold 4 completions, half a group.
    cfg = cfg_of("qwen3_8b_grpo_lora_h200.yaml", "rollout.engine=hf", "rollout.batch_size=0")
    res = fit(cfg, gpu="a100-80gb", num_gpus=2)
    b = res.best
    assert b is not None and plan(b.cfg).fits
    bp = b.cfg.batch_plan()
    assert bp.per_device_batch == 32 and bp.per_device_batch % 8 == 0
    assert bp.micro_batch in divisors(32) and bp.micro_batch * bp.accumulation * 2 == 64
    assert_fixed_kept(cfg, b.cfg)
    with pytest.raises(ConfigError, match="whole groups"):
        fit(cfg, gpu="a100-80gb", num_gpus=16)


def test_micro_batch_that_no_longer_divides_is_clamped_for_the_comparison():
    cfg = cfg_of(*FULL_7B, "train.micro_batch_size=8")  # 32 per GPU on 1; 4 per GPU on 8
    res = fit(cfg, gpu="h100", num_gpus=8)
    assert res.micro_clamped_from == 8 and res.user.cfg.train.micro_batch_size == 4
    assert res.best is not None and res.best.cfg.batch_plan().per_device_batch == 4


def test_vllm_share_and_waves():
    # The planner's vLLM note is parsed for the KV capacity: guard its wording.
    p = plan(cfg_of("qwen3_8b_grpo_lora_h200.yaml"), suggest=False)
    assert vllm_waves(p) == 1
    tight = plan(cfg_of("qwen3_8b_grpo_lora_h200.yaml", "rollout.gpu_memory_utilization=0.14"), suggest=False)
    assert vllm_waves(tight) > 1
    # On an A100 40GB the user's 50% share does not fit; fit lowers or raises it within the card.
    res = fit(cfg_of("qwen3_8b_grpo_lora_h200.yaml"), gpu="a100-40gb", num_gpus=4)
    assert res.best is not None and plan(res.best.cfg).fits


def test_search_is_cheap_and_prunes():
    res = fit(cfg_of("sft_7b_zero2_offload.yaml"), gpu="h200", allow=Allow(True, True, True))
    # Partial checkpointing adds 3 layer counts per combo; ZeRO-2/3 with offload (trained since) ~110
    # calls; the fused LM head a third logits setting beside chunks on / off (~1.5x).
    assert res.best is not None and res.plan_calls < 1300
    # A tiny model fits at the whole per-GPU batch with everything off: combinations that only add
    # memory savers to it are skipped, and nothing is faster than the user's settings by over 1%.
    # (At the task's ~12-token items a micro-batch of the whole per-GPU batch is the fastest plan.)
    tiny = load_config(None, ["model.name=preset:tiny", "task.name=arithmetic", "train.global_batch_size=32",
                              "train.micro_batch_size=32"])
    res = fit(tiny, gpu="h100")
    assert res.pruned > 0 and res.best.overrides == {} and res.plan_calls < 40


def test_pipeline_configs_are_fitted_one_stage_at_a_time():
    with pytest.raises(ConfigError, match="one stage at a time"):
        fit(cfg_of("demo.yaml"), gpu="h100")


def test_cpu_ram_limit_rules_out_offload(trainer_runs_offload):
    # ZeRO-2 offload of 7.6B parameters keeps ~113 GiB of fp32 masters and moments in CPU RAM.
    cfg = cfg_of(*FULL_7B)
    assert fit(cfg, gpu="64GB", allow=Allow(offload=True)).best.plan.cpu_ram > 100 * 2**30
    res = fit(cfg, gpu="64GB", allow=Allow(offload=True), cpu_ram_gb=64)
    assert res.best is None and res.missing > 0


def test_fit_and_suggestions_offer_only_what_train_runs():
    from trainfit.models.runnable import not_trainable

    # 7B full SFT on one 64 GB card: ZeRO-2 + optimizer offload fits, and the trainer runs it, so the
    # planner suggests it; every suggestion and every fitted config passes trainfit/models/runnable.py.
    cfg = cfg_of(*FULL_7B)
    sugs = plan(cfg, gpu="64GB").suggestions
    assert any("offload" in s.change for s in sugs)
    for s in sugs:
        assert not_trainable(applied(cfg, s.overrides)) is None, s.change
    res = fit(cfg, gpu="64GB", allow=Allow(True, True, True))
    assert res.best is not None and not_trainable(res.best.cfg) is None
    for alt in res.alternatives:
        assert not_trainable(alt.cfg) is None


def test_fit_refuses_what_no_knob_makes_trainable():
    # GRPO does not score with a reward model: no setting fit can change makes train accept it.
    with pytest.raises(ConfigError, match="reward_model"):
        fit(cfg_of("qwen3_8b_grpo_lora_h200.yaml", "rl_models.reward_model=preset:tiny"), gpu="h200")


def test_ppo_is_fitted_only_with_engines_it_trains_on():
    # PPO trains on one process, DDP, DeepSpeed ZeRO 0-3 and FSDP2: every setup fit offers passes
    # train's check.
    from trainfit.models.runnable import not_trainable

    res = fit(cfg_of("ppo_7b_full.yaml"), gpu="h200", allow=Allow(True, True, True))
    found = [c for c in (res.best, *res.alternatives) if c is not None]
    assert found and all(not_trainable(c.cfg) is None for c in found)
    assert not_trainable(cfg_of("ppo_7b_full.yaml", "distributed.strategy=fsdp")) is None


def test_fit_tries_the_fused_head_but_never_with_a_sharded_head():
    """fit's combinations include `train.fused_head=chunked` as a memory saver (fewest savers first),
    and never pair it with FSDP / ZeRO-3, where `trainfit train` refuses it."""
    from trainfit.plan.fit import Allow, _combos

    base = {"stage": "grpo", "model": {"name": "preset:tiny"}, "task": {"name": "arithmetic"},
            "distributed": {"num_gpus": 2}}
    cfg = load_config(None, [], base=base)
    combos = _combos(cfg, Allow(offload=True), {})
    fused = [c for c in combos if c["train.fused_head"] == "chunked"]
    assert fused and any(c["distributed.zero_stage"] == 2 for c in fused)
    assert any(c["distributed.zero_stage"] == 3 for c in combos)
    assert not any(c["distributed.zero_stage"] == 3 or c["distributed.strategy"] == "fsdp" for c in fused)
    assert combos[0]["train.fused_head"] == "auto"   # the user's head first: savers come after
    gemma = load_config(None, ["model.name=google/gemma-2-2b"], base=base)
    assert all(c["train.fused_head"] == "auto" for c in _combos(gemma, Allow(), {}))
