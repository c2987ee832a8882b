"""What `trainfit import` says and writes: the mapping key by key, and the config file with where it came from."""

from __future__ import annotations

from typing import Any

import yaml

from trainfit.config.importers.common import Imported
from trainfit.config.peer_keys import PEER_KEYS


def show(v: Any) -> str:
    if isinstance(v, (list, dict)):
        return yaml.safe_dump(v, default_flow_style=True, width=10 ** 6).strip()
    return str(v)


def lines(im: Imported) -> list[str]:
    """The mapping as printed: what was mapped (peer key = value -> trainfit key = value), computed (with its
    formula), dropped (with why), and the peer defaults the arithmetic read."""
    out = [f"{im.peer} config {im.source} -> trainfit stage {im.stage} ({im.stage_from})", "mapped:"]
    out += [f"  {m.peer_key} = {show(m.peer_value)} -> {m.key} = {show(m.value)}" + (f" ({m.note})" if m.note else "")
            for m in im.mapped] or ["  (none)"]
    out += ["computed:"] + ([f"  {c.key} = {show(c.value)}: {c.formula}" for c in im.computed] or ["  (none)"])
    out += ["dropped:"] + ([f"  {d.peer_key} = {show(d.peer_value)}: {d.why}" for d in im.dropped] or ["  (none)"])
    if im.defaults:
        out.append(f"{im.peer}'s defaults read: " + ", ".join(f"{k}={show(v)}" for k, v in im.defaults.items()))
    return out


def config_text(im: Imported, command: str) -> str:
    """The written config: a header naming the import and the peer file's own source link, then the YAML."""
    head = [f"# Imported from {im.peer} by `{command}`;", "# each key's origin is in that command's output "
            "(docs/import.md)."]
    if im.source_link:
        head.append(f"# The {im.peer} config: {im.source_link}")
    return "\n".join(head) + "\n" + yaml.safe_dump(im.config(), sort_keys=False, width=120)


def key_table(peer: str) -> str:
    """The markdown table of one tool's keys in the shared table (docs/import.md holds it as generated)."""
    out = [f"| {peer} key | trainfit key | how the value carries |", "|---|---|---|"]
    for r in PEER_KEYS:
        if r.peer == peer:
            how = {"": "as it is", "-": "computed by the importer, or dropped with why"}.get(r.carried, f"`{r.carried}`")
            words = "; ".join(filter(None, (r.convert, r.note))).replace("|", "\\|")
            out.append(f"| `{r.key}` | `{r.trainfit}` | {how}{': ' + words if words else ''} |")
    return "\n".join(out)


def fixture_cells(fixture: str, link: str, stage: str, batch: str) -> str:
    """The start of a round-trip row in docs/import.md (bench/import_roundtrip.py writes the rest): what
    tests/test_import.py recomputes from a fresh import, so the docs cannot drift from the importer."""
    return f"| [{fixture}]({link}) | {stage} | {batch} |"
