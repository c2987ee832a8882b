"""A tiny GGUF file written locally (no download): a random Qwen3 on the preset BPE tokenizer.

head_dim is 128 because transformers' GGUF reader does not map Qwen3's key length and falls back
to Qwen3Config's default of 128. Tests that use it import gguf first (pytest.importorskip).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import gguf
import torch


def tiny_qwen3_config():
    """The architecture written: preset:tiny's Qwen3 with 2 heads, 1 KV head of 128 dims."""
    from trainfit.models.presets import preset_config
    from trainfit.models.tokenizer import build_tokenizer

    tok = build_tokenizer()
    cfg = preset_config("tiny", len(tok))
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 2, 1, 128
    return cfg, tok


def write_tiny_gguf(path: Path, qtype: Optional["gguf.GGMLQuantizationType"] = None) -> dict[str, torch.Tensor]:
    """A GGUF (arch qwen3, the preset BPE tokenizer and chat template) of a random tiny Qwen3; returns
    its state dict as written (the tied lm_head is the embedding). Tensors are F32, or with `qtype`
    (e.g. Q8_0) every matrix is stored quantized and the 1-D norms stay F32, as llama.cpp writes them."""
    from transformers import AutoModelForCausalLM

    cfg, tok = tiny_qwen3_config()
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
        if k == "lm_head.weight":  # tied: the GGUF stores the embedding once
            continue
        name = names.get_name(k, try_suffixes=(".weight", ".bias"))
        if qtype is not None and v.dim() == 2:
            w.add_tensor(name, gguf.quants.quantize(v.numpy(), qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, v.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sd
