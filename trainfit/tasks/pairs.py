"""Preference pairs for reward-model training (stage rm): rows with a prompt and two answers.

Accepted rows (one JSON object a line, or the same columns in any source trainfit/data/sources/ reads):
  {"prompt": "2+2=", "chosen": "4", "rejected": "5"}                       plain text (chat: templated)
  {"messages": [{"role": "user", ...}], "chosen": "4", "rejected": "5"}    a conversation, then the answers
  {"prompt": [messages...], "chosen": [messages...], "rejected": [...]}   conversational (TRL's shape)
Each side is tokenized as the SFT data is (trainfit.data), so a reward model scores exactly what a
policy trained by trainfit produces: prompt + answer + the end-of-turn token.

Without data.path, stage rm makes its pairs from task.name (`task_pairs`): the task's target chosen,
a wrong answer rejected. `PairRows` says which rows a stage trains on and holds out; the trainer
(train/rm.py) encodes all of them and the planner (plan/lengths.py) a sample, with `encode_pairs`
both, so the planned lengths are the trained ones.
"""

from __future__ import annotations

import random
from typing import Any, Iterable, Optional

from trainfit.config import ConfigError
from trainfit.data import sources
from trainfit.data.records import Records, check_side, described, null_error
from trainfit.data.text import IGNORE, encode_messages, encode_prompt_completion, record_name, split_records
from trainfit.tasks import build_task

SHAPE = ("`prompt` (text or messages) or `messages`, plus `chosen` and `rejected` (text or messages), e.g. "
         '{"prompt": "2+2=", "chosen": "4", "rejected": "5"}')
UNPAIRED_SHAPE = ("`prompt` (text or messages) or `messages`, plus `completion` (text or messages) and `label` "
                  '(true = desirable, false = undesirable), e.g. {"prompt": "2+2=", "completion": "4", "label": true}')


class PairRows:
    """The preference rows stage rm trains on and holds out, the training rows addressable by position.

    data.path (any source trainfit/data/sources/ reads; TRL's, sharegpt's and alpaca's pair columns are
    recognised): its rows, less a seeded data.eval_fraction held out (or all of them when data.eval_path
    or data.eval_split gives the held-out rows); else rows made from task.name, one fresh pair per sample
    (train.max_steps x global_batch_size of them) and the task's held-out problems for eval. `notes` say
    what was read."""

    def __init__(self, cfg):
        d, self.seed = cfg.data, cfg.train.seed
        self.task, self.notes = None, []
        self.held_key = "data.path"   # the key errors about a held-out row name
        if d.path is None:
            self.task = build_task(cfg.task)
            self.n = cfg.train.max_steps * cfg.train.global_batch_size
        else:
            rows, held = sources.read_rows(d, "pairs"), sources.read_rows(d, "pairs", held_out=True)
            self.notes = [r.note for r in (rows, held) if r is not None and not r.shape.identity]
            # Records: each row keeps its file line (or dataset row), so errors name it after the split.
            if held is not None:
                self._train, self._held, self.held_key = rows.to_list(), held.to_list(), held.key
            else:
                self._train, self._held = split_records(rows.to_list(), d.eval_fraction, self.seed)
            self.n = len(self._train)

    def train(self, positions: Optional[Iterable[int]] = None) -> list[dict]:
        """Every training row, or those at `positions` (0 <= position < n)."""
        if self.task is None:
            if positions is None:
                return self._train
            positions = list(positions)   # each row keeps its file line (or dataset row) for errors
            origins = getattr(self._train, "origins", None)
            return Records([self._train[i] for i in positions], [origins[i] for i in positions] if origins else None)
        if positions is None:
            return task_pairs(self.task, range(self.n), self.seed)
        return task_pairs_at(self.task, self.n, positions, self.seed)

    def held(self) -> list[dict]:
        return task_pairs(self.task, (), self.seed, held_out=True) if self.task is not None else self._held


def _prompt_field(r: dict) -> str:
    """The key a pair row's prompt is under: `messages` (a conversation), else `prompt`."""
    return "messages" if r.get("messages") is not None or "prompt" not in r else "prompt"


def _side(tokenizer, row: dict, answer: Any, max_len: int, chat: bool) -> dict:
    prompt = row.get("messages", row.get("prompt"))
    if isinstance(prompt, list) or isinstance(answer, list):
        msgs = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
        reply = answer if isinstance(answer, list) else [{"role": "assistant", "content": str(answer)}]
        return encode_messages(tokenizer, msgs + reply, max_len)
    return encode_prompt_completion(tokenizer, str(prompt), str(answer), max_len, chat)


