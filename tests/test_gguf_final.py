"""A run on a GGUF base leaves a final directory that plain transformers / peft load: the LoRA
adapter points at the dequantized base saved beside it, and a full fine-tune saves a plain model.

The GGUF is written here, tiny and in fp32, from a random Qwen3 on the preset tokenizer (no
download). head_dim is 128 because transformers' GGUF reader does not map Qwen3's key length and
falls back to Qwen3Config's default of 128.
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

QUIET = Console(file=open("/dev/null", "w"))


def write_tiny_gguf(path: Path) -> dict[str, torch.Tensor]:
    """A GGUF (arch qwen3, F32 tensors, the preset BPE tokenizer and chat template) of a random tiny
    Qwen3; returns its state dict as written (the tied lm_head is the embedding)."""
    from transformers import AutoModelForCausalLM

    from trainfit.presets import build_tokenizer, preset_config

    tok = build_tokenizer()
    cfg = preset_config("tiny", len(tok))
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 2, 1, 128
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    arch = gguf.MODEL_ARCH.QWEN3
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    w.add_name("tiny")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    spec = json.loads(tok.backend_tokenizer.to_str())["model"]
    tokens = [t for t, _ in sorted(spec["vocab"].items(), key=lambda kv: kv[1])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in spec["merges"]])
    special = set(tok.all_special_tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_chat_template(tok.chat_template)
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for k, v in sd.items():
        if k != "lm_head.weight":  # tied: the GGUF stores the embedding once
            w.add_tensor(names.get_name(k, try_suffixes=(".weight", ".bias")), v.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sd


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
