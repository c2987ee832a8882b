"""The `trainfit` console command. The CLI's modules load under a Ctrl-C guard: an interrupt while they
import (typer, rich, the config schema: the command's first second) exits 130 as a shell does, with one
line instead of a traceback; once loaded, each command answers SIGINT itself (train checkpoints first)."""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from trainfit.app.cli import app   # here, not at the top: the guard must cover its loading
    except KeyboardInterrupt:
        print("trainfit: interrupted (SIGINT) while starting; nothing was done", file=sys.stderr)
        raise SystemExit(130) from None
    app()