def check_pair_row(r, where: str, what: str = "preference rows") -> None:
    """A pair row holds a prompt (or messages) and both answers, none of them null (it would train on the
    text "None"), each text, a number or chat messages (check_side), and both answers of one kind: a chat
    answer is templated and a text one is not, so the two would be scored after different prompts.
    ConfigError naming the row otherwise."""
    if not isinstance(r, dict) or "chosen" not in r or "rejected" not in r or not ("prompt" in r or "messages" in r):
        raise ConfigError(f"{where} has keys {sorted(r) if isinstance(r, dict) else type(r).__name__}; "
                          f"{what} need {SHAPE}.")
    fields = (_prompt_field(r), "chosen", "rejected")
    problem = null_error(where, r, fields)
    if problem:
        raise ConfigError(problem)
    for f in fields:
        check_side(r[f], where, f)
    chosen, rejected = (isinstance(r[f], list) for f in ("chosen", "rejected"))
    if chosen != rejected:
        raise ConfigError(f"{where}: `chosen` is {_kind(r['chosen'])} but `rejected` is {_kind(r['rejected'])}; the "
                          "two answers of a pair must be of one kind, or they are encoded differently (a chat "
                          "answer through the chat template, a text one without it) and scored after different "
                          "prompts: write both as text or both as chat messages.")


def _kind(v) -> str:
    return "chat messages" if isinstance(v, list) else described(v)


def _encoded_sides(rows: list[dict], tokenizer, max_len: int, chat: bool, key: str, what: str):
    """(row index, chosen side, rejected side) of each pair row, tokenized (`_side`); a row without the
    pair's keys, or whose sides are the same tokens after truncation (it teaches nothing), is an error.
    Errors name the row's file line (or dataset row) when the rows are Records."""
    for i, r in enumerate(rows):
        where = record_name(rows, i, key)
        check_pair_row(r, where, what)
        c, j = _side(tokenizer, r, r["chosen"], max_len, chat), _side(tokenizer, r, r["rejected"], max_len, chat)
        if c["input_ids"] == j["input_ids"]:
            raise ConfigError(f"{where} has the same tokens for chosen and rejected (after truncation to "
                              f"data.max_seq_length={max_len}); fix the row or raise max_seq_length.")
        yield i, c, j


def encode_pairs(rows: list[dict], tokenizer, max_len: int, chat: bool, key: str = "data.path") -> tuple[list[dict], dict]:
    """[{"chosen": ids, "rejected": ids}] and counts. A pair whose sides are identical after
    tokenization teaches nothing and is an error; sides cut at `max_len` are counted (the reward is
    read at the last kept token)."""
    pairs, stats = [], {"pairs": 0, "truncated": 0}
    for i, c, j in _encoded_sides(rows, tokenizer, max_len, chat, key, "preference rows"):
        stats["truncated"] += int(c["truncated"] or j["truncated"])
        pairs.append({"chosen": c["input_ids"], "rejected": j["input_ids"]})
    stats["pairs"] = len(pairs)
    return pairs, stats


def _wrong_answer(task, ex, rng: random.Random, other) -> str:
    """A wrong completion for `ex`: an integer answer moved by 1..10 either way (the near misses a
    policy makes), else the target of another problem (`other`) with a different answer."""
    try:
        value = int(ex.answer)
    except ValueError:
        if other.answer == ex.answer:
            raise ConfigError(f"task.name={task.name}: cannot make a wrong answer for {ex.answer!r} (the next "
                              "problem has the same answer); give stage rm preference pairs in data.path.") from None
        return other.target
    delta = rng.choice([d for d in range(-10, 11) if d])
    return task.target_text(str(value + delta))


def task_pairs(task, indexes: Iterable[int], seed: int, held_out: bool = False) -> list[dict]:
    """Preference rows from a task: for each example (train_example(i) for i in `indexes`, or every
    held-out example) its target chosen and a wrong answer rejected, e.g.
    {"prompt": "37+58=", "chosen": "95", "rejected": "92"}. Seeded by (seed, index): the same rows on
    every rank and on resume."""
    examples = task.eval_examples() if held_out else [task.train_example(i) for i in indexes]
    return [_task_row(task, ex, examples[(i + 1) % len(examples)], seed, held_out, i) for i, ex in enumerate(examples)]


def task_pairs_at(task, n: int, positions: Iterable[int], seed: int) -> list[dict]:
    """Rows `positions` of task_pairs(task, range(n), seed), made without the other rows (the planner
    measures a sample of a stage's pairs, plan/lengths.py)."""
    return [_task_row(task, task.train_example(i), task.train_example((i + 1) % n), seed, False, i) for i in positions]


def _task_row(task, ex, other, seed: int, held_out: bool, i: int) -> dict:
    rng = random.Random(f"rm-pairs|{seed}|{int(held_out)}|{i}")
    prompt = {"messages": ex.messages} if ex.messages is not None else {"prompt": ex.prompt}
    return {**prompt, "chosen": ex.target, "rejected": _wrong_answer(task, ex, rng, other)}


