"""Built-in random-init presets: Qwen3-style and Mamba architectures plus a tokenizer trained locally.

Nothing is downloaded: the tokenizer is a byte-level BPE trained with the `tokenizers` library on a
small built-in corpus (digits split one per token, as Qwen does, so arithmetic is learnable), and the
model is built from a config with random weights. Both are deterministic for a given seed.
"""

from __future__ import annotations

import functools
import random

from transformers import MambaConfig, PretrainedConfig, Qwen3Config

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
TOKENIZER_VOCAB = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen-style chat template; `{% generation %}` marks assistant text for loss masks. With `tools`, a
# system block lists their JSON schemas and asks for `<tool_call>{json}</tool_call>` (Qwen/Hermes);
# `tool` messages render as `<tool_response>` blocks inside one user turn per run of consecutive
# results. Without tools or tool messages the output is what the template gave before tools existed.
_TOOLS_SYSTEM = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{{ '\\n\\n' }}{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}"
    "{{ '\\n' }}</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n{% endif %}'
)
_TOOL_CALLS = (  # OpenAI-style `tool_calls` on an assistant message, written as the model writes them
    "{% for tc in m['tool_calls'] %}{% set f = tc['function'] if tc['function'] is defined else tc %}"
    "{% if m['content'] or not loop.first %}{{ '\\n' }}{% endif %}"
    '<tool_call>\n{"name": "{{ f[\'name\'] }}", "arguments": '
    "{% if f['arguments'] is string %}{{ f['arguments'] }}{% else %}{{ f['arguments'] | tojson }}{% endif %}"
    "}\n</tool_call>{% endfor %}"
)
CHAT_TEMPLATE = (
    _TOOLS_SYSTEM
    + "{% for m in messages %}"
    "{% if tools and loop.first and m['role'] == 'system' %}"  # already inside the tools block
    "{% elif m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>{{ '\\n' }}{% endif %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}"
    "{% if m['tool_calls'] %}{{ m['content'] or '' }}" + _TOOL_CALLS + "{% else %}{{ m['content'] }}{% endif %}"
    "<|im_end|>{% endgeneration %}{{ '\\n' }}"
    "{% else %}{{ m['content'] }}<|im_end|>{{ '\\n' }}{% endif %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def preset_names() -> list[str]:
    from trainfit.vision.preset import VLM_PRESETS  # image-text-to-text presets (preset:vlm-tiny)

    return sorted([*PRESETS, *VLM_PRESETS])


def parse_preset(name: str) -> str | None:
    """'preset:tiny' -> 'tiny'; anything else -> None."""
    if not name.startswith("preset:"):
        return None
    key = name.split(":", 1)[1]
    if key not in preset_names():
        from trainfit.config import ConfigError
        raise ConfigError(f"model.name={name!r} names no built-in preset; use one of "
                          f"{', '.join('preset:' + p for p in preset_names())}.")
    return key


def _corpus(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    words = ("the a of to and in is it you that he was for on are as with his they at be this from "
             "have or by one had not but what all were when we there can an your which their said if "
             "do will each about how up out them then she many some so these would other into has more "
             "her two like him see time could no make than first been its who now people my made over "
             "did down only way find use may water long little very after words called just where most "
             "know answer question compute solve number sum total result think step user assistant "
             "system tool call function name arguments reply think").split()
    lines = []
    for _ in range(3000):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice("+-*")
        lines.append(f"{a}{op}{b}={a + b} What is {a} {op} {b}? <answer>{b}</answer>")
        lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(4, 14))).capitalize() + ".")
        lines.append('{"name": "' + rng.choice(words) + '", "arguments": {"x": ' + str(a) + "}}")
    return lines


@functools.lru_cache(maxsize=4)
def _tokenizer_json(vocab_size: int) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # Digits split individually before byte-level BPE, so "123" is always 3 tokens.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    return tok.to_str()


def build_tokenizer(vocab_size: int = TOKENIZER_VOCAB):
    """A fresh PreTrainedTokenizerFast trained locally (cached per process as JSON)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(_tokenizer_json(vocab_size)),
                                  eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def preset_config(name: str, vocab_size: int | None = None) -> PretrainedConfig:
    """The transformers config of a preset (`tiny`, `small`, `mamba-tiny`, `vlm-tiny`); usable on the
    meta device by the planner."""
    key = parse_preset(name) if name.startswith("preset:") else name
    from trainfit.vision.preset import VISION_TOKENS, is_vlm_preset, vlm_config

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
