"""`trainfit plan` on a GGUF base reads the architecture (and the tokenizer, for the data's lengths)
from the file, as transformers and `train` read it: the same components as the equivalent Hugging
Face config; a quantized file is planned as what train loads (dequantized to model.dtype)."""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch
from rich.console import Console

from conftest import tiny_config

gguf = pytest.importorskip("gguf", reason="the dev extra installs gguf")
if not hasattr(gguf.MODEL_ARCH, "QWEN3"):
    pytest.skip("this gguf package cannot write qwen3 files; upgrade it", allow_module_level=True)

from gguf_helpers import tiny_qwen3_config, write_tiny_gguf  # noqa: E402  (after the skip: it imports gguf)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The same random tiny Qwen3 as an F32 GGUF, a Q8_0 GGUF and a Hugging Face directory."""
    root = tmp_path_factory.mktemp("gguf_plan")
    f32, q8 = root / "tiny.F32.gguf", root / "tiny.Q8_0.gguf"
    write_tiny_gguf(f32)
    write_tiny_gguf(q8, gguf.GGMLQuantizationType.Q8_0)
    cfg, tok = tiny_qwen3_config()
    hf = root / "hf"
    cfg.save_pretrained(hf)
    tok.save_pretrained(hf)
    return {"f32": f32, "q8": q8, "hf": hf}


def _render(p) -> list[str]:
    """The plan as `trainfit plan` prints it, under one model name, without the notes."""
    from trainfit.plan.report import render

    out = io.StringIO()
    render(dataclasses.replace(p, model="MODEL"), Console(file=out, width=250))
    return out.getvalue().split("\nnote:")[0].splitlines()  # the notes come last


@pytest.mark.parametrize("stage,over", [("sft", {}), ("grpo", {"peft.method": "lora"})])
def test_plan_of_a_gguf_file_is_the_plan_of_its_hf_config(tmp_path, files, stage, over):
    from trainfit.plan import plan

    plans = {k: plan(tiny_config(tmp_path, stage, **{"model.name": str(files[k]), "model.dtype": "fp32", **over}),
                     gpu="h100", suggest=False) for k in ("f32", "hf")}
    g, h = plans["f32"], plans["hf"]
    items = [[(i.name, i.rollout, i.train, i.cpu) for i in p.items] for p in (g, h)]
    assert items[0] == items[1]
    assert _render(g) == _render(h)
    # The data's lengths come from the file's tokenizer, which tokenizes as the HF one does.
    assert g.lengths["source"] == "data" and g.lengths == h.lengths
    assert any(n.startswith("GGUF base tiny.F32.gguf: F32 100%") for n in g.notes)


def test_quantized_gguf_is_planned_as_train_loads_it(tmp_path, files):
    """A Q8_0 file: the plan is the F32 file's (train dequantizes on load), the note names Q8_0, and
    the weights train really loads are the plan's policy weights, byte for byte."""
    from trainfit.config import ModelConfig
    from trainfit.models.policy import load_base_model
    from trainfit.plan import plan

    p8, p32 = (plan(tiny_config(tmp_path, "sft", **{"model.name": str(files[k]), "model.dtype": "fp32"}),
                    gpu="h100", suggest=False) for k in ("q8", "f32"))
    assert [(i.name, i.train) for i in p8.items] == [(i.name, i.train) for i in p32.items]
    note = next(n for n in p8.notes if n.startswith("GGUF base tiny.Q8_0.gguf"))
    assert "Q8_0" in note and "dequantizes every tensor to fp32" in note
    model, _ = load_base_model(ModelConfig(name=str(files["q8"]), dtype="fp32"), torch.device("cpu"))
    loaded = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert next(i.train for i in p8.items if i.name.startswith("policy weights")) == loaded


def test_cli_plans_a_gguf_file(tmp_path, files):
    from typer.testing import CliRunner

    from trainfit.app.cli import app

    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"stage: sft\nmodel: {{name: {files['q8']}, dtype: bf16}}\n"
                   "task: {name: arithmetic, max_operand: 9, num_eval: 16}\ntrain: {global_batch_size: 8, micro_batch_size: 8}\n")
    r = CliRunner().invoke(app, ["plan", str(cfg), "--gpu", "h100"])
    assert r.exit_code == 0, r.output
    assert "policy weights (bf16)" in r.output and "Q8_0" in r.output and "original model id" not in r.output


def test_a_hub_gguf_not_in_the_cache_is_refused_without_a_download(monkeypatch):
    from trainfit.config import ConfigError
    from trainfit.models.shapes import locate

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="not in the local Hugging Face cache"):
        locate("nobody-here/no-such-model-GGUF", gguf_file="model.Q4_K_M.gguf")
