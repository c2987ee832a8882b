"""The `trainfit` console command. The CLI's modules load under a Ctrl-C guard: an interrupt while they
import (typer, rich, the config schema: the command's first second) or while typer builds the command
from them exits 130 as a shell does, with one line instead of a traceback; once a command runs, it
answers SIGINT itself (train checkpoints first; the others end as click ends them)."""

from __future__ import annotations

import sys
from typing import Optional, Sequence

STARTING = "trainfit: interrupted (SIGINT) while starting; nothing was done"


def main(argv: Optional[Sequence[str]] = None) -> None:
    try:
        from trainfit.app.cli import app   # here, not at the top: the guard must cover its loading
        # typer builds the click command from the app before click's own Ctrl-C handling starts, so an
        # interrupt that reaches here came before any command ran.
        app(list(argv) if argv is not None else None, prog_name="trainfit")
    except KeyboardInterrupt:
        print(STARTING, file=sys.stderr)
        raise SystemExit(130) from None
