"""The asynchronous rollout worker in a child process (rollout.mode=async, rollout.worker=process).

Why. On the CPU the thread worker and the trainer take turns on the GIL: the tiny models trainfit trains
there run many small, Python-bound operations (BENCHMARKS.md, "Asynchronous GRPO on CPU"). A child process
has an interpreter of its own, so the two run in parallel, each on its share of train.cpu_threads.

What is shared with the thread worker. All the bookkeeping is RolloutWorker's (train/async_rollout.py) and
stays in the trainer's process: the versions (rollout r sampled by version max(v0, r - k)), the bounded
queue, the snapshots of weights pushed while the worker samples, `ahead` for checkpoints and the push/take
order. Its loop thread runs here too; only the sampling side moves:
the loop asks the child to load a version or to sample a rollout and waits for the answer (waiting on the
pipe releases the GIL). The child samples with `sample_rollout`, i.e. the stage's own `_rollout`, on a stage
it builds from the config (the same class: tokenizer, task, reward functions, environment factory, engine),
so it samples what the thread worker samples, bit for bit.

Weights. At start the trainer moves its frozen tensors (the base under LoRA, buffers, a full fine-tune's
reference model) into shared memory, in place, and the child uses them instead of the ones it loaded: one
copy in RAM, as with the thread. The trainable tensors go through a push buffer in shared memory (one more
copy of them): the trainer writes a version into it, the child copies it into its own copy and checks tensor
for tensor that it took them. With rollout.sync_check the child also completes the probe batch and the
trainer scores it with its own weights (rollout/sync_check.py): the proof covers the whole path, trainer to
engine. A push and a sample never overlap: the bookkeeping asks the child only while it is idle (`_busy`).

Errors and ends. An exception in the child comes back as itself (its traceback as its cause) and is raised
in the trainer at its next take, as the thread's would be, so a ConfigError still exits 2 with its
paragraph; a child that dies without one is a RuntimeError naming its exit code. `close` stops the child:
at the stage's end it exits on its own; when the stage ends early the rollout it is sampling is not waited
for (it is terminated); a child whose trainer died exits at its next message (the pipe is closed).

Not here: CUDA. A child would need the trainer's CUDA tensors over CUDA IPC, which is not built yet; the
config rules and `check_rollout_device` refuse the process worker off the CPU.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import traceback
from typing import Optional

import torch
import torch.multiprocessing as mp

from trainfit.core import quiet
from trainfit.core.dist import SINGLE
from trainfit.core.threads import set_threads, worker_threads
from trainfit.models.policy import count_parameters
from trainfit.rollout.sync_check import compare_probe, probe_engine
from trainfit.train.async_rollout import (RolloutWorker, load_checked, load_version, own_engine_weights,
                                          sample_rollout, trainable_named)
from trainfit.train.stage import StepBatch

PR_SET_PDEATHSIG = 1   # prctl(2): the signal this process gets when its parent dies


def start_worker(stage, start: int, last: int, queued: Optional[dict[int, StepBatch]] = None) -> RolloutWorker:
    """The async rollout worker rollout.worker asks for: a thread, or a child process."""
    kind = ProcessRolloutWorker if stage.cfg.rollout.worker == "process" else RolloutWorker
    return kind(stage, start=start, last=last, queued=queued)


class RemoteTraceback(Exception):
    """The child's traceback, attached as the cause of the exception it raised."""

    def __str__(self) -> str:
        return self.args[0]


