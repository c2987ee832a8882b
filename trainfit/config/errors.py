"""Pydantic errors as one readable paragraph: the key, the value, what it accepts; for an unknown key, the
trainfit key another tool's key means (peer_keys) or else the nearest valid key."""

from __future__ import annotations

import difflib
from typing import Any, Optional

from pydantic import BaseModel, ValidationError

from trainfit.config import peer_keys


def valid_keys(schema: type[BaseModel]) -> list[str]:
    """All dotted keys of the schema (for suggestions and docs)."""
    keys: list[str] = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, f"{prefix}{name}.")
            else:
                keys.append(prefix + name)
    walk(schema, "")
    return keys


def field_doc(schema: type[BaseModel], dotted: str) -> Optional[str]:
    model: Any = schema
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        f = getattr(model, "model_fields", {}).get(part)  # a Union-typed field has no sub-fields
        if f is None:
            return None
        if i == len(parts) - 1:
            return f.description
        model = f.annotation
    return None


def format_validation_error(schema: type[BaseModel], e: ValidationError, raw: dict) -> str:
    lines = []
    keys = valid_keys(schema)
    errors, leaves = e.errors(), list(keys)
    keys += sorted({k.split(".")[0] for k in keys if "." in k})  # section names
    for n, err in enumerate(errors):
        loc = ".".join(str(x) for x in err["loc"] if not str(x).startswith("function-after"))
        member = _union_member(err["loc"], leaves)
        if member is not None:  # one error per member of an `auto | int` field: one sentence for the field
            loc, err = member, {**err, "loc": tuple(member.split(".")), "type": "union", "msg": _one_of(
                [_accepts(x) for x in errors if _union_member(x["loc"], leaves) == member])}
            if any(_union_member(x["loc"], leaves) == member for x in errors[:n]):
                continue
        if err["type"] == "extra_forbidden":
            peer = peer_keys.answer(_key(loc), _lookup(raw, err["loc"]))
            if peer:  # another tool's name for a trainfit key: that key, not the nearest spelling
                lines.append(peer)
                continue
            close = difflib.get_close_matches(loc, keys, n=1, cutoff=0.5)
            if not close:  # compare the leaf name within its section
                leaf = loc.split(".")[-1]
                close = difflib.get_close_matches(leaf, [k.split(".")[-1] for k in keys], n=1, cutoff=0.6)
                close = [k for k in keys if k.split(".")[-1] == close[0]][:1] if close else []
            hint = f"did you mean {close[0]!r}?" if close else "see `trainfit keys` for the valid keys."
            lines.append(f"Unknown config key {loc!r}; {hint}")
        elif err["type"] == "missing":
            lines.append(f"{loc!r} is required and missing." + (f" {loc} is: {field_doc(schema, loc)}"
                                                                  if field_doc(schema, loc) else ""))
        elif err["type"] == "value_error":
            lines.append(str(err["msg"]).removeprefix("Value error, "))
        else:
            value = _lookup(raw, err["loc"])
            doc = field_doc(schema, loc)
            allowed = err["msg"] if err["type"] == "union" else _accepts(err)
            lines.append(f"{loc!r} takes {allowed}, not {value!r}."
                         + (f" {loc} is: {doc}" if doc else ""))
    return " ".join(lines)


# What a field of each pydantic error type takes, in words (pydantic's own text is a sentence of its own).
_TAKES = {"bool_parsing": "true or false", "bool_type": "true or false", "int_parsing": "an integer",
          "int_type": "an integer", "int_from_float": "an integer", "float_parsing": "a number",
          "float_type": "a number", "string_type": "text", "list_type": "a list, e.g. [a, b]",
          "dict_type": "a mapping, e.g. {key: value}", "none_required": "null"}
_BOUNDS = {"greater_than_equal": ("ge", "greater than or equal to"), "greater_than": ("gt", "greater than"),
           "less_than_equal": ("le", "less than or equal to"), "less_than": ("lt", "less than")}


def _accepts(err: dict) -> str:
    """What the field takes, in a few words that follow "KEY takes": `'fp32', 'bf16' or 'fp16'`,
    `true or false`, `a value greater than or equal to 1`."""
    ctx = err.get("ctx") or {}
    if ctx.get("expected"):
        return ctx["expected"]
    if err["type"] in _BOUNDS:
        bound, words = _BOUNDS[err["type"]]
        return f"a value {words} {ctx.get(bound)}"
    if err["type"] in _TAKES:
        return _TAKES[err["type"]]
    msg = str(err["msg"])   # a type this table lacks: pydantic's "Input should be X" is "X"
    return msg.removeprefix("Input should be ").split(", ")[0] if msg.startswith("Input should be ") else msg


def _one_of(words: list[str]) -> str:
    """`true or false, an integer or a number`: each member once, the last after "or"."""
    words = list(dict.fromkeys(words))
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


def _union_member(loc: tuple, keys: list[str]) -> Optional[str]:
    """The key of a Union-typed field when `loc` names one of its members (train.cpu_threads.int), else None."""
    parts = [str(x) for x in loc]
    if ".".join(parts) in keys:
        return None
    for cut in range(len(parts) - 1, 1, -1):
        if ".".join(parts[:cut]) in keys:
            return ".".join(parts[:cut])
    return None


def _lookup(raw: Any, loc: tuple) -> Any:
    node = raw
    for part in loc:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            return "<missing>"
    return node


def _key(loc: str) -> str:
    """A key as a single stage writes it: a pipeline's `stages.1.grpo.group_size` is `grpo.group_size`."""
    parts = loc.split(".")
    return ".".join(parts[2:]) if len(parts) > 2 and parts[0] == "stages" and parts[1].isdigit() else loc
