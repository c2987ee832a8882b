"""Preference pairs for reward-model training (stage rm): JSONL rows with a prompt and two answers.

Accepted rows (one JSON object a line):
  {"prompt": "2+2=", "chosen": "4", "rejected": "5"}                       plain text (chat: templated)
  {"messages": [{"role": "user", ...}], "chosen": "4", "rejected": "5"}    a conversation, then the answers
  {"prompt": [messages...], "chosen": [messages...], "rejected": [...]}   conversational (TRL's shape)
Each side is tokenized as the SFT data is (trainfit.data), so a reward model scores exactly what a
policy trained by trainfit produces: prompt + answer + the end-of-turn token.
"""

from __future__ import annotations

from typing import Any

from trainfit.config import ConfigError
from trainfit.data import encode_messages, encode_prompt_completion

SHAPE = ("`prompt` (text or messages) or `messages`, plus `chosen` and `rejected` (text or messages), e.g. "
         '{"prompt": "2+2=", "chosen": "4", "rejected": "5"}')


def _side(tokenizer, row: dict, answer: Any, max_len: int, chat: bool) -> dict:
    prompt = row.get("messages", row.get("prompt"))
    if isinstance(prompt, list) or isinstance(answer, list):
        msgs = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        reply = answer if isinstance(answer, list) else [{"role": "assistant", "content": str(answer)}]
        return encode_messages(tokenizer, msgs + reply, max_len)
    return encode_prompt_completion(tokenizer, str(prompt), str(answer), max_len, chat)


def encode_pairs(rows: list[dict], tokenizer, max_len: int, chat: bool, key: str = "data.path") -> tuple[list[dict], dict]:
    """[{"chosen": ids, "rejected": ids}] and counts. A pair whose sides are identical after
    tokenization teaches nothing and is an error; sides cut at `max_len` are counted (the reward is
    read at the last kept token)."""
    pairs, stats = [], {"pairs": 0, "truncated": 0}
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or "chosen" not in r or "rejected" not in r or not ("prompt" in r or "messages" in r):
            raise ConfigError(f"{key}: row {i} has keys {sorted(r) if isinstance(r, dict) else type(r).__name__}; "
                              f"reward-model rows need {SHAPE}.")
        c, j = _side(tokenizer, r, r["chosen"], max_len, chat), _side(tokenizer, r, r["rejected"], max_len, chat)
        if c["input_ids"] == j["input_ids"]:
            raise ConfigError(f"{key}: row {i} has the same tokens for chosen and rejected (after truncation to "
                              f"data.max_seq_length={max_len}); fix the row or raise max_seq_length.")
        stats["truncated"] += int(c["truncated"] or j["truncated"])
        pairs.append({"chosen": c["input_ids"], "rejected": j["input_ids"]})
    stats["pairs"] = len(pairs)
    return pairs, stats
