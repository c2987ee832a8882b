"""One check behind three doors (issue 21): `plan`, `train --dry-run` and `train` refuse the same broken
inputs with the same exit code and the same paragraph, and agree on DOES NOT FIT (exit 1); models are
found locally, in the Hugging Face cache, or refused at once naming both places. CPU only
(train.device=cpu, preset:tiny); nothing is downloaded."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from trainfit.core import extras
from trainfit.models import hub
from trainfit.app.cli import app
from trainfit.config import ConfigError, load_config
from trainfit.data.text import parse_line

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def _error(output: str) -> str:
    """The one-paragraph error a door printed, whitespace-normalised."""
    text = " ".join(output.split())
    return text[text.index("error:"):] if "error:" in text else ""


def _sft_config(tmp_path: Path) -> Path:
    rows = [{"prompt": f"{i}+1=", "completion": str(i + 1)} for i in range(16)]
    (tmp_path / "good.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"stage": "sft", "run_dir": str(tmp_path / "run"), "model": {"name": "preset:tiny"},
           "data": {"path": str(tmp_path / "good.jsonl"), "max_seq_length": 32},
           "train": {"global_batch_size": 4, "micro_batch_size": 4, "max_steps": 1, "device": "cpu"},
           "logging": {"report_to": "none", "progress": False, "plot": False}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _broken_inputs(tmp_path: Path) -> dict[str, list[str]]:
    good = (tmp_path / "good.jsonl").read_text().splitlines()
    (tmp_path / "bad.jsonl").write_text("\n".join(good[:2] + ['{"prompt": "3+1=", "completion": "4}'] + good[2:]))
    (tmp_path / "nofield.jsonl").write_text("\n".join(good[:5] + ['{"prompt": "3+1="}']))
    grpo = ["stage=grpo", "data.path=null", "task.name=arithmetic", "grpo.num_generations=4"]
    return {"missing data file, past the plan": [f"data.path={tmp_path / 'missing.jsonl'}"],
            "malformed JSONL line": [f"data.path={tmp_path / 'bad.jsonl'}"],
            "JSONL row without the format's field": [f"data.path={tmp_path / 'nofield.jsonl'}"],
            "nonexistent model": ["model.name=nobody/nothing-1b"],
            "data file and task both given to sft": ["task.name=arithmetic"],
            "vllm engine without vllm, past the plan": grpo + ["rollout.engine=vllm"]}


# The packages only the training machine imports (train/preflight.py): `plan` lists them, train refuses.
TRAINING_MACHINE = ("vllm", "bitsandbytes", "deepspeed", "liger_kernel", "flash_attn", "flash_attn_interface")


def _without(monkeypatch, *names):
    # As tests/test_distributed.py simulates a missing extra: find_spec does not find it.
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.split(".")[0] in names
                        else real(name, *a))


def _without_vllm(monkeypatch):
    _without(monkeypatch, "vllm")


def test_three_doors_refuse_each_broken_input_alike(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _without_vllm(monkeypatch)
    cfg = _sft_config(tmp_path)
    for what, ov in _broken_inputs(tmp_path).items():
        doors = {"plan": _invoke("plan", cfg, *ov), "dry-run": _invoke("train", cfg, *ov, "--dry-run"),
                 "train": _invoke("train", cfg, *ov)}
        if "past the plan" in what:  # a package only the training machine needs: plan lists it and plans;
            plan = doors.pop("plan")    # data not here yet (a run writes it first): planned at the caps, said so
            said = "is not on this machine (yet): planned at the length caps" if "data" in what else \
                "needed on the training machine: vllm"
            assert plan.exit_code == 0 and said in " ".join(plan.output.split()), plan.output
        messages = {door: _error(r.output) for door, r in doors.items()}
        assert {r.exit_code for r in doors.values()} == {2}, (what, {d: r.output for d, r in doors.items()})
        assert len(set(messages.values())) == 1 and messages["train"], (what, messages)
        assert "Traceback" not in messages["train"]
        assert not (tmp_path / "run").exists(), what  # refused before anything was written
    msgs = {what: _error(_invoke("train", cfg, *ov, "--dry-run").output) for what, ov in _broken_inputs(tmp_path).items()}
    missing = msgs["missing data file, past the plan"]
    assert "missing.jsonl" in missing and "does not exist" in missing
    assert "bad.jsonl line 3" in msgs["malformed JSONL line"]
    assert "line 6" in msgs["JSONL row without the format's field"] and "completion" in msgs["JSONL row without the format's field"]
    vllm = msgs["vllm engine without vllm, past the plan"]
    assert vllm == "error: " + " ".join(extras.VLLM_MISSING.split()) and "rollout.engine=hf" in vllm
    both = msgs["data file and task both given to sft"]
    assert "good.jsonl" in both and "task.name=arithmetic" in both and "ignore data.path" in both


def test_the_good_config_passes_all_three_doors(tmp_path):
    cfg = _sft_config(tmp_path)
    assert _invoke("plan", cfg).exit_code == 0
    dry = _invoke("train", cfg, "--dry-run")
    assert dry.exit_code == 0 and "would train 1 stage into" in dry.output, dry.output
    assert not (tmp_path / "run").exists()
    ran = _invoke("train", cfg)
    assert ran.exit_code == 0, ran.output
    assert (tmp_path / "run" / "summary.json").exists()


def test_a_json_error_reads_once_at(tmp_path):
    # json's message for an unterminated string already ends in "at": "starting at column 13".
    with pytest.raises(ConfigError) as e:
        parse_line('{"prompt": "x', tmp_path / "d.jsonl", 4, "data.path")
    assert "starting at column" in str(e.value) and "at at" not in str(e.value)


def test_a_missing_model_fails_at_once_naming_the_cache_and_the_hub_id(tmp_path, monkeypatch):
    # HF_HUB_OFFLINE unset: one quick question to the hub (no network here: a failed name lookup; with
    # a network: the hub's "no such repo"), no minute of retries by the loaders.
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # setenv, not delenv: the test's end restores it either way
    monkeypatch.delenv("TRAINFIT_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    cfg = _sft_config(tmp_path)
    start = time.monotonic()
    r = _invoke("train", cfg, "model.name=nobody/nothing-1b")
    elapsed = time.monotonic() - start
    assert r.exit_code == 2, r.output
    msg = _error(r.output)
    assert "nobody/nothing-1b" in msg and hub.cache_dir() in msg and "no such local path" in msg
    assert "Retrying" not in r.output and "cannot load a tokenizer" not in msg
    assert elapsed < 5, f"{elapsed:.1f} s"
    for door in (["plan", cfg], ["train", cfg, "--dry-run"]):
        assert _error(_invoke(*door, "model.name=nobody/nothing-1b").output) == msg


def _tiny_model_dir(tmp_path: Path) -> Path:
    import torch

    from trainfit.config import ModelConfig, PeftConfig
    from trainfit.models.policy import load_policy
    from trainfit.models.save import save_pretrained

    out = tmp_path / "tiny-model"
    save_pretrained(load_policy(ModelConfig(name="preset:tiny"), PeftConfig(), torch.device("cpu")), out)
    return out


def test_a_hub_id_in_the_local_cache_trains(tmp_path, hub_cache):
    hub_cache.put("someone/tiny-cached", _tiny_model_dir(tmp_path))
    cfg = _sft_config(tmp_path)
    r = _invoke("train", cfg, "model.name=someone/tiny-cached")
    assert r.exit_code == 0, r.output
    assert hub.resolve_model("someone/tiny-cached").kind == "cache"
    # A local directory resolves as itself; a directory without config.json is refused by name.
    assert hub.resolve_model(str(tmp_path / "tiny-model")).kind == "local"
    with pytest.raises(ConfigError, match="without config.json"):
        hub.resolve_model(str(tmp_path))


def test_train_reads_a_cached_model_offline_when_the_hub_is_unreachable(tmp_path, hub_cache, monkeypatch):
    # The cache has the model but the hub does not answer: the loaders must not retry each file.
    from huggingface_hub import constants

    from trainfit.train.preflight import preflight

    hub_cache.put("someone/tiny-cached", _tiny_model_dir(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # go_offline sets it to 1; the test's end restores it
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "ask_hub", lambda repo, revision=None: (None, "the hub could not be reached (test)"))
    cfg = load_config(_sft_config(tmp_path), ["model.name=someone/tiny-cached"])
    preflight(cfg, "dry-run")
    assert not constants.HF_HUB_OFFLINE  # a dry run loads nothing: it leaves the client as it was
    preflight(cfg, "train")
    assert constants.HF_HUB_OFFLINE and hub.offline()


def _ppo_ddp(tmp_path: Path) -> list[str]:
    return [str(EXAMPLES / "ppo_7b_full.yaml"), "distributed.strategy=ddp", "distributed.zero_stage=0",
            f"run_dir={tmp_path / 'run'}"]


def test_does_not_fit_is_exit_1_at_every_door(tmp_path, hub_cache, user_plan_cache, target_machine):
    # The example names its card (hardware.gpu: a100-80gb); under DDP each GPU holds every model whole.
    args = _ppo_ddp(tmp_path)
    cfg = load_config(args[0], args[1:])
    hub_cache.catalog(cfg)
    target_machine(cfg.distributed.num_gpus)  # its GPUs are visible: what stops it is the plan, on any machine
    plan, dry, train = _invoke("plan", *args), _invoke("train", *args[:1], "--dry-run", *args[1:]), _invoke("train", *args)
    assert (plan.exit_code, dry.exit_code, train.exit_code) == (1, 1, 1), (plan.output, dry.output, train.output)
    assert "DOES NOT FIT" in plan.output and "DOES NOT FIT" in dry.output
    assert _error(dry.output) == _error(train.output) and "does not fit A100 80GB (hardware.gpu)" in _error(train.output)
    assert not (tmp_path / "run").exists()


def test_an_assumed_card_does_not_gate(tmp_path, hub_cache, user_plan_cache):
    from trainfit.plan.hardware import detect

    if detect():
        pytest.skip("a GPU is detected here: the plan is for it, not an assumed card")
    args = _ppo_ddp(tmp_path) + ["hardware.gpu=null"]
    hub_cache.catalog(load_config(args[0], args[1:]))
    plan, dry = _invoke("plan", *args), _invoke("train", *args[:1], "--dry-run", *args[1:])
    assert plan.exit_code == 0 and dry.exit_code == 0, (plan.output, dry.output)
    assert "DOES NOT FIT" in plan.output and "assumed" in dry.output


def test_plan_plans_a_catalog_model_whose_weights_are_not_here(tmp_path, hub_cache, user_plan_cache):
    # plan plans the architecture; train (and its dry run) need the weights, and say where they looked.
    args = [EXAMPLES / "ppo_7b_full.yaml", f"run_dir={tmp_path / 'run'}"]
    plan = _invoke("plan", *args)
    assert plan.exit_code in (0, 1) and "not on this machine" in " ".join(plan.output.split()), plan.output
    dry = _invoke("train", args[0], "--dry-run", *args[1:])
    assert dry.exit_code == 2 and "Qwen/Qwen2.5-7B-Instruct" in _error(dry.output)
    assert str(hub_cache.root) in _error(dry.output)


def test_advice_to_leave_deepspeed_is_advice_train_accepts(tmp_path, hub_cache, monkeypatch):
    # Without DeepSpeed, a PPO config is told to use what train runs for PPO (FSDP since PPO runs under it).
    from trainfit.models.runnable import refusal

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    cfg = load_config(EXAMPLES / "ppo_7b_full.yaml", [f"run_dir={tmp_path / 'run'}"])
    hub_cache.catalog(cfg)
    r = _invoke("train", EXAMPLES / "ppo_7b_full.yaml", "--dry-run", f"run_dir={tmp_path / 'run'}")
    msg = _error(r.output)
    assert r.exit_code == 2 and "trainfit[deepspeed]" in msg, msg
    advice = msg.split("or use ")[-1].rstrip(".")
    assert advice.startswith("distributed.strategy=") and refusal(cfg, [advice]) is None


def test_a_pipeline_with_data_in_a_stage_trains_each_stage(tmp_path):
    # SFT reads data.path given inside stages[0]; GRPO's task is inside stages[1]; the base has neither.
    rows = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(5) for b in range(5)]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {"run_dir": str(tmp_path / "run"), "model": {"name": "preset:tiny"},
           "train": {"device": "cpu", "max_steps": 1, "global_batch_size": 8, "micro_batch_size": 8},
           "rollout": {"max_new_tokens": 4}, "logging": {"report_to": "none", "progress": False, "plot": False},
           "stages": [{"stage": "sft", "data": {"path": str(tmp_path / "sft.jsonl"), "max_seq_length": 32}},
                      {"stage": "grpo", "task": {"name": "arithmetic", "max_operand": 9, "num_eval": 8},
                       "grpo": {"num_generations": 4}}]}
    path = tmp_path / "pipe.yaml"
    path.write_text(yaml.safe_dump(cfg))
    r = _invoke("train", path)
    assert r.exit_code == 0, r.output
    for stage in ("0-sft", "1-grpo"):
        rows = [json.loads(x) for x in (tmp_path / "run" / stage / "metrics.jsonl").read_text().splitlines()]
        assert any(x["kind"] == "train" and x["step"] == 1 for x in rows), (stage, rows)
    # A task given to the whole pipeline reaches the SFT stage too, where it would be trained on instead
    # of the stage's file: refused, naming the stage; the stage's task.name: null is the fix it names.
    task_on_base = {**cfg, "run_dir": str(tmp_path / "run2"), "task": cfg["stages"][1]["task"],
                    "stages": [cfg["stages"][0], {"stage": "grpo", "grpo": {"num_generations": 4}}]}
    path.write_text(yaml.safe_dump(task_on_base))
    both = _invoke("train", path, "--dry-run")
    assert both.exit_code == 2 and "stages[0] (sft)" in _error(both.output) and "ignore data.path" in _error(both.output)
    assert _invoke("train", path, "--dry-run", "stages.0.task.name=null").exit_code == 0
    # A stage that lacks what it needs is still refused, naming the stage.
    cfg["stages"][0]["data"] = {"path": None}
    path.write_text(yaml.safe_dump(cfg))
    bad = _invoke("train", path, "--dry-run")
    assert bad.exit_code == 2 and "stages[0] (sft)" in bad.output and "needs data" in bad.output


def test_large_data_is_checked_at_its_start_and_train_reads_the_rest(tmp_path):
    from trainfit.train.datacheck import check_records
    from trainfit.data.text import load_records

    rows = "".join(json.dumps({"prompt": "p" * 50, "completion": "c"}) + "\n" for _ in range(200))
    (tmp_path / "big.jsonl").write_text(rows + '{"prompt": "late", "completion": \n')
    cfg = load_config(None, [f"data.path={tmp_path / 'big.jsonl'}"])
    notes = check_records(cfg, cfg.data.path, "data.path", budget=4096)
    assert notes and "checked the first" in notes[0] and "big.jsonl from line" in notes[0]
    with pytest.raises(ConfigError, match="line 201"):  # the loader checks every line, same message
        load_records(cfg.data.path)
    with pytest.raises(ConfigError, match="line 201"):  # and the check does, within its budget
        check_records(cfg, cfg.data.path, "data.path")


def test_a_suggestion_needing_a_missing_package_says_so(tmp_path, hub_cache, user_plan_cache, monkeypatch):
    # Under DDP the 7B PPO does not fit; ZeRO-3 would, and needs DeepSpeed, which is "not installed" here.
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    args = _ppo_ddp(tmp_path)
    hub_cache.catalog(load_config(args[0], args[1:]))
    r = _invoke("plan", *args, "--json")
    assert r.exit_code == 1, r.output
    ds = [s for s in json.loads(r.output)["suggestions"] if "distributed.strategy=deepspeed" in s["overrides"]]
    assert ds and all("needs pip install 'trainfit[deepspeed]'" in s["change"] for s in ds), ds
    others = [s for s in json.loads(r.output)["suggestions"] if s not in ds]
    assert others and not any("needs pip install" in s["change"] for s in others)


def _expert_rows(folder: Path) -> Path:
    """examples/cua_tiny.yaml's SFT rows (`trainfit env expert` writes them): one screen, one click."""
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (160, 210), (255, 255, 255)).save(folder / "screen.png")
    row = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Task: Click the button."},
                                                     {"type": "image", "image": "screen.png"}]},
                        {"role": "assistant", "content": "click(40, 100)"}]}
    (folder / "rows.jsonl").write_text((json.dumps(row) + "\n") * 4)
    return folder / "rows.jsonl"


