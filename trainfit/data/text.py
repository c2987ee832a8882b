"""Training data: loading records, detecting their shape, tokenizing with loss masks, packing, batching.

Three record shapes are accepted (one per line of JSONL, or raw .txt files):
  text               {"text": "..."}                                  pretraining, packed into blocks
  prompt_completion  {"prompt": "...", "completion": "..."}           loss on the completion + eos
  messages           {"messages": [{"role": ..., "content": ...}]}    loss on every assistant turn
Labels use -100 for tokens without loss (the value torch's cross entropy ignores). Labels are aligned
with input_ids (not shifted); the model's loss shifts them.
"""

from __future__ import annotations

import random
import re
from typing import TYPE_CHECKING, Any

from trainfit.config import ConfigError
# Reading records lives in records.py; these names are imported from here by the rest of trainfit.
from trainfit.data.records import (SHAPES, SUFFIXES, Records, _read_file, check_sft_record,  # noqa: F401
                                   check_text_record, data_files, detect_format, json_error, load_records,
                                   no_records, origin_of, parse_line, sft_format)

if TYPE_CHECKING:  # torch is imported where tensors are made: the planner reads data without it
    import torch

IGNORE = -100
# The marker transformers needs for `return_assistant_tokens_mask`.
_GENERATION_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")


# A row is cut to its first tokens before it is tokenized whole: a text of more than this many characters a
# token of the budget is tokenized from its start, in prefixes doubling until they give CUT_MARGIN tokens past
# the budget (tokens near a cut may merge differently; those past the budget are dropped anyway). A 50 MB line
# costs a few prefixes of kilobytes instead of millions of tokens held as Python objects.
CUT_CHARS = 4
CUT_MARGIN = 16


def cut_text(tokenizer, text: str, tokens: int) -> str:
    """`text`, or its start when it holds more than `tokens` tokens: a prefix with at least `tokens` +
    CUT_MARGIN tokens, so the first `tokens` tokens are those of the whole text and the row still reads as
    cut. Short texts come back unchanged without being tokenized."""
    n = (max(tokens, 0) + CUT_MARGIN) * CUT_CHARS
    while n < len(text):
        if len(tokenizer(text[:n], add_special_tokens=False)["input_ids"]) > tokens + CUT_MARGIN:
            return text[:n]
        n *= 2
    return text


def _cut_messages(tokenizer, messages: list[dict], max_len: int) -> list[dict]:
    """The messages with each text cut to its first max_len tokens (`cut_text`): past one cut text the rendered
    conversation is longer than max_len, so the tokens kept are the same."""
    def cut(c):
        if isinstance(c, str):
            return cut_text(tokenizer, c, max_len)
        if isinstance(c, list):   # content parts: the text parts cut
            return [{**q, "text": cut_text(tokenizer, q["text"], max_len)} if isinstance(q, dict) and isinstance(
                q.get("text"), str) else q for q in c]
        return c
    return [{**m, "content": cut(m["content"])} if isinstance(m, dict) and "content" in m else m for m in messages]


def _ids(tokenizer, text: str, special: bool) -> list[int]:
    # special=True lets the tokenizer add what it adds to a sequence start (a BOS for Llama, none for Qwen).
    return list(tokenizer(text, add_special_tokens=special)["input_ids"])


def _eos(tokenizer) -> int:
    if tokenizer.eos_token_id is None:
        raise ConfigError("The tokenizer has no eos token, so sequence ends cannot be learned; use a "
                          "tokenizer with one or set its eos_token.")
    return tokenizer.eos_token_id


def _template(tokenizer) -> str:
    tmpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tmpl, dict):
        tmpl = tmpl.get("default")
    if not tmpl:
        raise ConfigError("The tokenizer has no chat template, so messages cannot be rendered; use a chat "
                          "model's tokenizer, or plain prompts (task.chat=false, prompt/completion data).")
    return tmpl


