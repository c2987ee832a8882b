"""Rows in the shapes trainfit reads, from the shapes users keep: recognised by their columns, or mapped.

Each kind of data reads some fields (FIELDS): pretraining `text`; SFT `prompt` + `completion` or
`messages`; reward-model pairs `prompt` or `messages`, `chosen`, `rejected` (or, for KTO, unpaired rows:
`completion` and a boolean `label`); tasks `prompt` or `messages`,
`answer` (and `completion`, the SFT target). A field comes from the column `columns` maps to it, else
from the column of its own name, else from a recognised shape:
  TRL          prompt/completion, messages, prompt/chosen/rejected, chosen/rejected (implicit prompt: the
               common start of the two, as TRL's extract_prompt)
  H4           chosen/rejected as whole conversations (HuggingFaceH4/ultrafeedback_binarized), with or without
               `prompt` text and `messages`: the conversations' common start is the prompt (TRL's
               maybe_extract_prompt), the other two columns are not read
  verl         prompt as chat messages, reward_model.ground_truth (the answer), data_source, extra_info
  alpaca       instruction (+ input, joined by a newline as LLaMA-Factory does), output (+ system, history)
  sharegpt     conversations of {from, value} (human/gpt/system/observation/function_call) (+ system)
  Q&A tasks    question or problem as the prompt; answer, ground_truth, final_answer or solution as the answer
A task row keeps its other columns as fields for reward functions (as JSONL rows do). A `Shape` says
what fed what ("prompt <- question, answer <- answer"), which the run prints at start.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from trainfit.config import ConfigError
from trainfit.data.records import MESSAGE, described

FIELDS = {"text": ("text",), "sft": ("prompt", "completion", "messages"),
          "pairs": ("prompt", "messages", "chosen", "rejected", "completion", "label"),
          "task": ("prompt", "messages", "answer", "completion")}
CANONICAL = ("text", "prompt", "completion", "messages", "chosen", "rejected", "answer")
WHAT = {"text": "pretraining", "sft": "SFT", "pairs": "reward-model pairs", "task": "task rows"}
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "model": "assistant",
         "system": "system", "observation": "tool", "tool": "tool", "function_call": "assistant"}
PROMPT_NAMES = ("question", "problem", "query")
ANSWER_NAMES = ("answer", "ground_truth", "reward_model.ground_truth", "final_answer", "solution")
_MISSING = object()


def get(row: dict, spec: str) -> Any:
    """The value at a column name, or a dotted path into nested columns (reward_model.ground_truth)."""
    if spec in row:
        return row[spec]
    cur: Any = row
    for part in spec.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return _MISSING
        cur = cur[part]
    return cur


def has(row: dict, spec: str) -> bool:
    return get(row, spec) is not _MISSING


@dataclass
class Shape:
    """How one source's rows become trainfit rows. Picklable (datasets.map may run it in processes)."""

    want: str                      # text | sft | pairs | task
    name: str                      # the recognised shape, for the start line
    sources: dict[str, str]        # field -> column, e.g. {"prompt": "question", "answer": "answer"}
    where: str                     # "data.path x.parquet" for errors
    identity: bool = False         # the rows already are trainfit rows (JSONL in trainfit's shapes)
    alpaca: bool = False           # prompt = instruction + "\n" + input; system/history make messages
    sharegpt_system: Optional[str] = None   # a system column to put first
    implicit_prompt: bool = False  # pairs: prompt = the common start of chosen and rejected
    extra: list = field(default_factory=list)   # alpaca: [system column, history column] present

    def describe(self) -> str:
        fed = ", ".join(f"{f} <- {c}" for f, c in self.sources.items())
        if self.implicit_prompt:
            fed += ", prompt <- the common start of chosen and rejected"
        return f"{fed} ({self.name})"

    def __call__(self, row: dict, i: int = 0, at: Optional[str] = None) -> dict:
        """The row in trainfit's shape; `at` names it in errors (default: the source's row i)."""
        if self.identity:
            return row
        at = at or f"{self.where}, row {i}"
        out: dict = {}
        for f, col in self.sources.items():
            if self.alpaca and f in ("prompt",):
                out[f] = "\n".join(str(v) for v in (get(row, "instruction"), row.get("input")) if v)
                continue
            v = get(row, col)
            if (v is _MISSING or v is None) and f == "completion" and self.want == "task":
                continue   # a task row's SFT target is optional (the answer stands in)
            if v is _MISSING or v is None:
                raise ConfigError(f"{at} has no value in column {col!r} (the {f}); fill it or drop the row.")
            out[f] = v
        for f in ("messages", "prompt", "completion", "chosen", "rejected"):
            if f in out:
                out[f] = _side(out[f], at, self.sources[f] if f in self.sources else f, f == "messages")
        if self.alpaca and self.extra:
            out = _alpaca_messages(out, row, self.want)
        if self.sharegpt_system and row.get(self.sharegpt_system):
            key = "messages" if "messages" in out else "prompt"
            if isinstance(out.get(key), list):
                out[key] = [{"role": "system", "content": str(row[self.sharegpt_system])}] + out[key]
        if self.implicit_prompt:
            out["prompt"], out["chosen"], out["rejected"] = _implicit(out["chosen"], out["rejected"])
        if self.want == "task":
            if isinstance(out.get("prompt"), list):   # verl / TRL conversational prompt: the chat messages
                out["messages"] = out.pop("prompt")
            out = {**{k: v for k, v in row.items() if k not in CANONICAL}, **out}
        return out


