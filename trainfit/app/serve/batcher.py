"""Request batching for `trainfit serve`: many HTTP requests, few generate calls.

Requests land in a queue. One worker thread takes the first, keeps gathering until `max_batch`
sequences are waiting or `wait_ms` has passed since the first arrived, groups what it has by sampling
key (adapter, temperature, top-p, top-k, stop, max tokens) and runs one generate call per group. Each
sequence carries its own seed, and sampling is per-row seeded (see `SeededGumbel`), so a request's
completion does not depend on which other requests shared its batch.

The queue is bounded: at most `max_queue` sequences wait for or are in generation. A request that would
pass it is refused at once with `Overloaded`, whose `retry_after_s` is how long the sequences ahead take
at the recent rate (the app answers 503 with Retry-After). `depth` is the sequences waiting or generating
now, `max_depth` the most there ever were, `refused` the requests turned away.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Hashable, Optional

from trainfit.app.serve.limits import retry_after
from trainfit.rollout.base import Completion

RunFn = Callable[[Hashable, list[list[int]], list[int]], list[Completion]]


@dataclass
class Job:
    key: Hashable
    prompts: list[list[int]]        # one entry per sequence to generate (a prompt repeated n times for n > 1)
    seeds: list[int]                # one per sequence
    future: Future                  # resolves to list[Completion], aligned with `prompts`


class Overloaded(Exception):
    """The queue is full: retry after `retry_after_s` seconds (whole, at least 1)."""

    def __init__(self, depth: int, max_queue: int, retry_after_s: int):
        super().__init__(f"the server is busy: {depth} sequences are queued or generating, its limit is {max_queue} "
                         f"(--max-queue); retry after {retry_after_s} s.")
        self.retry_after_s = retry_after_s


class Batcher:
    def __init__(self, run: RunFn, max_batch: int = 32, wait_ms: float = 10.0, max_queue: int = 1 << 30):
        if max_batch < 1 or wait_ms < 0 or max_queue < 1:
            raise ValueError("max_batch and max_queue must be >= 1 and wait_ms >= 0")
        self.run, self.max_batch, self.wait_s, self.max_queue = run, max_batch, wait_ms / 1000.0, max_queue
        self.queue: "queue.Queue[Optional[Job]]" = queue.Queue()
        self.batches = 0        # gathered batches (worker wake-ups that found work)
        self.calls = 0          # generate calls (one per sampling key in a batch)
        self.sequences = 0      # sequences generated
        self.depth = self.max_depth = self.refused = 0
        self.rate = 0.0         # sequences a second over the recent generate calls (0 = none yet)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="trainfit-serve-batcher", daemon=True)
        self._thread.start()

    def admit(self, n: int) -> None:
        """Count `n` more sequences in, or raise Overloaded when they do not fit (call `done(n)` after)."""
        with self._lock:
            if self.depth + n > self.max_queue:
                self.refused += 1
                wait = self.depth / self.rate if self.rate > 0 else 1.0
                raise Overloaded(self.depth, self.max_queue, retry_after(wait))
            self.depth += n
            self.max_depth = max(self.max_depth, self.depth)

    def done(self, n: int) -> None:
        with self._lock:
            self.depth -= n

    def submit(self, key: Hashable, prompts: list[list[int]], seeds: list[int]) -> Future:
        """A future of the completions; Overloaded at once when the queue is full."""
        assert len(prompts) == len(seeds)
        self.admit(len(prompts))
        fut: Future = Future()
        fut.add_done_callback(lambda _: self.done(len(prompts)))   # generated, failed or cancelled
        self.queue.put(Job(key, prompts, seeds, fut))
        return fut

    def close(self, timeout: float = 5.0) -> None:
        self.queue.put(None)
        self._thread.join(timeout)

    def _gather(self) -> tuple[list[Job], bool]:
        """(jobs of one batch, whether to stop after it)."""
        first = self.queue.get()
        if first is None:
            return [], True
        jobs, n = [first], len(first.prompts)
        deadline = time.monotonic() + self.wait_s
        while n < self.max_batch:
            left = deadline - time.monotonic()
            try:  # past the deadline, still take what is already queued
                job = self.queue.get(timeout=left) if left > 0 else self.queue.get_nowait()
            except queue.Empty:
                break
            if job is None:
                return jobs, True
            jobs.append(job)
            n += len(job.prompts)
        return jobs, False

    def _loop(self) -> None:
        stop = False
        while not stop:
            jobs, stop = self._gather()
            # A request whose client went away was cancelled: do not generate for it.
            jobs = [j for j in jobs if j.future.set_running_or_notify_cancel()]
            if not jobs:
                continue
            self.batches += 1
            groups: dict[Hashable, list[Job]] = {}
            for j in jobs:
                groups.setdefault(j.key, []).append(j)
            for key, group in groups.items():
                self._run_group(key, group)

    def _run_group(self, key: Hashable, group: list[Job]) -> None:
        prompts = [p for j in group for p in j.prompts]
        seeds = [s for j in group for s in j.seeds]
        self.calls += 1
        self.sequences += len(prompts)
        start = time.monotonic()
        try:
            outs = self.run(key, prompts, seeds)
            rate = len(prompts) / max(time.monotonic() - start, 1e-6)
            self.rate = rate if self.rate == 0 else 0.8 * self.rate + 0.2 * rate
        except BaseException as e:  # the requests fail, the worker lives on
            for j in group:
                j.future.set_exception(e)
            return
        i = 0
        for j in group:
            j.future.set_result(outs[i:i + len(j.prompts)])
            i += len(j.prompts)