class ProcessRolloutWorker(RolloutWorker):
    """RolloutWorker whose copy, engine and sampling live in a child process (see the module docstring)."""

    def _start_sampler(self, stage, start: int) -> None:
        self._proc = None   # set once started: close() may run after a failed start
        model = stage.model
        frozen = _share(model)
        ref = _share(stage.ref_model) if stage.ref_model is not None else None
        self._buffer = {n: p.detach().clone().share_memory_() for n, p in trainable_named(model)}   # version `start`
        threads = worker_threads(stage.cfg.train.cpu_threads, params=count_parameters(model)[0])
        ctx = mp.get_context("spawn")   # a fresh interpreter: no forked locks or threads of the trainer
        self._conn, child = ctx.Pipe()
        # daemon: ended with the trainer's interpreter even if close() never ran (a daemon may start
        # subprocesses, not multiprocessing children; nothing the stage builds does)
        self._proc = ctx.Process(target=_child_main, name="trainfit-rollout", daemon=True,
                                 args=(child, type(stage), stage.cfg, stage.stage_dir, frozen, ref, self._buffer,
                                       start, threads, quiet.current().installed, os.getpid()))
        self._proc.start()
        child.close()   # the child's end: only the child holds it now, so its exit closes the pipe
        try:
            self._call()    # built (its errors, e.g. a ConfigError, raised here) and holding version `start`
            if stage.cfg.rollout.engine != "hf":   # an engine with its own weights (openai): proven, as each push
                self._probe(model, start)
        except BaseException:
            self._stop_sampler()
            raise

    def _call(self, *msg):
        """Send `msg` to the child (none: only wait) and return its answer; raise what it raised."""
        try:
            if msg:
                self._conn.send(msg)
            kind, out = self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(5)
            raise RuntimeError(f"the rollout worker process (rollout.worker=process, pid {self._proc.pid}) ended "
                               f"without an answer (exit code {self._proc.exitcode}).") from None
        if kind == "err":
            err, tb = out
            raise err from RemoteTraceback(tb)
        return out

    def _load(self, tensors: dict, version: int, check: bool) -> None:
        self._copy_version = version
        with torch.no_grad():
            for n, p in tensors.items():
                self._buffer[n].copy_(p)
        self._call("load", version)   # always checked: the tensors crossed into another process

    def _probe(self, model, version: int) -> None:
        r = self.stage.cfg.rollout
        if r.sync_check == "never":
            return
        samples, eng = self._call("probe", r.sync_probe_prompts)
        rep = compare_probe(r.engine, samples, eng, model, self.stage.tokenizer, self.stage.device,
                            tolerance=r.sync_tolerance,
                            what=f" (async worker process, policy version {version})")
        self.sync_metrics = {"sync_logp_diff": rep.mean_abs_diff, "sync_logp_diff_max": rep.max_abs_diff}

    def _sample(self, rnd: int, version: int) -> StepBatch:
        return _unpack(*self._call("sample", rnd, version, self.sync_metrics))

    def _interrupt(self) -> None:
        if self._proc is not None:
            self._proc.kill()   # SIGKILL: the child ignores SIGTERM (_child_main)

    def _stop_sampler(self) -> None:
        if self._proc is None:
            return
        try:
            self._conn.send(None)
            if self._conn.poll(30):   # the library warnings it recorded, kept with the trainer's (warnings.log)
                quiet.current().messages.update(self._conn.recv()[1])
        except (OSError, ValueError, EOFError):   # already gone (terminated, or it died)
            pass
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()


def _share(model) -> dict[str, torch.Tensor]:
    """`model`'s frozen tensors by name for the child: its parameters without grad moved to shared memory in
    place (nobody writes them, so trainer and child read one copy), its buffers copied there (small, and a
    module may update its own, as the thread worker's copy has its own)."""
    out = {n: p.detach().share_memory_() for n, p in model.named_parameters() if not p.requires_grad}
    out.update({n: b.detach().clone().share_memory_() for n, b in model.named_buffers()})
    return out


def _take_shared(model, tensors: dict[str, torch.Tensor]) -> None:
    """Point `model`'s frozen tensors at the trainer's shared ones (its own, just loaded, are freed)."""
    own = dict([*model.named_parameters(), *model.named_buffers()])
    for n, t in tensors.items():
        mine = own[n]
        if mine.shape != t.shape or mine.dtype != t.dtype:
            raise RuntimeError(f"the rollout worker process built {n} as {tuple(mine.shape)} {mine.dtype}, the "
                               f"trainer holds {tuple(t.shape)} {t.dtype}.")
        mine.data = t


