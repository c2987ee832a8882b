"""python -m docs.gen OUT: write every generated fragment into OUT (make docs: .docs-gen/)."""

from __future__ import annotations

import sys
from pathlib import Path

from docs.gen.cli_ref import cli_reference
from docs.gen.config_ref import config_reference
from docs.gen.peers import PEERS, peer_table
from bench.readme_numbers import CONFIGS
from docs.gen.results import measured, measured_tables, reliability, result_files


def fragments() -> dict[str, str]:
    """File name -> markdown, every fragment the pages include."""
    out = {"config-reference.md": config_reference(), "cli-reference.md": cli_reference(),
           "measured-tables.md": measured_tables(), "result-files.md": result_files(),
           "reliability.md": reliability()}
    out.update({f"peer-keys-{p}.md": peer_table(p) for p in PEERS})
    out.update({f"measured-{c}.md": measured(c) for c in CONFIGS})
    return out


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.md"):   # nothing stale survives a build
        old.unlink()
    for name, text in fragments().items():
        (out / name).write_text(text.rstrip() + "\n")
    print(f"wrote {len(fragments())} generated fragments to {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else ".docs-gen"))
