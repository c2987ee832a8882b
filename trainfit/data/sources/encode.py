"""SFT items from an Arrow-backed source: tokenized with datasets.map (in processes for large sets), cached.

The rows never become one Python list: `datasets.map` converts and encodes them a batch at a time with
the same functions JSONL rows go through (shapes.Shape, data.encode_record), and writes input_ids and
labels to an Arrow cache file next to the dataset's own (datasets' cache; a save_to_disk folder gets
its cache-*.arrow files, as datasets does). The cache is keyed by the rows, the tokenizer, the
settings and trainfit's encoding code, so a changed tokenizer or trainfit version tokenizes afresh.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Sequence

from trainfit.config import ConfigError
from trainfit.data.text import IGNORE, detect_format, encode_record

# Rows from which tokenizing is spread over processes (below, starting them costs more than it saves).
PARALLEL_FROM = 20_000
_CODE = [Path(__file__).parent / "shapes.py", Path(__file__).parents[1] / "text.py"]


class _Encode:
    """datasets.map function: a batch of source rows -> input_ids, labels, truncated, loss tokens."""

    def __init__(self, rows, tokenizer, fmt: str, max_len: int, chat: bool, template: str = "plain",
                 auto: bool = False):
        self.shape, self.positions = rows.shape, rows.positions
        self.tokenizer, self.fmt, self.max_len, self.chat = tokenizer, fmt, max_len, chat
        self.template, self.auto = template, auto

    def __call__(self, batch: dict, idx: list[int]) -> dict:
        out: dict = {"input_ids": [], "labels": [], "truncated": [], "loss_tokens": []}
        names = list(batch)
        for j, i in enumerate(idx):
            pos = self.positions[i] if self.positions is not None else i
            row = self.shape({k: batch[k][j] for k in names}, pos)
            item = encode_record(self.tokenizer, row, self.fmt, self.max_len, self.chat, f"{self.shape.where}, row {pos}",
                                 self.template, self.auto)
            out["input_ids"].append(item["input_ids"])
            out["labels"].append(item["labels"])
            out["truncated"].append(bool(item["truncated"]))
            out["loss_tokens"].append(sum(t != IGNORE for t in item["labels"]))
        return out


def tokenizer_fingerprint(tokenizer) -> str:
    """What the tokens depend on: the vocabulary and rules, special tokens, the chat template."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None else repr(sorted(tokenizer.get_vocab().items())).encode())
    tmpl = getattr(tokenizer, "chat_template", None)
    h.update(repr((tmpl, tokenizer.eos_token, tokenizer.bos_token, type(tokenizer).__name__)).encode())
    return h.hexdigest()


def _fingerprint(rows, tokenizer, fmt: str, max_len: int, chat: bool, template: str = "plain") -> str:
    h = hashlib.sha256()
    for f in _CODE:
        h.update(f.read_bytes())
    h.update(repr((rows.table._fingerprint, rows.shape, rows.positions is None, fmt, max_len, chat, template)).encode())
    h.update(tokenizer_fingerprint(tokenizer).encode())
    return h.hexdigest()[:32]


class ArrowItems(Sequence):
    """Tokenized items on disk: item i is {"input_ids": [...], "labels": [...]}, read when asked for."""

    def __init__(self, table):
        self.table = table

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        row = self.table[int(i)]
        return {"input_ids": row["input_ids"], "labels": row["labels"]}


def sft_items(rows, tokenizer, max_len: int, fmt: str = "auto", chat: bool = False,
              template: str = "plain") -> tuple[ArrowItems, dict]:
    """The SFT items of an Arrow-backed Rows (as data.build_sft_items makes them from a list), and counts."""
    auto = fmt == "auto"
    if auto:
        fmt = detect_format(rows[0])
    if fmt == "text":
        raise ConfigError(f"{rows.key}: SFT needs prompt/completion or messages rows, but {rows.label} holds raw "
                          "text; use stage pretrain for text, or map the columns (data.columns).")
    n = len(rows)
    workers = min(os.cpu_count() or 1, 8) if n >= PARALLEL_FROM else None
    table = rows.table
    enc = table.map(_Encode(rows, tokenizer, fmt, max_len, chat, template, auto), batched=True, batch_size=256, with_indices=True,
                    remove_columns=table.column_names, num_proc=workers if workers and workers > 1 else None,
                    new_fingerprint=_fingerprint(rows, tokenizer, fmt, max_len, chat, template), desc="tokenizing")
    loss = enc["loss_tokens"]
    stats = {"format": fmt, "records": n, "truncated": int(sum(enc["truncated"])),
             "dropped_no_loss": sum(1 for k in loss if k == 0), "loss_tokens": int(sum(loss))}
    keep = [i for i, k in enumerate(loss) if k > 0]
    if not keep:
        raise ConfigError(f"All {n} SFT rows of {rows.label} lost every loss token (prompts longer than "
                          f"data.max_seq_length={max_len}, or no assistant turns); raise max_seq_length.")
    if len(keep) < n:
        enc = enc.select(keep)
    stats["items"] = len(keep)
    return ArrowItems(enc.select_columns(["input_ids", "labels"])), stats