def test_every_example_passes_the_plan_door_without_the_training_machines_packages(tmp_path, hub_cache,
                                                                                   monkeypatch):
    # Issue 36: `plan` answers for the machine that trains. Without vLLM, bitsandbytes, DeepSpeed, liger
    # or flash-attn here, every example passes plan's check (steps 1-5 of preflight; test_plan_memory.py
    # plans every example) and names what it needs there; dry-run refuses the same configs, exit 2.
    from trainfit.train.preflight import preflight

    monkeypatch.chdir(ROOT)  # the examples name their data files relative to the repository
    _without(monkeypatch, *TRAINING_MACHINE)
    rows = _expert_rows(tmp_path / "expert")
    listed = 0
    for path in sorted(EXAMPLES.glob("*.yaml")):
        over = [f"stages.0.data.path={rows}"] if path.name == "cua_tiny.yaml" else []
        cfg = load_config(path, over + [f"run_dir={tmp_path / 'run'}"])
        hub_cache.catalog(cfg)
        ready = preflight(cfg, "plan", plan=False)
        needs = [n for s in ready.stages for n in extras.training_machine(s) if n.module in TRAINING_MACHINE]
        for n in needs:
            assert any(f"{n.module} ({n.why}; not installed here: {n.install})" in (line or "")
                       for line in ready.training_machine), (path.name, ready.training_machine)
        if needs:
            listed += 1
            with pytest.raises(ConfigError) as e:  # train's words: the first missing package's message
                preflight(cfg, "dry-run", plan=False)
            first = next(g for s in ready.stages if (g := extras.missing(s)))[0]
            assert str(e.value).startswith(extras.message(first)[:60]), path.name
    # The flagship GRPO (vLLM), the 4-bit GRPO (bitsandbytes), the CUA one (vLLM, flash-attn) and the
    # DeepSpeed ones among them.
    assert listed >= 7


