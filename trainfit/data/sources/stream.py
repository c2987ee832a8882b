"""Streamed pretraining (data.streaming): blocks packed from a datasets IterableDataset as the run goes.

The stream is read in file order and packed as data.pack_texts packs a list: each text's tokens (with
the tokenizer's own sequence start), then eos, cut into blocks of max_seq_length; a block is its own
labels. Blocks are numbered from 0 in stream order; step s takes blocks s*B .. s*B+B-1 (B = global
batch), each rank its own part, so every rank reads the whole stream and skips the others' blocks (the
batch is the same for any number of ranks). At the end of the stream the next pass starts over.

Resumable: `state_dict()` holds the next block's number, the dataset's own position (datasets'
IterableDataset.state_dict, after the last row read), the tokens read but not yet in a block, and the
pass; a resumed run loads it and goes on with the same next block, without reading the stream again.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any, Callable

from trainfit.config import ConfigError


class BlockStream:
    def __init__(self, open_dataset: Callable[[], Any], shape, tokenizer, block: int, label: str, text_field: str):
        if tokenizer.eos_token_id is None:
            raise ConfigError("The tokenizer has no eos token, so documents cannot be separated; use a tokenizer "
                              "with one or set its eos_token.")
        self.open_dataset, self.shape, self.tokenizer = open_dataset, shape, tokenizer
        self.block, self.label, self.text_field = block, label, text_field
        self.eos = tokenizer.eos_token_id
        self.next_block = 0      # number of the next block the stream makes
        self.carry: list[int] = []   # tokens read, not yet in a block
        self.epoch = 0
        self.rows_read = 0       # rows of the current pass
        self.recent: dict[int, list[int]] = {}
        self._ds = None
        self._it = None
        self._source_state = None    # the dataset's position to resume from (None: its start)

    def _dataset(self):
        if self._ds is None:
            self._ds = self.open_dataset()
            if self._source_state is not None:
                self._ds.load_state_dict(self._source_state)
            self._it = iter(self._ds)
            if hasattr(self._it, "close"):  # closed before the interpreter tears pyarrow down (it complains)
                weakref.finalize(self, self._it.close)
        return self._ds

    def _row(self) -> str:
        self._dataset()
        try:
            row = next(self._it)
        except StopIteration:
            if self.rows_read == 0:
                raise ConfigError(f"data.path {self.label} streams no rows; check the path and data.split.") from None
            self.epoch += 1   # the next pass, from the stream's start
            self.rows_read, self._ds, self._source_state = 0, None, None
            return self._row()
        self.rows_read += 1
        text = self.shape(row, self.rows_read - 1).get(self.text_field)
        if not isinstance(text, str):
            raise ConfigError(f"data.path {self.label}, row {self.rows_read - 1} has no text in {self.text_field!r} "
                              f"(keys {sorted(row)}); set data.text_field or data.columns.text to the text column.")
        return text

    def _make_block(self) -> list[int]:
        while len(self.carry) < self.block:
            ids = self.tokenizer(self._row(), add_special_tokens=True)["input_ids"]
            self.carry.extend(list(ids) + [self.eos])
        out, self.carry = self.carry[:self.block], self.carry[self.block:]
        return out

    def item(self, index: int) -> dict:
        """Block `index` as an item ({"input_ids", "labels"}); indexes only move forward (a step's own
        blocks may be asked for again)."""
        if index not in self.recent:
            if index < self.next_block:
                raise RuntimeError(f"stream block {index} was passed already (next is {self.next_block})")
            while self.next_block <= index:
                self.recent[self.next_block] = self._make_block()
                self.next_block += 1
            for old in [k for k in self.recent if k < index - 4096]:
                del self.recent[old]
        ids = self.recent[index]
        return {"input_ids": ids, "labels": ids}

    def state_dict(self) -> dict:
        source = copy.deepcopy(self._ds.state_dict()) if self._ds is not None else self._source_state
        return {"next_block": self.next_block, "carry": list(self.carry), "epoch": self.epoch,
                "rows_read": self.rows_read, "source": source}

    def load_state_dict(self, state: dict) -> None:
        self.next_block, self.carry = state["next_block"], list(state["carry"])
        self.epoch, self.rows_read = state["epoch"], state["rows_read"]
        self._source_state, self._ds, self._it, self.recent = state["source"], None, None, {}