def _side(v: Any, at: str, col: str, messages: bool) -> Any:
    """A text, or chat messages ({role, content}; sharegpt's {from, value} renamed; keys that Arrow filled
    with None for messages without them dropped). A single message as a dict stands for its content. Chat
    messages stored as JSON text (verl's prompt written by pandas / to_json) are decoded, not trained on as
    the literal JSON."""
    decoded = json_messages(v)
    if decoded is not None:
        v = decoded
    if isinstance(v, dict) and not messages and ("content" in v or "value" in v):
        v = v.get("content", v.get("value"))
    if isinstance(v, str) and not messages:
        return v
    if not isinstance(v, list):
        if messages or not isinstance(v, (int, float)) or isinstance(v, bool):
            kind = f"a struct (object) with fields {sorted(v)}" if isinstance(v, dict) else f"a {type(v).__name__}"
            raise ConfigError(f"{at}: column {col!r} holds {kind}, not "
                              + ("a list of chat messages ({role, content})" if messages else "text or chat messages")
                              + "; map another column to it (columns) or fix the data.")
        return str(v)
    out = []
    for j, m in enumerate(v):
        if not isinstance(m, dict):
            raise ConfigError(f"{at}: column {col!r} item {j} is {described(m)}, not a message; write each message as "
                              f"{MESSAGE}, or drop the row.")
        if "role" not in m and "from" in m:   # sharegpt
            role = ROLES.get(str(m["from"]).lower())
            if role is None:
                raise ConfigError(f"{at}: column {col!r} item {j} has from={m['from']!r}; sharegpt turns are from "
                                  f"{', '.join(ROLES)}: fix the row or map a messages column instead.")
            m = {"role": role, "content": m.get("value")}
        elif "role" not in m:
            raise ConfigError(f"{at}: column {col!r} item {j} has keys {sorted(m)}; a chat message needs `role` and "
                              "`content` (or sharegpt's `from` and `value`): fix the row or drop it.")
        out.append({k: x for k, x in m.items() if x is not None or k in ("role", "content")})
    return out


def json_messages(v: Any) -> Optional[list]:
    """Chat messages stored as JSON text ('[{"role": "user", "content": ...}]'), decoded; else None."""
    if not isinstance(v, str) or not v.lstrip().startswith("[{"):
        return None
    try:
        out = json.loads(v)
    except json.JSONDecodeError:
        return None
    ok = isinstance(out, list) and out and all(isinstance(m, dict) and ("role" in m or "from" in m) for m in out)
    return out if ok else None