def _pack(batch: StepBatch) -> tuple[StepBatch, dict]:
    """A rollout for the pipe: the samples' tensors (log-probs) as one flat tensor per key, so a rollout
    crosses as a few shared-memory segments, not one per sample."""
    samples = [dict(s) for s in batch.samples]
    flat = {}
    for key in sorted({k for s in samples for k, v in s.items() if isinstance(v, torch.Tensor)}):
        idx = [i for i, s in enumerate(samples) if isinstance(s.get(key), torch.Tensor)]
        parts = [samples[i].pop(key) for i in idx]
        flat[key] = (idx, [tuple(t.shape) for t in parts], torch.cat([t.reshape(-1) for t in parts]))
    return StepBatch(samples=samples, totals=batch.totals, metrics=batch.metrics), flat


def _unpack(batch: StepBatch, flat: dict) -> StepBatch:
    for key, (idx, shapes, values) in flat.items():
        parts = values.split([int(torch.Size(s).numel()) for s in shapes])
        for i, shape, t in zip(idx, shapes, parts):
            batch.samples[i][key] = t.view(shape)
    return batch


def _child_main(conn, stage_cls, cfg, stage_dir, frozen: dict, ref: Optional[dict], buffer: dict, start: int,
                threads: int, quiet_libraries: bool, trainer_pid: Optional[int] = None) -> None:
    """The child: build the stage, take the trainer's weights, then answer load / probe / sample until told
    to stop (None: it answers with the library warnings it recorded) or the trainer is gone."""
    _die_with_trainer(trainer_pid)
    if quiet_libraries:   # as the trainer's CLI process: library warnings recorded, not printed
        quiet.install()
    # A terminal's Ctrl-C reaches the whole process group: the trainer finishes its step with this worker's
    # rollout, then ends it (close, or the trainer's pipe closing), so the worker itself ignores the signals.
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)

    def reply(fn) -> bool:
        """Run `fn` and send its result or its exception; False when the trainer is gone."""
        try:
            answer = ("ok", fn())
        except BaseException as e:   # handed to the trainer, which raises it
            answer = ("err", _portable(e))
        try:
            conn.send(answer)
            return answer[0] == "ok"
        except OSError:
            return False

    parts: dict = {}

    def build() -> None:
        set_threads(threads)
        _, stage = stage_cls.build(cfg, stage_dir, SINGLE, torch.device("cpu"))
        parts["stage"] = stage
        stage.episodes_as_ready = True   # multi-turn: an episode goes on as soon as its environment answers
        _take_shared(stage.model, frozen)
        if ref is not None:
            _take_shared(stage.ref_model, ref)
        parts["mine"] = dict(trainable_named(stage.model))
        load_checked(parts["mine"], buffer, start, check=True)
        own_engine_weights(stage.engine, stage.model)

    ok = reply(build)
    stage, mine = parts.get("stage"), parts.get("mine")

    def load(version: int) -> None:   # then pushed on to an engine holding its own weights (openai)
        load_version(stage.engine, stage.model, mine, buffer, version, check=True)

    def sample(rnd: int, version: int, sync_metrics: dict):
        stage.sync_metrics = sync_metrics   # the latest probe's, in the rollout's metrics as the thread's
        return _pack(sample_rollout(stage, rnd, version))

    ops = {"load": load,
           "probe": lambda n: probe_engine(stage.engine, stage.tokenizer, n),
           "sample": sample}
    try:
        while ok:
            try:
                msg = conn.recv()
            except (EOFError, OSError):   # the trainer is gone
                return
            if msg is None:
                reply(lambda: dict(quiet.current().messages))
                return
            ok = reply(lambda: ops[msg[0]](*msg[1:]))
    finally:
        if stage is not None:
            stage.engine.close()


def _die_with_trainer(trainer_pid: Optional[int]) -> None:
    """Linux: the kernel ends this child when the trainer's process dies (kill -9, the out-of-memory killer);
    one that died while this child was starting is already gone: the child ends now. Without it the child
    noticed only at its next message, after finishing the rollout or build in hand: seconds to minutes of
    CPU, RAM or GPU memory held by an orphan, beside the run that resumes."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):   # not Linux: the pipe's end-of-file still ends the child
        return
    if trainer_pid is not None and os.getppid() != trainer_pid:
        os._exit(1)


def _portable(e: BaseException) -> tuple[BaseException, str]:
    """(the exception, its traceback text); the exception as a RuntimeError naming it when it does not pickle."""
    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
    try:
        pickle.loads(pickle.dumps(e))
        return e, tb
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}"), tb
