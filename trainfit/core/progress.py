"""What a long command is doing, for whoever shows it.

    progress.step("planning stage 0 (grpo) on H200 141GB")   # the library says where it is
    progress.notice("the hub could not be reached ...")       # a fact said once per process

    with progress.listening(on_step, on_notice):              # the CLI shows them (app/working.py)
        ...

Without a listener both do nothing, so the library stays quiet when used from Python. A notice is
handed to a listener once per process, however often it is said (the hub is asked about several models).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

_on_step: Optional[Callable[[str], None]] = None
_on_notice: Optional[Callable[[str], None]] = None
_said: set[str] = set()


def step(text: str) -> None:
    if _on_step is not None:
        _on_step(text)


def notice(text: str) -> None:
    if _on_notice is None or text in _said:
        return
    _said.add(text)
    _on_notice(text)


@contextlib.contextmanager
def listening(on_step: Callable[[str], None], on_notice: Callable[[str], None]) -> Iterator[None]:
    global _on_step, _on_notice
    before = _on_step, _on_notice
    _on_step, _on_notice = on_step, on_notice
    try:
        yield
    finally:
        _on_step, _on_notice = before
