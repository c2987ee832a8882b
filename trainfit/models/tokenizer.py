"""The built-in tokenizer of the presets: a byte-level BPE trained with the `tokenizers` library on a small
built-in corpus (digits split one per token, as Qwen does, so arithmetic is learnable), with a
Qwen-style chat template. Deterministic; nothing is downloaded."""

from __future__ import annotations

import functools
import random

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
