"""The configuration reference: every key of the pydantic schema (trainfit/config/), its type, default and
description. The field's description is the one source: nothing here is written by hand."""

from __future__ import annotations

import json
import typing
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from docs.gen.tables import table
from trainfit.config.schema import Config


def _type(ann: Any) -> str:
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin is typing.Union or str(origin) == "types.UnionType":
        return " or ".join("null" if a is type(None) else _type(a) for a in args)
    if origin in (list, tuple, dict):
        return f"{origin.__name__}[{', '.join(_type(a) for a in args)}]" if args else origin.__name__
    return getattr(ann, "__name__", str(ann).replace("typing.", ""))


def _default(field: Any) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    return f"`{json.dumps(value)}`"


def _leaves(model: type[BaseModel], prefix: str) -> list[tuple[str, Any]]:
    """(dotted key, field) for every leaf under model, in the schema's order (as `valid_keys` walks it)."""
    out: list[tuple[str, Any]] = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += _leaves(ann, f"{prefix}{name}.")
        else:
            out.append((prefix + name, field))
    return out


def _rows(leaves: list[tuple[str, Any]]) -> str:
    return table(["key", "type", "default", "description"],
                 ([f"`{k}`", _type(f.annotation), _default(f), f.description or ""] for k, f in leaves))


def config_reference() -> str:
    """One section for the top-level keys, then one per config section, in the schema's order."""
    top = [(k, f) for k, f in _leaves(Config, "") if "." not in k]
    parts = ["## Top-level keys", "", _rows(top), ""]
    for name, field in Config.model_fields.items():
        ann = field.annotation
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            continue
        doc = (ann.__doc__ or "").strip()
        parts += [f"## {name}", ""]
        if doc and not doc.startswith(("Usage docs", "A base class")):
            parts += [" ".join(doc.split()), ""]
        parts += [_rows(_leaves(ann, f"{name}.")), ""]
    return "\n".join(parts)
