"""preset:vlm-tiny through transformers' auto classes: save/load round trip; freezing and LoRA on the
language model only leave the vision tower unchanged after training steps; 2 DDP ranks equal 1."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from rich.console import Console

from test_distributed import train_here
from test_vlm_helpers import write_dataset, vlm_config
from trainfit.config import ModelConfig, PeftConfig, to_yaml
from trainfit.models.lora_rules import module_part
from trainfit.models.policy import LoadedModel, load_policy, unwrap
from trainfit.models.save import save_pretrained


def params_by_part(model) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {"language": {}, "tower": {}, "projector": {}}
    for n, p in unwrap(model, peft=True).named_parameters():
        if "lora_" not in n:
            out[module_part(n)][n.replace(".base_layer", "")] = p.detach().clone()
    return out


def changed(a: dict, b: dict) -> bool:
    return any(not torch.equal(a[k], b[k]) for k in a)


def test_preset_is_a_qwen3_vl_and_round_trips_through_auto_classes(tmp_path):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    cpu = torch.device("cpu")
    loaded = load_policy(ModelConfig(name="preset:vlm-tiny"), PeftConfig(), cpu)
    m = loaded.model
    assert m.config.model_type == "qwen3_vl" and loaded.processor is not None
    parts = params_by_part(m)
    assert parts["tower"] and parts["projector"] and parts["language"]
    save_pretrained(loaded, tmp_path / "out")
    m2 = AutoModelForImageTextToText.from_pretrained(tmp_path / "out")
    ip = AutoImageProcessor.from_pretrained(tmp_path / "out")
    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert ip.size == loaded.processor.image_processor.size and len(tok) == len(loaded.tokenizer)
    # The same forward with an image: ids with the image's tokens, pixels from the reloaded processor.
    from PIL import Image

    from trainfit.models.images import VisionProcessor
    proc = VisionProcessor(ip, tok)
    n = proc.tokens_for(64, 96)
    ids = tok(proc.placeholder.replace(proc.image_token, proc.image_token * n) + "hello",
              return_tensors="pt")["input_ids"]
    px = proc.pixels([Image.new("RGB", (96, 64), (200, 10, 10))])
    kw = dict(input_ids=ids, mm_token_type_ids=(ids == proc.image_token_id).long(), **px)
    with torch.no_grad():
        assert torch.allclose(m(**kw).logits, m2(**kw).logits, atol=1e-6)
    # ...and trainfit loads the saved directory as any VLM directory (same auto classes).
    again = load_policy(ModelConfig(name=str(tmp_path / "out")), PeftConfig(), cpu)
    assert type(again.model) is type(m) and again.processor.tokens_for(64, 96) == n


def train_in_process(cfg, tmp_path) -> LoadedModel:
    from trainfit.train.faults import Faults
    from trainfit.train.loop import train_stage
    from trainfit.train.run import build_stage

    loaded, stage, _ = build_stage(cfg, tmp_path / "stage")
    loaded.init = params_by_part(loaded.model)
    train_stage(cfg, loaded, stage, tmp_path / "stage", resume=False, console=Console(quiet=True), faults=Faults(),
                save_final=lambda path, state_dict=None: path)
    return loaded


@pytest.mark.parametrize("overrides,trained", [
    ({"peft.method": "lora", "peft.r": 4}, {"language"}),
    ({}, {"language"}),
    ({"model.freeze_vision_tower": "false", "model.freeze_projector": "false"}, {"language", "tower", "projector"}),
])
def test_frozen_parts_stay_unchanged_after_steps(tmp_path, overrides, trained):
    cfg = vlm_config(tmp_path, write_dataset(tmp_path / "data"), **overrides)
    loaded = train_in_process(cfg, tmp_path)
    after = params_by_part(loaded.model)
    if loaded.is_peft:  # adapters sit on the language model's linear layers only
        adapted = {n for n, _ in loaded.model.named_parameters() if "lora_" in n}
        assert adapted and {module_part(n) for n in adapted} == {"language"}
        lora = {n: p for n, p in loaded.model.named_parameters() if "lora_B" in n}
        assert any(p.abs().sum() > 0 for p in lora.values())   # lora_B starts at 0: it trained
    for part in ("language", "tower", "projector"):
        moved = changed(loaded.init[part], after[part])
        if loaded.is_peft:
            assert not moved, part   # the base is frozen under adapters
        else:
            assert moved == (part in trained), part


@pytest.mark.multiprocess
def test_ddp_two_ranks_equal_one_rank(tmp_path):
    from safetensors.torch import load_file

    data = write_dataset(tmp_path / "data")
    cfg = vlm_config(tmp_path, data, **{"model.freeze_projector": "false"})
    config = tmp_path / "c.yaml"
    config.write_text(to_yaml(cfg))

    def train(*args):
        r = subprocess.run([sys.executable, "-m", "trainfit.app.cli", "train", str(config), *args],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return r

    train_here(config, f"run_dir={tmp_path / 'one'}")
    two = train(f"run_dir={tmp_path / 'two'}", "distributed.num_gpus=2", "distributed.strategy=ddp")
    assert "2 ranks" in two.stdout
    a, b = (load_file(str(tmp_path / d / "final" / "model.safetensors")) for d in ("one", "two"))
    init = load_policy(ModelConfig(name="preset:vlm-tiny"), PeftConfig(), torch.device("cpu")).model.state_dict()
    flat = {k: torch.cat([sd[n].flatten() for n in sorted(a)]) for k, sd in (("a", a), ("b", b), ("init", init))}
    assert (flat["a"] - flat["b"]).norm() / flat["a"].norm() < 1e-5
    assert (flat["a"] - flat["init"]).norm() > 1e-3   # three steps moved the weights: not vacuous
    merger = [n for n in sorted(a) if module_part(n) == "projector"]
    assert any(not torch.equal(a[n], init[n]) for n in merger)   # the projector trained, identically on 2 ranks


def test_caption_pretraining_trains_and_evaluates(tmp_path):
    import json

    data = tmp_path / "data"
    write_dataset(data, n=6)
    captions = data / "captions.jsonl"
    captions.write_text("".join(json.dumps({"image": f"img/{i}.png", "text": "a coloured square"}) + "\n"
                                for i in range(6)))
    cfg = vlm_config(tmp_path, captions, **{"stage": "pretrain", "data.eval_fraction": 0.3})
    loaded = train_in_process(cfg, tmp_path)
    assert changed(loaded.init["language"], params_by_part(loaded.model)["language"])
    from trainfit.train.run import build_stage

    _, stage, _ = build_stage(cfg, tmp_path / "again")
    assert len(stage.eval_items) == 2 and all(it["images"] for it in stage.train_items)
    ev = stage.evaluate(loaded.model)
    assert 0 < ev["eval_loss"] < 20