def _alpaca_messages(out: dict, row: dict, want: str) -> dict:
    """alpaca with a system prompt or history: the conversation as messages, as LLaMA-Factory builds it."""
    system, history = (row.get(c) for c in ("system", "history"))
    msgs = [{"role": "system", "content": str(system)}] if system else []
    for turn in history or []:
        msgs += [{"role": "user", "content": str(turn[0])}, {"role": "assistant", "content": str(turn[1])}]
    msgs.append({"role": "user", "content": out.pop("prompt")})
    if want == "sft":
        return {"messages": msgs + [{"role": "assistant", "content": str(out.pop("completion"))}]}
    key = "messages" if want == "task" else "prompt"
    return {**out, key: msgs}


def _implicit(chosen: Any, rejected: Any) -> tuple:
    """TRL's extract_prompt: the prompt is the common start of chosen and rejected (texts or messages)."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if isinstance(chosen, str) and idx and chosen[idx - 1] == " ":  # the space goes with the answer
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def recognise(first: dict, want: str, mapping: dict, where: str, section: str, text_field: str = "text",
              plain: bool = False) -> Shape:
    """The Shape of a source from its first row. `plain` (JSONL): rows in trainfit's own shapes pass
    unchanged, and rows in no known shape too (trainfit.data / the task reader then say what is wrong)."""
    cols = sorted(first)
    allowed = FIELDS[want]
    for f, col in mapping.items():
        if f not in allowed:
            raise ConfigError(f"{section}.columns maps {f!r}, which {WHAT[want]} do not read: map "
                              f"{', '.join(allowed)} (e.g. {section}.columns={{{allowed[0]}: <column>}}).")
        if not has(first, col):
            raise ConfigError(f"{section}.columns.{f}={col!r}: {where} has no column {col!r} (its columns: "
                              f"{', '.join(cols)}); fix the mapping.")
    src = dict(mapping)

    def by_name(f: str, *names: str) -> Optional[str]:
        """The mapped column of field f, else the first of f, *names the rows have."""
        if f in src:
            return src[f]
        return next((n for n in (f, *names) if has(first, n)), None)

    shape = _recognise(first, want, src, by_name, text_field, where)
    if shape is None:
        # JSONL rows of no known shape pass as written where the stage's row check words it best (a text row
        # given to SFT, a task row without a prompt); SFT and pairs get the mapping advice a parquet file gets.
        if plain and not (want in ("sft", "pairs") and not isinstance(first.get(text_field), str)):
            return Shape(want, "as written", {}, where, identity=True)
        raise ConfigError(_no_shape(cols, want, section, where))
    if plain and not mapping and shape.name in _NATIVE and all(f == c for f, c in shape.sources.items()) \
            and not (want == "task" and isinstance(first.get("prompt"), list)) \
            and not any(json_messages(first.get(f)) for f in CANONICAL):   # JSON text to decode row by row
        shape.identity = True
    return shape


_NATIVE = ("text", "messages", "prompt/completion", "pairs", "unpaired", "prompt and answer")


def _recognise(first: dict, want: str, src: dict, by_name, text_field: str, where: str) -> Optional[Shape]:
    def make(name: str, sources: dict, **kw) -> Shape:
        return Shape(want, name, {f: c for f, c in sources.items() if c}, where, **kw)

    if want == "text":  # the text goes under data.text_field, where the pretraining builders read it
        col = src.get("text", text_field)
        return make("text", {text_field: col}) if has(first, col) else None
    if want == "sft":
        if "messages" in src or ("messages" in first and not {"prompt", "completion"} & set(src)):
            return make("messages", {"messages": by_name("messages")})
        if by_name("prompt") and by_name("completion"):
            return make("prompt/completion", {"prompt": by_name("prompt"), "completion": by_name("completion")})
        if "conversations" in first:
            return make("sharegpt", {"messages": "conversations"}, sharegpt_system="system" if "system" in first else None)
        if "instruction" in first and "output" in first:
            return _alpaca(first, make, {"prompt": "instruction + input", "completion": "output"})
        return None
    if want == "pairs":
        chosen, rejected = by_name("chosen"), by_name("rejected")
        if not (chosen or rejected) and by_name("completion") and by_name("label"):   # TRL's unpaired (KTO)
            prompt_f = "messages" if "messages" in src or ("messages" in first and "prompt" not in src) else "prompt"
            if by_name(prompt_f):
                return make("unpaired", {prompt_f: by_name(prompt_f), "completion": by_name("completion"),
                                         "label": by_name("label")})
        if not (chosen and rejected):
            return None
        sides = {"chosen": chosen, "rejected": rejected}
        if _whole_conversation(json_messages(get(first, chosen)) or get(first, chosen)) and not {"prompt", "messages"} & set(src):
            # HuggingFaceH4/ultrafeedback_binarized: each side the whole conversation, the prompt repeated in a
            # `prompt` text and `messages` (the chosen conversation again). As TRL's maybe_extract_prompt: the
            # common start of the two conversations is the prompt, their differing ends the answers.
            return make("conversations with a shared start", sides, implicit_prompt=True)
        if "messages" in src or ("messages" in first and "prompt" not in src):
            return make("pairs", {"messages": by_name("messages"), **sides})
        if by_name("prompt"):
            return make("pairs", {"prompt": by_name("prompt"), **sides})
        if "conversations" in first:
            return make("sharegpt pairs", {"messages": "conversations", **sides},
                        sharegpt_system="system" if "system" in first else None)
        if "instruction" in first:
            return _alpaca(first, make, {"prompt": "instruction + input", **sides})
        return make("TRL implicit-prompt pairs", sides, implicit_prompt=True)
    # task
    answer = by_name("answer", *ANSWER_NAMES[1:])
    prompt_f = "messages" if "messages" in src or ("messages" in first and not {"prompt"} & (set(src) | set(first))) \
        else "prompt"
    prompt = by_name(prompt_f, *(PROMPT_NAMES if prompt_f == "prompt" else ()))
    if prompt_f == "prompt" and prompt and (isinstance(get(first, prompt), list) or json_messages(get(first, prompt))):
        prompt_f = "messages"   # verl's and TRL's conversational prompt: chat messages
    completion = by_name("completion")
    if prompt is None and "instruction" in first and "output" in first:
        return _alpaca(first, make, {"prompt": "instruction + input", "answer": answer or "output",
                                     "completion": completion})
    if prompt is None or answer is None:
        return None
    verl = answer == "reward_model.ground_truth" and prompt_f == "messages"
    name = "verl" if verl else "prompt and answer" if (prompt, answer) == (prompt_f, "answer") else "question and answer"
    return make(name, {prompt_f: prompt, "answer": answer, "completion": completion})


def _whole_conversation(v: Any) -> bool:
    """Whether a pair's side is a whole conversation (it starts with the prompt's turns, not the answer)."""
    return isinstance(v, list) and bool(v) and isinstance(v[0], dict) \
        and (v[0].get("role") or ROLES.get(str(v[0].get("from", "")).lower())) not in (None, "assistant")


def _alpaca(first: dict, make, sources: dict) -> Shape:
    extra = [c for c in ("system", "history") if c in first]
    return make("alpaca", sources, alpaca=True, extra=extra)


def _no_shape(cols: list, want: str, section: str, where: str) -> str:
    shapes = {"text": "a `text` column (or data.text_field / data.columns.text naming the text column)",
              "sft": "prompt/completion, messages, sharegpt conversations, or alpaca instruction/input/output",
              "pairs": "chosen and rejected (with prompt, messages, conversations or instruction, or none)",
              "task": "a prompt (prompt, messages, question or problem) and an answer (answer, ground_truth, "
                      "reward_model.ground_truth, final_answer or solution)"}[want]
    hint = _suggest(cols, want)
    return (f"{where} has columns {', '.join(cols)}, which match no shape trainfit reads for {WHAT[want]} "
            f"({shapes}); map the columns, e.g. {section}.columns={{{hint}}}.")


def _suggest(cols: list, want: str) -> str:
    pick = lambda *names: next((c for c in cols if c.lower() in names), None)  # noqa: E731
    q = pick("question", "problem", "query", "input", "instruction", "prompt", "context") or "<column>"
    a = pick("answer", "response", "output", "completion", "solution", "target") or "<column>"
    return {"text": f"text: {pick('content', 'body', 'document', 'passage') or '<column>'}",
            "sft": f"prompt: {q}, completion: {a}", "pairs": f"prompt: {q}, chosen: <column>, rejected: <column>",
            "task": f"prompt: {q}, answer: {a}"}[want]
