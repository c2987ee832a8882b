"""Pydantic errors as one readable paragraph: the key, the value, what it accepts, the nearest valid key."""

from __future__ import annotations

import difflib
from typing import Any, Optional

from pydantic import BaseModel, ValidationError


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
            loc, err = member, {**err, "loc": tuple(member.split(".")), "type": "union", "msg": " or ".join(
                _member_name(x) for x in errors if _union_member(x["loc"], leaves) == member)}
            if any(_union_member(x["loc"], leaves) == member for x in errors[:n]):
                continue
        if err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(loc, keys, n=1, cutoff=0.5)
            if not close:  # compare the leaf name within its section
                leaf = loc.split(".")[-1]
                close = difflib.get_close_matches(leaf, [k.split(".")[-1] for k in keys], n=1, cutoff=0.6)
                close = [k for k in keys if k.split(".")[-1] == close[0]][:1] if close else []
            hint = f"did you mean {close[0]!r}?" if close else "see `trainfit keys` for the valid keys."
            lines.append(f"Unknown config key {loc!r}; {hint}")
        elif err["type"] == "value_error":
            lines.append(str(err["msg"]).removeprefix("Value error, "))
        else:
            value = _lookup(raw, err["loc"])
            doc = field_doc(schema, loc)
            allowed = _expected(err) if err["type"] != "union" else f"expected {err['msg']}"
            lines.append(f"Invalid value for {loc!r}: {value!r} ({allowed})."
                         + (f" {loc} is: {doc}" if doc else ""))
    return " ".join(lines)


def _expected(err: dict) -> str:
    return f"expected {err['ctx']['expected']}" if err.get("ctx", {}).get("expected") else err["msg"]


def _member_name(err: dict) -> str:
    """What one member of a Union-typed field accepts, in a few words."""
    if err.get("ctx", {}).get("expected"):
        return err["ctx"]["expected"]
    return "an integer" if err["type"].startswith("int_") else "a number" if err["type"].startswith("float_") else err["msg"]


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
