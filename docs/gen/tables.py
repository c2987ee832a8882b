"""Markdown table cells and tables, shared by the generated pages."""

from __future__ import annotations

from typing import Any, Iterable


def cell(value: Any) -> str:
    """One table cell: on one line, pipes escaped."""
    text = " ".join(str(value).split()).replace("|", "\\|")
    # outside code spans `<key>` would be read as an HTML tag and vanish
    parts = text.split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;").replace(">", "&gt;") for i, p in enumerate(parts))


def table(headers: list[str], rows: Iterable[Iterable[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
