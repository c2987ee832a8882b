"""Stage dpo on CPU (train.device=cpu, preset:tiny): its config rules, micro-batch invariance, the
precomputed reference equal to the live one, the stage's loss against the published formula in fp64,
and what it learns."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from rich.console import Console
from safetensors.torch import load_file
from typer.testing import CliRunner

from test_distributed import train_here
from test_resume import killed_run
from test_rm import pairs_file  # prompt a+b=, the chosen answer ends in yes, the rejected in no
from trainfit.algos import PREFERENCE_LOSSES
from trainfit.app.cli import app
from trainfit.config import ConfigError, load_config, to_yaml
from trainfit.config.stages import DPO_REFERENCE_FREE, dpo_reference
from trainfit.train.report import read_metrics
from trainfit.train.run import run_pipeline

QUIET = Console(file=open("/dev/null", "w"))


def dpo_config(tmp_path: Path, **over):
    tmp_path.mkdir(parents=True, exist_ok=True)
    base = {"run_dir": str(tmp_path / "run"), "stage": "dpo", "model.name": "preset:tiny",
            "data.path": str(pairs_file(tmp_path / "pairs.jsonl", n=48)), "data.eval_fraction": 0.25,
            "train.device": "cpu", "train.max_steps": 2, "train.global_batch_size": 4,
            "train.micro_batch_size": 4, "train.lr": 3e-3, "logging.progress": "false", "logging.plot": "false",
            "logging.report_to": "none"}
    base.update(over)
    return load_config(None, [f"{k}={v}" for k, v in base.items()])


def train_losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"}


def flat(final_dir: Path) -> torch.Tensor:
    f = load_file(str(final_dir / "model.safetensors"))
    return torch.cat([f[k].flatten().double() for k in sorted(f)])


@pytest.mark.parametrize("over,words", [
    ({"dpo.loss_type": "simpo", "dpo.reference": "copy"}, ["dpo.reference=copy", "reference-free"]),
    ({"dpo.reference": "none"}, ["dpo.reference=none", "simpo, orpo"]),
    ({"dpo.reference": "adapters_off"}, ["adapters_off", "peft.method=lora"]),
    ({"dpo.loss_type": "orpo", "dpo.precompute_reference": "true"}, ["precompute_reference", "nothing"]),
    ({"dpo.loss_type": "ipo", "dpo.label_smoothing": 0.1}, ["dpo.label_smoothing=0.1", "sigmoid, robust and simpo"]),
    ({"dpo.loss_type": "orpo", "dpo.sft_weight": 1.0}, ["dpo.sft_weight=1.0", "ORPO"]),
    ({"dpo.ipo_normalize": "true"}, ["dpo.ipo_normalize=true", "loss_type=ipo", "sigmoid"]),
    ({"dpo.loss_type": "kto", "train.global_batch_size": 1, "train.micro_batch_size": 1}, ["kto", ">= 2"]),
    ({"dpo.beta": 0}, ["dpo.beta", "greater than 0"]),
    ({"dpo.loss_type": "dpo"}, ["dpo.loss_type", "sigmoid"]),
])
def test_bad_dpo_settings_are_one_paragraph_config_errors(tmp_path, over, words):
    with pytest.raises(ConfigError) as e:
        dpo_config(tmp_path, **over)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_bad_dpo_setting_exits_2_without_traceback(tmp_path):
    cfg = dpo_config(tmp_path)
    (tmp_path / "c.yaml").write_text(to_yaml(cfg))
    r = CliRunner().invoke(app, ["train", str(tmp_path / "c.yaml"), "dpo.loss_type=simpo", "dpo.reference=copy"])
    assert r.exit_code == 2 and "Traceback" not in r.output and "reference-free" in r.output
    with pytest.raises(ConfigError, match="preference pairs"):
        load_config(None, ["stage=dpo"])


def test_config_and_algos_agree_on_the_reference_free_losses():
    assert set(DPO_REFERENCE_FREE) == {k for k, s in PREFERENCE_LOSSES.items() if not s.reference}
    assert dpo_reference("sigmoid", "auto", "lora") == "adapters_off"
    assert dpo_reference("sigmoid", "auto", "none") == "copy"
    assert dpo_reference("simpo", "auto", "lora") == "none"


@pytest.mark.parametrize("loss_type", ["sigmoid", "kto", "sigmoid_sft_token"])
def test_micro_one_accum_four_equals_micro_four_accum_one(tmp_path, loss_type):
    # sigmoid_sft_token: RPO's NLL as one token mean over the step (dpo.sft_mean=token), not per micro-batch.
    finals, losses = [], []
    extra = {"dpo.sft_mean": "token"} if loss_type == "sigmoid_sft_token" else {}
    loss_type = loss_type.removesuffix("_sft_token")
    for micro in (1, 4):
        cfg = dpo_config(tmp_path / f"m{micro}", **{"train.micro_batch_size": micro, "dpo.loss_type": loss_type,
                                                    "dpo.sft_weight": 0.0 if loss_type == "kto" else 0.5, **extra})
        r = run_pipeline(cfg, console=QUIET)[0]
        finals.append(flat(r.final_dir))
        losses.append(train_losses(r.stage_dir))
    a, b = finals
    assert (a - b).norm() / a.norm() < 1e-5
    for step, loss in losses[0].items():
        assert losses[1][step] == pytest.approx(loss, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("peft", ["none", "lora"])
def test_precomputed_reference_equals_live_reference(tmp_path, peft):
    runs = {}
    for pre in ("false", "true"):
        cfg = dpo_config(tmp_path / pre, **{"dpo.precompute_reference": pre, "peft.method": peft,
                                           "train.max_steps": 3})
        r = run_pipeline(cfg, console=QUIET)[0]
        runs[pre] = (train_losses(r.stage_dir), r.last_eval)
    assert (tmp_path / "true" / "run" / "reference_logps.pt").exists()
    assert not (tmp_path / "false" / "run" / "reference_logps.pt").exists()
    live, pre = runs["false"], runs["true"]
    assert live[0][3] != live[0][1]   # the policy moved, so the reference matters
    for step, loss in live[0].items():
        assert pre[0][step] == pytest.approx(loss, rel=1e-5, abs=1e-6)
    assert pre[1]["eval_loss"] == pytest.approx(live[1]["eval_loss"], rel=1e-5)


def test_dpo_learns_the_preference_and_saves_a_policy(tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = dpo_config(tmp_path, **{"train.max_steps": 15, "train.global_batch_size": 8, "train.micro_batch_size": 8,
                                  "dpo.beta": 0.5})
    r = run_pipeline(cfg, console=QUIET)[0]
    assert r.last_eval["reward_accuracy"] >= 0.9 > r.first_eval["reward_accuracy"]
    assert r.last_eval["eval_margin"] > 0 and r.last_eval["eval_loss"] < r.first_eval["eval_loss"]
    assert AutoModelForCausalLM.from_pretrained(str(r.final_dir)) is not None


def test_stage_loss_and_gradients_match_published_dpo_in_fp64(tmp_path):
    """DPOStage.loss on preset:tiny in fp64 (live frozen-copy reference) against DPO's formula written
    out here, with log-probs from the full logits of separate forwards of each sequence."""
    from trainfit.train.run import build_stage

    cfg = dpo_config(tmp_path, **{"model.dtype": "fp32", "dpo.beta": 0.3, "dpo.label_smoothing": 0.1,
                                  "dpo.sft_weight": 0.5})
    loaded, stage, _ = build_stage(cfg, tmp_path / "stage")
    model = loaded.model.double()
    stage.ref_model = stage.ref_model.double()
    with torch.no_grad():   # move the policy away from its reference
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = stage.prepare(0)
    ours, _ = stage.loss(model, batch.samples, batch.totals)
    g_ours = torch.autograd.grad(ours, list(model.parameters()))

    def logp(m, prompt, answer):
        ids = torch.tensor([prompt + answer])
        lp = torch.log_softmax(m(input_ids=ids).logits[0].double(), -1)
        return sum(lp[len(prompt) + k - 1, t] for k, t in enumerate(answer))

    terms = []
    for pr in batch.samples:
        lc, lr = logp(model, pr["prompt"], pr["chosen"]), logp(model, pr["prompt"], pr["rejected"])
        with torch.no_grad():
            rc, rr = logp(stage.ref_model, pr["prompt"], pr["chosen"]), logp(stage.ref_model, pr["prompt"], pr["rejected"])
        z = 0.3 * ((lc - rc) - (lr - rr))
        dpo = -0.9 * torch.nn.functional.logsigmoid(z) - 0.1 * torch.nn.functional.logsigmoid(-z)
        terms.append(dpo + 0.5 * -lc / len(pr["chosen"]))
    theirs = torch.stack(terms).mean()
    g_theirs = torch.autograd.grad(theirs, list(model.parameters()))
    assert float(ours.detach()) == pytest.approx(float(theirs.detach()), rel=1e-9)
    for a, b in zip(g_ours, g_theirs):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-10)


def run_cli(config: Path, *args: str):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "trainfit.app.cli", "train", str(config), *args],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.multiprocess
def test_kill_then_resume_gives_the_same_losses_and_reuses_the_reference(tmp_path):
    import signal

    over = {"train.max_steps": 6, "train.save_every": 3, "dpo.precompute_reference": "true"}
    full = run_pipeline(dpo_config(tmp_path / "full", **over), console=QUIET)[0]
    expected = train_losses(full.stage_dir)
    cfg = dpo_config(tmp_path / "crash", **over)
    config = tmp_path / "crash.yaml"
    config.write_text(to_yaml(cfg))
    killed = killed_run(config, "--fault", "kill_after_step:4")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    ref_file = Path(cfg.run_dir) / "reference_logps.pt"
    stamp = ref_file.stat().st_mtime_ns
    resumed = run_cli(config, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout
    assert ref_file.stat().st_mtime_ns == stamp   # read back, not recomputed
    got = train_losses(Path(cfg.run_dir))
    assert sorted(got) == sorted(expected)
    for step in expected:
        assert got[step] == pytest.approx(expected[step], rel=1e-6, abs=1e-7), f"step {step}"


# kto covers the most (its reference point is all-reduced over ranks); sigmoid's is the same path less that.
# FSDP (the policy sharded, the frozen reference copy whole on every rank): slow-only, ~50 s on 2 cores.
@pytest.mark.multiprocess
@pytest.mark.parametrize("loss_type,strategy", [pytest.param("sigmoid", "ddp", marks=pytest.mark.slow), ("kto", "ddp"),
                                                pytest.param("kto", "fsdp", marks=pytest.mark.slow)])
def test_two_gloo_ranks_equal_one_rank(tmp_path, loss_type, strategy):
    cfg = dpo_config(tmp_path, **{"train.max_steps": 3, "train.micro_batch_size": 2, "dpo.loss_type": loss_type})
    assert_two_ranks_train_what_one_rank_trains(cfg, tmp_path, f"distributed.strategy={strategy}")


def assert_two_ranks_train_what_one_rank_trains(cfg, tmp_path: Path, *launch: str) -> None:
    """3 steps of `cfg` on 1 rank (in process) and on 2 gloo ranks launched with `launch`: the same final
    weights (1e-5) and per-step losses, and the losses moved (the comparison is not vacuous)."""
    config = tmp_path / "c.yaml"
    config.write_text(to_yaml(cfg))
    train_here(config, f"run_dir={tmp_path / 'one'}")
    two = run_cli(config, f"run_dir={tmp_path / 'two'}", "distributed.num_gpus=2", *launch)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "2 ranks" in two.stdout
    a, b = flat(tmp_path / "one" / "final"), flat(tmp_path / "two" / "final")
    assert (a - b).norm() / a.norm() < 1e-5
    l1, l2 = train_losses(tmp_path / "one"), train_losses(tmp_path / "two")
    assert l1[3] != l1[1]
    for step, loss in l1.items():
        assert l2[step] == pytest.approx(loss, rel=1e-5, abs=1e-7)


def test_fused_chunked_head_gives_the_plain_heads_loss_and_is_planned(tmp_path):
    from trainfit.plan import plan
    from trainfit.train.run import build_stage

    cfg = dpo_config(tmp_path, **{"train.fused_head": "chunked"})
    loaded, stage, _ = build_stage(cfg, tmp_path / "stage")
    assert stage.head == "chunked"
    batch = stage.prepare(0)
    fused = stage.loss(loaded.model, batch.samples, batch.totals)[0]
    stage.head = "off"
    plain = stage.loss(loaded.model, batch.samples, batch.totals)[0]
    assert float(fused.detach()) == pytest.approx(float(plain.detach()), rel=1e-5)
    assert "fused" in next(i.note for i in plan(cfg, gpu="h100", suggest=False).items if i.name == "logits + loss peak")


def test_oom_recovery_shrinks_by_whole_pairs_and_keeps_the_update(tmp_path):
    runs = {}
    for name, fault in (("plain", None), ("oom", "oom_at_micro:1")):
        cfg = dpo_config(tmp_path / name, **{"train.global_batch_size": 4, "train.micro_batch_size": 4})
        r = run_pipeline(cfg, console=QUIET, fault=fault)[0]
        runs[name] = (flat(r.final_dir), train_losses(r.stage_dir), read_metrics(r.stage_dir / "metrics.jsonl"))
    ooms = [m for m in runs["oom"][2] if m["kind"] == "oom"]
    assert ooms and ooms[0]["micro_batch_size"] == 2   # 2 pairs = 4 sequences a forward, no pair split
    a, b = runs["plain"][0], runs["oom"][0]
    assert (a - b).norm() / a.norm() < 1e-5
    for step, loss in runs["plain"][1].items():
        assert runs["oom"][1][step] == pytest.approx(loss, rel=1e-5)


def _tiny_dir(path: Path) -> Path:
    """preset:tiny saved as a bf16 transformers directory (a quantized base loads from a real directory)."""
    from transformers import AutoModelForCausalLM

    from trainfit.models.presets import preset_config

    from trainfit.models.tokenizer import build_tokenizer

    AutoModelForCausalLM.from_config(preset_config("preset:tiny"), dtype=torch.bfloat16).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("adapters", [{"peft.method": "dora"},
                                      {"peft.method": "lora", "model.quantization": "4bit", "model.dtype": "bf16"}],
                         ids=["dora", "qlora"])
def test_dora_and_qlora_train_against_the_base_with_adapters_off(tmp_path, adapters):
    # Zero-initialised adapters leave the policy equal to its reference (the same base, adapters off), so
    # every pair's log-ratio difference is 0 at step 1 and the sigmoid loss is -log sigmoid(0) = ln 2.
    over = dict(adapters)
    if "model.quantization" in over:
        over["model.name"] = str(_tiny_dir(tmp_path / "base"))
    cfg = dpo_config(tmp_path, **{**over, "train.max_steps": 3})
    assert dpo_reference(cfg.dpo.loss_type, cfg.dpo.reference, cfg.peft.method) == "adapters_off"
    r = run_pipeline(cfg, console=QUIET)[0]
    losses = train_losses(r.stage_dir)
    assert losses[1] == pytest.approx(math.log(2), abs=1e-4)
    assert losses[3] < losses[1]   # the adapters learned: the chosen answers gained on the rejected ones
    saved = json.loads((r.final_dir / "adapter_config.json").read_text())   # adapters saved, base untouched
    assert saved["use_dora"] == (adapters["peft.method"] == "dora")


@pytest.mark.deepspeed  # a training run under DeepSpeed: `make test-deepspeed`
def test_zero2_on_two_ranks_equals_one_plain_rank(tmp_path):
    cfg = dpo_config(tmp_path, **{"train.max_steps": 3, "train.micro_batch_size": 2})
    assert_two_ranks_train_what_one_rank_trains(cfg, tmp_path, "distributed.strategy=deepspeed", "distributed.zero_stage=2")
