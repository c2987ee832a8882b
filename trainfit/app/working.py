"""A status line on stderr while `plan`, `fit` and `hardware` work, shown once they take over a second.

    with working(err_console, "checking the config"):
        ready = preflight(...)          # the library's progress.step(...) updates the line

The line is rich's status spinner: on a terminal it is redrawn in place and cleared when the work ends;
piped or redirected, rich draws nothing, so the command's output stays its own. Notices (the hub could
not be reached) are printed above it at once, one line each (core/progress.py says each once).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator, Optional

from rich.markup import escape

from trainfit.core import progress

SHOW_AFTER_S = 1.0  # quicker commands print their answer without a status line


@contextlib.contextmanager
def working(console, first: str, after_s: Optional[float] = None) -> Iterator[None]:
    after_s = SHOW_AFTER_S if after_s is None else after_s
    status = console.status(escape(first), spinner="dots")
    lock = threading.Lock()
    state = {"text": first, "shown": False, "done": False}

    def show() -> None:
        with lock:
            if not state["done"]:
                status.update(escape(state["text"]))
                status.start()
                state["shown"] = True

    def on_step(text: str) -> None:
        with lock:
            state["text"] = text
            if state["shown"]:
                status.update(escape(text))

    def on_notice(text: str) -> None:
        console.print(f"note: {escape(text)}", highlight=False, soft_wrap=True)

    timer = threading.Timer(after_s, show)
    timer.daemon = True
    if after_s > 0:
        timer.start()
    else:
        show()
    try:
        with progress.listening(on_step, on_notice):
            yield
    finally:
        with lock:
            state["done"] = True
            timer.cancel()
            if state["shown"]:
                status.stop()
