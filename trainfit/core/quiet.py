"""Third-party warnings and log messages, kept out of trainfit's output in one place.

transformers, peft, torch and bitsandbytes warn about things a trainfit user cannot act on
(`use_cache=True is incompatible with gradient checkpointing`, deprecations of arguments trainfit
passes). While a CLI command runs they are recorded instead of printed: `trainfit train` writes them
to <run_dir>/warnings.log and prints one line with their count; other commands drop them.
`TRAINFIT_LIBRARY_WARNINGS=show` leaves every library to print as it would.

transformers installs its own stderr handler when `transformers.utils.logging` is first imported;
that import is slow (~1 s), so rather than importing it here a one-shot import hook swaps the handler
for ours right after transformers imports it (or at once, if it is already imported).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import os
import sys
import warnings
from collections import Counter
from pathlib import Path
from typing import Any, Optional

ENV = "TRAINFIT_LIBRARY_WARNINGS"
# Loggers of libraries that log through the standard `logging` module (transformers is handled apart).
LOGGERS = ("peft", "torch", "bitsandbytes", "accelerate", "datasets", "huggingface_hub", "safetensors")
TRANSFORMERS_LOGGING = "transformers.utils.logging"
# DeepSpeed gives its logger its own stderr handler when imported (transformers' save_pretrained imports it
# through accelerate whenever it is installed): a filter, which its setup keeps, records and drops instead.
FILTERED_LOGGERS = ("DeepSpeed",)
_TRAINFIT_DIR = str(Path(__file__).resolve().parent)


class _Recorder(logging.Handler):
    def __init__(self, sink: Counter):
        super().__init__(logging.WARNING)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.sink[f"{record.name}: {record.getMessage()}"] += 1
        except Exception:  # a malformed library message must not break training
            pass


class _Drop(logging.Filter):
    """Records a logger's warnings through `handler` and drops every record (its own handlers print nothing)."""

    def __init__(self, handler: logging.Handler):
        super().__init__()
        self.handler = handler

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            self.handler.emit(record)
        return False


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls `hook(module)` right after the module `name` is executed, once."""

    def __init__(self, name: str, hook):
        self.name, self.hook = name, hook

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if fullname != self.name:
            return None
        self.remove()
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run, hook = spec.loader.exec_module, self.hook

        def exec_then_hook(module):
            run(module)
            hook(module)
        spec.loader.exec_module = exec_then_hook
        return spec

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


class LibraryWarnings:
    """Records third-party warnings while installed; `messages` holds each distinct one with its count."""

    def __init__(self) -> None:
        self.messages: Counter = Counter()
        self._handler = _Recorder(self.messages)
        self._drop = _Drop(self._handler)
        self._saved_show = None
        self._saved_loggers: dict[str, bool] = {}
        self._finder: Optional[_AfterImport] = None
        self._tf_logging = None
        self.installed = False

    def install(self) -> "LibraryWarnings":
        if self.installed or os.environ.get(ENV, "").lower() == "show":
            return self
        self._saved_show = warnings.showwarning
        warnings.showwarning = self._showwarning
        for name in LOGGERS:
            lg = logging.getLogger(name)
            self._saved_loggers[name] = lg.propagate
            lg.addHandler(self._handler)
            lg.propagate = False
        for name in FILTERED_LOGGERS:
            logging.getLogger(name).addFilter(self._drop)
        if TRANSFORMERS_LOGGING in sys.modules:
            self._take_transformers(sys.modules[TRANSFORMERS_LOGGING])
        else:
            self._finder = _AfterImport(TRANSFORMERS_LOGGING, self._take_transformers)
            sys.meta_path.insert(0, self._finder)
        self.installed = True
        return self

    def uninstall(self) -> None:
        if not self.installed:
            return
        if warnings.showwarning == self._showwarning:
            warnings.showwarning = self._saved_show
        for name, propagate in self._saved_loggers.items():
            lg = logging.getLogger(name)
            lg.removeHandler(self._handler)
            lg.propagate = propagate
        for name in FILTERED_LOGGERS:
            logging.getLogger(name).removeFilter(self._drop)
        if self._finder is not None:
            self._finder.remove()
        if self._tf_logging is not None:
            self._tf_logging.remove_handler(self._handler)
            self._tf_logging.enable_default_handler()
        self.installed = False

    def _take_transformers(self, tf_logging) -> None:
        # Its stderr handler out, ours in; the level stays whatever transformers or trainfit set.
        tf_logging.disable_default_handler()
        tf_logging.add_handler(self._handler)
        self._tf_logging = tf_logging

    def _showwarning(self, message, category, filename, lineno, file=None, line=None) -> None:
        if str(filename).startswith(_TRAINFIT_DIR):  # trainfit's own warnings are meant for the user
            self._saved_show(message, category, filename, lineno, file, line)
            return
        self.messages[f"{category.__name__} ({Path(str(filename)).name}:{lineno}): {message}"] += 1

    def write_log(self, path: Path) -> Optional[str]:
        """Write the recorded messages to `path`; a one-line note naming it, or None when there were none."""
        if not self.messages:
            return None
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(f"{msg}" + (f"  (x{n})" if n > 1 else "") + "\n"
                                for msg, n in self.messages.items()))
        n = len(self.messages)
        return f"{n} library warning{'s' if n != 1 else ''} (transformers, torch, ...), see {path}"


_current = LibraryWarnings()


def current() -> LibraryWarnings:
    """The recorder the CLI installed (installed or not)."""
    return _current


def install() -> LibraryWarnings:
    return _current.install()


def adopt(name: str) -> None:
    """For a library that gives its logger its own stderr handler when first imported (datasets does, after
    install has set that logger up): while the recorder is installed, that handler goes, so the library's
    warnings are recorded like the others' instead of printed."""
    if _current.installed and os.environ.get(ENV, "").lower() != "show":
        lg = logging.getLogger(name)
        for h in [h for h in lg.handlers if type(h) is logging.StreamHandler]:
            lg.removeHandler(h)
