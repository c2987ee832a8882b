"""A run on a GGUF base leaves a final directory that plain transformers / peft load: the LoRA
adapter points at the dequantized base saved beside it, and a full fine-tune saves a plain model.

The GGUF is written here (tests/gguf_helpers.py), tiny and in fp32, from a random Qwen3 on the
preset tokenizer (no download).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rich.console import Console

from conftest import tiny_config

gguf = pytest.importorskip("gguf", reason="the dev extra installs gguf")
if not hasattr(gguf.MODEL_ARCH, "QWEN3"):
    pytest.skip("this gguf package cannot write qwen3 files; upgrade it", allow_module_level=True)

from gguf_helpers import write_tiny_gguf  # noqa: E402  (after the skip: it imports gguf)

QUIET = Console(file=open("/dev/null", "w"))


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.F32.gguf"
    return path, write_tiny_gguf(path)


def _train(tmp_path, gguf_path: Path, peft: str) -> Path:
    from trainfit.train.run import run_pipeline

    cfg = tiny_config(tmp_path, "sft", **{"model.name": str(gguf_path), "model.dtype": "fp32",
                                          "peft.method": peft, "train.max_steps": 1})
    return run_pipeline(cfg, console=QUIET)[0].final_dir


def test_lora_on_gguf_saves_a_final_dir_peft_loads_from_any_cwd(tmp_path, tiny_gguf, monkeypatch):
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoModelForCausalLM

    gguf_path, written = tiny_gguf
    final = _train(tmp_path, gguf_path, "lora")
    base_ref = json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"]
    base_dir = Path(base_ref)
    # The base is a plain transformers dir beside the adapter, not the GGUF's folder.
    assert base_dir.is_absolute() and base_dir != gguf_path.parent
    assert base_dir == (tmp_path / "run" / "base").resolve()
    assert "quantization_config" not in json.loads((base_dir / "config.json").read_text())

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    for k, v in written.items():  # the dequantized base is exactly what the GGUF holds (F32)
        torch.testing.assert_close(base.state_dict()[k], v, rtol=0, atol=0)
    model = AutoPeftModelForCausalLM.from_pretrained(str(final), dtype=torch.float32)
    ids = torch.tensor([[5, 6, 7, 8]])
    logits = model(input_ids=ids).logits
    assert torch.isfinite(logits).all()
    # The adapter is loaded and trained (B != 0 after one step at lr 1e-3), so outputs differ from the base.
    assert not torch.allclose(logits, base(input_ids=ids).logits)


def test_full_finetune_on_gguf_saves_a_plain_model(tmp_path, tiny_gguf):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path, written = tiny_gguf
    final = _train(tmp_path, gguf_path, "none")
    assert "quantization_config" not in json.loads((final / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(final)
    assert tok.eos_token == "<|im_end|>"
    changed = [k for k, v in written.items() if not torch.equal(model.state_dict()[k], v)]
    assert changed  # one optimizer step moved the weights, and they were saved


def test_the_tokenizer_ends_sequences_with_the_files_eos_whatever_transformers_builds(tiny_gguf, monkeypatch):
    # Some transformers releases (5.17) build a GGUF's Qwen2 tokenizer with the class's default eos,
    # <|endoftext|>, not the file's tokenizer.ggml.eos_token_id (<|im_end|> here): the loaded tokenizer
    # says the file's, so training, generation and the saved tokenizer end sequences where the model does.
    from transformers import AutoTokenizer

    from trainfit.config import ModelConfig
    from trainfit.models import policy

    built = AutoTokenizer.from_pretrained

    def with_the_class_default_eos(*args, **kwargs):
        tok = built(*args, **kwargs)
        tok.eos_token = "<|endoftext|>"
        return tok

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", with_the_class_default_eos)
    tok = policy.load_tokenizer(ModelConfig(name=str(tiny_gguf[0])))
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