def _split_prompt(c: dict, j: dict) -> int:
    """Tokens the two sides share as their prompt: up to the first answer token of either side (and
    no further than their common prefix, for templates that render a prompt differently per answer)."""
    first = [next((k for k, lab in enumerate(s["labels"]) if lab != IGNORE), len(s["labels"])) for s in (c, j)]
    k = 0
    while k < min(first) and c["input_ids"][k] == j["input_ids"][k]:
        k += 1
    return k


def encode_policy_pairs(rows: list[dict], tokenizer, max_len: int, chat: bool, key: str = "data.path"
                        ) -> tuple[list[dict], dict]:
    """Pairs for the policy's preference losses (stage dpo): the prompt's tokens once and each side's
    answer with its loss mask, {"prompt": ids, "chosen": ids, "chosen_mask": 0/1, "rejected": ...,
    "rejected_mask": ..., "index": i}. prompt + chosen is exactly `encode_pairs`' chosen sequence (the
    same tokens a reward model scores); the masks mark the answer's labelled tokens."""
    pairs, stats = [], {"pairs": 0, "truncated": 0}
    for i, c, j in _encoded_sides(rows, tokenizer, max_len, chat, key, "preference rows"):
        k = _split_prompt(c, j)
        out = {"prompt": c["input_ids"][:k], "index": i}
        for name, s in (("chosen", c), ("rejected", j)):
            out[name] = s["input_ids"][k:]
            out[name + "_mask"] = [int(lab != IGNORE) for lab in s["labels"][k:]]
        stats["truncated"] += int(c["truncated"] or j["truncated"])
        pairs.append(out)
    stats["pairs"] = len(pairs)
    return pairs, stats


def is_unpaired(row) -> bool:
    """Whether a row is KTO's unpaired shape (TRL's unpaired preference: prompt, completion, label)."""
    return isinstance(row, dict) and "completion" in row and "label" in row and "chosen" not in row


def encode_unpaired(rows: list[dict], tokenizer, max_len: int, chat: bool, key: str = "data.path"
                    ) -> tuple[list[dict], dict]:
    """KTO's unpaired rows: {"prompt": ids, "completion": ids, "completion_mask": 0/1, "desirable": bool,
    "index": i}; prompt + completion is the sequence SFT would train on for (prompt, completion)."""
    out, stats = [], {"rows": 0, "truncated": 0}
    for i, r in enumerate(rows):
        check_unpaired_row(r, record_name(rows, i, key), "kto")
        s = _side(tokenizer, r, r["completion"], max_len, chat)
        k = next((j for j, lab in enumerate(s["labels"]) if lab != IGNORE), len(s["labels"]))
        out.append({"prompt": s["input_ids"][:k], "completion": s["input_ids"][k:],
                    "completion_mask": [int(lab != IGNORE) for lab in s["labels"][k:]],
                    "desirable": r["label"], "index": i})
        stats["truncated"] += int(s["truncated"])
    stats["rows"] = len(out)
    return out, stats


def encode_policy_rows(rows: list[dict], tokenizer, max_len: int, chat: bool, loss_type: str,
                       key: str = "data.path") -> tuple[list[dict], dict, bool]:
    """Stage dpo's rows, paired (`encode_policy_pairs`) or, when the first row is KTO's unpaired shape,
    unpaired (`encode_unpaired`, only for dpo.loss_type=kto); and whether they are unpaired."""
    unpaired = bool(rows) and is_unpaired(rows[0])
    if not unpaired:
        return (*encode_policy_pairs(rows, tokenizer, max_len, chat, key), False)
    if loss_type != "kto":
        raise ConfigError(unpaired_loss_error(key, loss_type))
    return (*encode_unpaired(rows, tokenizer, max_len, chat, key), True)


def check_unpaired_row(r, where: str, loss_type: str, key: str = "data.path") -> None:
    """An unpaired row as encode_unpaired reads it: only for dpo.loss_type=kto, with a prompt (or messages),
    a completion and a boolean label, none of them null."""
    if loss_type != "kto":
        raise ConfigError(unpaired_loss_error(key, loss_type))
    if not is_unpaired(r) or not ("prompt" in r or "messages" in r):
        raise ConfigError(f"{where} has keys {sorted(r) if isinstance(r, dict) else type(r).__name__}; "
                          f"unpaired rows (the first row's shape) need {UNPAIRED_SHAPE}.")
    if not isinstance(r["label"], bool):
        raise ConfigError(f"{where} has label={r['label']!r}; an unpaired row's `label` is true (a desirable "
                          "completion) or false (an undesirable one): write it as a JSON boolean.")
    problem = null_error(where, r, (_prompt_field(r), "completion"))
    if problem:
        raise ConfigError(problem)
    for f in (_prompt_field(r), "completion"):
        check_side(r[f], where, f)


def unpaired_loss_error(key: str, loss_type: str) -> str:
    return (f"{key} holds unpaired rows (prompt, completion, label), which only dpo.loss_type=kto trains on, but "
            f"dpo.loss_type={loss_type}: set dpo.loss_type=kto, or give preference pairs ({SHAPE}).")
