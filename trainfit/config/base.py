"""What every config section shares: the error a user mistake raises, the strict section base, and merging."""

from __future__ import annotations

import copy

from pydantic import BaseModel, ConfigDict


class ConfigError(Exception):
    """A user mistake in a config: the CLI prints the message as one paragraph and exits 2."""


class _Section(BaseModel):
    # Unknown keys are errors (typos must not pass silently); defaults are validated too.
    model_config = ConfigDict(extra="forbid", validate_default=True, protected_namespaces=())


def deep_merge(a: dict, b: dict) -> dict:
    out = copy.deepcopy(a)
    for k, v in b.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m
