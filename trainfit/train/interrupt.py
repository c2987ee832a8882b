"""Stopping a run on SIGINT (Ctrl-C) or SIGTERM (`kill`, a scheduler's preemption) without losing its steps.

The first signal only asks: the step in progress finishes, the loop writes a checkpoint of the step
reached with the usual writer (train/checkpoint.py: atomic), and the run ends with `Interrupted`, which
the command line turns into the resume command and exit 130 (SIGINT) or 143 (SIGTERM), 128 + the
signal, as a shell reports a process the signal ended. A second SIGINT, or a second SIGTERM, aborts
at once (Aborted, a KeyboardInterrupt): the step in progress is lost, the latest checkpoint stays whole.

Under torchrun the signal may reach the ranks at different moments, so no rank decides alone: at each
step's end every rank adds its flag to one all-reduce and all stop after the same step. A terminal's
Ctrl-C reaches the ranks twice there, from the terminal and forwarded by torchrun's agent (which may
also send SIGTERM): a rank of several takes a repeat within REPEAT_S of the first signal, and a SIGTERM
after a SIGINT, as the same request.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from pathlib import Path
from typing import Optional

from trainfit.core.dist import Ranks, SINGLE, all_reduce_sum

SIGNALS = (signal.SIGINT, signal.SIGTERM)
REPEAT_S = 2.0   # under a launcher, a repeat sooner than this is the launcher forwarding the first signal


class Interrupted(Exception):
    """The run stopped on a signal between two steps. `checkpoint`: where it continues from (None when no
    step of the stage ran and none was written before); `step`: the stage's step reached."""

    def __init__(self, signum: int, step: int, checkpoint: Optional[Path], stage: str):
        self.signum, self.step, self.checkpoint, self.stage = signum, step, checkpoint, stage
        super().__init__(f"{signal.Signals(signum).name} at step {step} of stage {stage}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def describe(self, command: str) -> str:
        """The paragraph the command line prints: what was kept and the exact command that continues."""
        name = signal.Signals(self.signum).name
        kept = (f"stage {self.stage} stopped after step {self.step}, checkpointed in {self.checkpoint}"
                if self.checkpoint is not None else f"stage {self.stage} stopped before its first step; nothing "
                "of it was trained, and finished stages are kept")
        return f"{name}: {kept}. Continue with: {command}"


class Aborted(KeyboardInterrupt):
    """A second signal: the run stops where it is; `exit_code` as Interrupted's."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopSignals:
    """While entered (in the main thread), SIGINT and SIGTERM ask the run to stop at the next step's end; rank 0
    says so on stderr. Nothing is installed off the main thread, where Python cannot take signals."""

    def __init__(self, ranks: Ranks = SINGLE):
        self.ranks = ranks
        self.signum: Optional[int] = None
        self._since = 0.0   # when the first signal came
        self._previous: dict = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}

    def _handle(self, signum: int, frame) -> None:
        if self.signum is None:
            self.signum, self._since = signum, time.monotonic()
            if self.ranks.main:   # plain stderr: a signal handler must not re-enter rich's console
                again = "press Ctrl-C again" if signum == signal.SIGINT else "send SIGTERM again"
                sys.stderr.write(f"\n{signal.Signals(signum).name}: finishing the step in progress, then writing a "
                                 f"checkpoint ({again} to stop at once and lose that step)\n")
                sys.stderr.flush()
        elif ((signum == self.signum or signum == signal.SIGINT)
              and not (self.ranks.distributed and time.monotonic() - self._since < REPEAT_S)):
            raise Aborted(signum)   # the second request: stop where the run is

    def requested(self) -> Optional[int]:
        """The signal that asked to stop, the same on every rank (a collective under several ranks), else None."""
        if not self.ranks.distributed:
            return self.signum
        got = all_reduce_sum({s.name: float(self.signum == s) for s in SIGNALS}, self.ranks)
        return next((int(s) for s in SIGNALS if got[s.name] > 0), None)   # SIGINT first: all ranks name one
