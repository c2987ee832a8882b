"""Built-in random-init presets: Qwen3-style and Mamba architectures, with the tokenizer of tokenizer.py.

Nothing is downloaded: the tokenizer is a byte-level BPE trained with the `tokenizers` library on a
small built-in corpus (digits split one per token, as Qwen does, so arithmetic is learnable), and the
model is built from a config with random weights. Both are deterministic for a given seed.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING

from trainfit.config import ConfigError
from trainfit.core import cache
from trainfit.models import vlm_preset
from trainfit.models.tokenizer import TOKENIZER_VOCAB
from trainfit.models.vlm_preset import VISION_TOKENS, VLM_PRESETS, is_vlm_preset, vlm_config

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Architecture numbers of each preset; vocab size comes from the tokenizer. A `model_type` other than
# Qwen3 names the transformers config class. `mamba-tiny` is Mamba (v1, the Falcon-Mamba family): on
# CPU transformers runs its selective scan as a plain torch loop over time steps (autograd through
# it, no CUDA kernel), and its recurrent state is (conv [d_inner, conv_kernel], ssm [d_inner,
# state_size]) per layer, d_inner = expand x hidden.
PRESETS: dict[str, dict] = {
    "tiny": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=512),
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=32, max_position_embeddings=2048),
    "mamba-tiny": dict(model_type="mamba", hidden_size=64, num_hidden_layers=2, state_size=8, expand=2,
                       conv_kernel=4, time_step_rank=8),
}
def preset_names() -> list[str]:
    return sorted([*PRESETS, *VLM_PRESETS])


def parse_preset(name: str) -> str | None:
    """'preset:tiny' -> 'tiny'; anything else -> None."""
    if not name.startswith("preset:"):
        return None
    key = name.split(":", 1)[1]
    if key not in preset_names():
        raise ConfigError(f"model.name={name!r} names no built-in preset; use one of "
                          f"{', '.join('preset:' + p for p in preset_names())}.")
    return key


def preset_config(name: str, vocab_size: int | None = None) -> PretrainedConfig:
    """The transformers config of a preset (`tiny`, `small`, `mamba-tiny`, `vlm-tiny`); usable on the
    meta device by the planner."""
    from transformers import MambaConfig, Qwen3Config  # heavy: only when a preset's config is built

    key = parse_preset(name) if name.startswith("preset:") else name

    if is_vlm_preset(key):  # a Qwen3-VL; its tokenizer has the 4 vision tokens on top of the 512
        return vlm_config(key, vocab_size or TOKENIZER_VOCAB + len(VISION_TOKENS))
    arch = dict(PRESETS[key])
    vocab = vocab_size or TOKENIZER_VOCAB
    # Special token ids are the first ids the BPE trainer assigns, in SPECIAL_TOKENS order.
    if arch.pop("model_type", "qwen3") == "mamba":
        return MambaConfig(vocab_size=vocab, tie_word_embeddings=True, layer_norm_epsilon=1e-5, eos_token_id=2,
                           pad_token_id=0, bos_token_id=None, residual_in_fp32=True, **arch)
    return Qwen3Config(vocab_size=vocab, tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=10000.0,
                       eos_token_id=2, pad_token_id=0, bos_token_id=None, attention_dropout=0.0, **arch)


def preset_dict(name: str) -> dict:
    """`preset_config(name).to_dict()` as config.json holds it (JSON: keys are strings), cached on disk
    (core/cache.py) by the source of the modules that build it and transformers' version: a repeated
    plan of a preset reads it without importing transformers."""
    parse_preset(name)  # an unknown preset is a ConfigError before anything is read
    key = cache.stable_hash({"preset": name, "built_by": _builders()})
    found = cache.read("presets", key)
    if found is None:
        found = json.loads(json.dumps(preset_config(name).to_dict()))
        cache.write("presets", key, found)
    return found


@functools.lru_cache(maxsize=1)
def _builders() -> list:
    """What a preset's config.json depends on besides its name: this code and transformers' version."""
    return [cache.stable_hash(Path(m).read_text()) for m in (__file__, vlm_preset.__file__)] + [
        cache.package_version("transformers")]