@pytest.mark.parametrize("example, package", [("qwen3_8b_grpo_lora_h200.yaml", "vllm"),
                                              ("qwen3_4b_grpo_4bit.yaml", "bitsandbytes"),
                                              ("sft_7b_zero2_offload.yaml", "deepspeed")])
def test_plan_lists_what_the_training_machine_needs_and_train_refuses_it(example, package, tmp_path, hub_cache,
                                                                        user_plan_cache, monkeypatch):
    monkeypatch.chdir(ROOT)
    _without(monkeypatch, *TRAINING_MACHINE)
    args = [f"examples/{example}", f"run_dir={tmp_path / 'run'}"]
    hub_cache.catalog(load_config(*args[:1], args[1:]))
    plan = _invoke("plan", *args)
    text = " ".join(plan.output.split())
    assert plan.exit_code == 0 and "FITS" in text, plan.output  # the card the example names (hardware.gpu)
    assert f"needed on the training machine: {package} (" in text and "not installed here: pip install" in text
    # The exit code says only whether it fits: a card too small is 1, not a missing package's 2.
    if example == "qwen3_8b_grpo_lora_h200.yaml":
        small = _invoke("plan", *args, "--gpu", "a100-40gb")
        assert small.exit_code == 1 and "needed on the training machine: vllm" in " ".join(small.output.split())
    dry, train = _invoke("train", *args, "--dry-run"), _invoke("train", *args)
    assert dry.exit_code == train.exit_code == 2, (dry.output, train.output)
    first = extras.missing(load_config(*args[:1], args[1:]))[0]
    assert first.module == package
    assert _error(dry.output) == _error(train.output)
    assert _error(dry.output).startswith("error: " + " ".join(extras.message(first).split())[:60]), dry.output
    assert not (tmp_path / "run").exists()