def _render(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as e:  # jinja errors from the template (e.g. roles must alternate)
        raise ConfigError(f"The chat template failed on messages with roles "
                          f"{[m.get('role') for m in messages]}: {e}. Fix the record's messages.") from None


def _finish(ids: list[int], labels: list[int], max_len: int) -> dict:
    # Right truncation keeps the prompt start; the caller drops items left without loss tokens.
    return {"input_ids": ids[:max_len], "labels": labels[:max_len], "truncated": len(ids) > max_len}


def encode_prompt_completion(tokenizer, prompt: str, completion: str, max_len: int, chat: bool,
                             template: str = "plain") -> dict:
    """input_ids and labels with loss on the completion and a final eos (chat: the end-of-turn token).
    `template` (data.template): plain, chat, or a format string whose text from {completion} on is trained."""
    if template not in ("plain", "chat"):
        head, tail = template.split("{completion}", 1)
        prompt, completion = head.replace("{prompt}", prompt), completion + tail.replace("{prompt}", prompt)
    if chat or template == "chat":
        return encode_messages(tokenizer, [{"role": "user", "content": prompt},
                                           {"role": "assistant", "content": completion}], max_len)
    # Tokenized apart and joined, so the prompt/completion boundary is exact even where BPE would merge; each cut
    # to what max_len can keep first (`cut_text`).
    p = _ids(tokenizer, cut_text(tokenizer, prompt, max_len), special=True)
    c = _ids(tokenizer, cut_text(tokenizer, completion, max_len - len(p)), special=False) + [_eos(tokenizer)]
    return _finish(p + c, [IGNORE] * len(p) + c, max_len)


def encode_messages(tokenizer, messages: list[dict], max_len: int) -> dict:
    """input_ids and labels with loss on every assistant turn, its end-of-turn token included; texts longer
    than max_len tokens are cut first (`_cut_messages`)."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ConfigError(f"messages[{i}] must be an object with `role` and `content`, got {m!r}.")
    messages = _cut_messages(tokenizer, messages, max_len)
    if _GENERATION_RE.search(_template(tokenizer)):
        enc = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        ids, mask = list(enc["input_ids"]), list(enc["assistant_masks"])
    else:
        ids, mask = _assistant_mask_by_prefixes(tokenizer, messages)
    labels = [t if k else IGNORE for t, k in zip(ids, mask)]
    return _finish(ids, labels, max_len)


def _assistant_mask_by_prefixes(tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
    """Assistant-token mask for templates without `{% generation %}` markers.

    Each assistant turn k spans, in the rendered text, from the end of render(messages[:k]) with the
    generation prompt to the end of render(messages[:k+1]) (trailing whitespace after the end-of-turn
    token excluded, as generation markers do). Spans are found in characters and mapped to tokens
    through offsets, so a BPE merge across a boundary cannot shift them. Templates that render a turn
    differently once later turns follow (Qwen3 drops empty think blocks from earlier turns) are not
    prefix-stable; for those the turn's content is searched in the full text, plus a special token
    directly after it (the end-of-turn token).
    """
    full = _render(tokenizer, messages, generation_prompt=False)
    specials = sorted((t.content for t in tokenizer.added_tokens_decoder.values()), key=len, reverse=True)
    spans, cursor = [], 0
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        pre = _render(tokenizer, messages[:k], generation_prompt=True) if k else None
        upto = _render(tokenizer, messages[:k + 1], generation_prompt=False).rstrip()
        if pre is not None and full.startswith(upto) and upto.startswith(pre) and len(pre) >= cursor:
            start, end = len(pre), len(upto)
        else:
            # Search after the generation prompt when it is a prefix, so user text repeating the
            # answer is not matched.
            lo = len(pre) if pre is not None and full.startswith(pre) else 0
            content = m.get("content") or ""
            start = full.find(content, max(lo, cursor)) if content else -1
            if start < 0:
                raise ConfigError(f"Cannot locate assistant turn {k} in the chat template's output; add "
                                  "{% generation %}...{% endgeneration %} around assistant content in the "
                                  "template so the loss mask is exact.")
            end = start + len(content)
            end += next((len(s) for s in specials if full.startswith(s, end)), 0)
        spans.append((start, end))
        cursor = end
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    # A token carries loss when it starts inside a span; offsets are (start, end) characters.
    mask = [int(e > s and any(a <= s < b for a, b in spans)) for s, e in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def _example_messages(ex) -> list[dict]:
    return list(ex.messages) + [{"role": "assistant", "content": ex.target}]


def encode_example(tokenizer, ex: Any, max_len: int, chat: bool) -> dict:
    """A task example (`prompt` or `messages`, and `target`) as input_ids/labels/truncated."""
    if ex.messages is not None:
        return encode_messages(tokenizer, _example_messages(ex), max_len)
    if ex.prompt is None:
        raise ConfigError("A task example has neither `prompt` nor `messages`; give one of them.")
    return encode_prompt_completion(tokenizer, ex.prompt, ex.target, max_len, chat)


def encode_prompt(tokenizer, ex: Any, chat: bool) -> list[int]:
    """Prompt ids for generation; the same tokens that precede the target in `encode_example`."""
    if ex.messages is not None:
        messages = list(ex.messages)
    elif chat:
        messages = [{"role": "user", "content": ex.prompt}]
    else:
        return _ids(tokenizer, ex.prompt, special=True)
    _template(tokenizer)
    return _ids(tokenizer, _render(tokenizer, messages, generation_prompt=True), special=False)


def pack_texts(tokenizer, texts: list[str], block: int) -> torch.Tensor:
    """Texts joined as [text0, eos, text1, eos, ...] and cut into full blocks; the tail is dropped.

    Returns a LongTensor [N, block]; the labels of a block are the block itself.
    """
    eos = _eos(tokenizer)
    stream: list[int] = []
    for ids in tokenizer(list(texts), add_special_tokens=True)["input_ids"] if texts else []:
        stream.extend(ids)
        stream.append(eos)
    import torch

    n = len(stream) // block
    return torch.tensor(stream[: n * block], dtype=torch.long).view(n, block)  # [N, block]


def build_pretrain_blocks(records: list[dict], tokenizer, block: int, text_field: str = "text",
                         key: str = "data.path") -> torch.Tensor:
    """Packed blocks [N, block] from text records; ConfigError when not even one block fills."""
    texts = [check_text_record(r, text_field, record_name(records, i, key)) for i, r in enumerate(records)]
    blocks = pack_texts(tokenizer, texts, block)
    if blocks.shape[0] == 0:
        raise ConfigError(f"The data has fewer tokens than one block of data.max_seq_length={block}; add "
                          "text or lower data.max_seq_length.")
    return blocks


def record_name(records, i: int, key: str = "data.path") -> str:
    """How errors name record i: its file and line when `records` were read from files (Records), else
    its position."""
    origin = origin_of(records, i)
    return f"{key} {origin}" if origin else f"{key}: record {i}"


def build_sft_items(records: list[dict], tokenizer, max_len: int, fmt: str = "auto",
                    text_field: str = "text", chat: bool = False, key: str = "data.path",
                    template: str = "plain") -> tuple[list[dict], dict]:
    """Tokenized SFT items from prompt/completion or messages records, and counts of what happened.

    `fmt="auto"` takes the shape of the first record. `chat` renders prompt/completion pairs through
    the chat template. A prompt given as a list of messages (conversational prompt/completion) is
    rendered as messages. Items whose loss tokens were all truncated away are dropped and counted.
    """
    if not records:
        raise ConfigError("No SFT records to train on; check data.path.")
    auto = fmt == "auto"
    fmt = sft_format(records[0], fmt, text_field, record_name(records, 0, key))
    items: list[dict] = []
    stats = {"format": fmt, "records": len(records), "items": 0, "truncated": 0, "dropped_no_loss": 0,
             "tokens": 0, "loss_tokens": 0, "first_cut": None}
    for i, r in enumerate(records):
        item = encode_record(tokenizer, r, fmt, max_len, chat, record_name(records, i, key), template, auto)
        stats["truncated"] += item["truncated"]
        if item["truncated"] and stats["first_cut"] is None:
            stats["first_cut"] = record_name(records, i, key)
        n_loss = sum(t != IGNORE for t in item["labels"])
        if n_loss == 0:
            stats["dropped_no_loss"] += 1
            continue
        stats["tokens"] += len(item["input_ids"])
        stats["loss_tokens"] += n_loss
        items.append(item)
    stats["items"] = len(items)
    if not items:
        raise ConfigError(f"All {len(records)} SFT records lost every loss token (prompts longer than "
                          f"data.max_seq_length={max_len}, or no assistant turns); raise max_seq_length.")
    return items, stats


def encode_record(tokenizer, r: dict, fmt: str, max_len: int, chat: bool, where: str = "Record",
                  template: str = "plain", auto: bool = False) -> dict:
    """One SFT record (`fmt` prompt_completion or messages) as input_ids/labels/truncated. A prompt given
    as a list of messages (conversational prompt/completion) is rendered as messages. `where` names the
    record in errors (its file and line, or its row); `auto`: fmt is the first row's shape (data.format=auto)."""
    check_sft_record(r, fmt, where, auto)
    if fmt == "messages":
        return encode_messages(tokenizer, r["messages"], max_len)
    if isinstance(r["prompt"], list):
        done = r["completion"]
        done = done if isinstance(done, list) else [{"role": "assistant", "content": str(done)}]
        return encode_messages(tokenizer, r["prompt"] + done, max_len)
    return encode_prompt_completion(tokenizer, str(r["prompt"]), str(r["completion"]), max_len, chat, template)


def cut_note(stats: dict, max_len: int, what: str = "rows") -> list[str]:
    """The start line saying how many rows were longer than data.max_seq_length and cut there (and the first
    of them), from build_sft_items' or sft_items' counts."""
    n = stats.get("truncated", 0)
    if not n:
        return []
    first = f" (the first: {stats['first_cut']})" if stats.get("first_cut") else ""
    return [f"{n} of {stats['records']} {what} are longer than data.max_seq_length={max_len} tokens and are cut "
            f"there, keeping their start{first}"]


def split_records(records: list, eval_fraction: float, seed: int) -> tuple[list, list]:
    """(train, eval): a seeded random `eval_fraction` held out (at least one when > 0 and there are
    two or more records); both keep the input order."""
    train, evals = split_indices(len(records), eval_fraction, seed)
    if isinstance(records, Records):   # the records keep where they were read, for errors that name them
        return tuple(Records([records[i] for i in part], [records.origins[i] for i in part] if records.origins else None)
                     for part in (train, evals))
    return [records[i] for i in train], [records[i] for i in evals]


def split_indices(n: int, eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """The positions split_records keeps and holds out of n rows (for rows that stay on disk)."""
    n_eval = int(round(n * eval_fraction))
    if eval_fraction > 0 and n >= 2:
        n_eval = min(max(n_eval, 1), n - 1)
    order = list(range(n))
    random.Random(seed).shuffle(order)
    held = set(order[:n_eval])
    return [i for i in range(n) if i not in held], [i for i in range(n) if i in held]


def collate(items: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest item: input_ids/attention_mask/labels LongTensors [B, T]. Padding has
    attention 0 and label -100, so it is neither attended to nor trained on."""
    import torch

    T = max(len(it["input_ids"]) for it in items)
    B = len(items)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros((B, T), dtype=torch.long)  # [B, T]
    labels = torch.full((B, T), IGNORE, dtype=torch.long)  # [B, T]
    for b, it in enumerate(items):
        n = len(it["input_ids"])
        input_ids[b, :n] = torch.as_tensor(it["input_ids"], dtype=torch.long)
        attention_mask[b, :n] = 1
        labels[b, :n] = torch.as_tensor(it.get("labels", it["input_ids"]), dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
