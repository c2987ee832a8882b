"""Counts in words: `1 device`, `2 devices`, `0 combinations`. Every layer prints counts, and this layer
is the one they all may import."""

from __future__ import annotations

from typing import Optional


def count(n: int, noun: str, plural: Optional[str] = None) -> str:
    """`n` with its noun in agreement: the plural is `noun + s` unless given (count(1, "GPU") == "1 GPU")."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
