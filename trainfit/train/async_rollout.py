"""Asynchronous rollouts (rollout.mode=async): a worker samples the next rollouts while the trainer trains.

Worker kinds (rollout.worker). `RolloutWorker` here samples in a thread of the trainer's process; on the
CPU it shares the GIL with the trainer. `ProcessRolloutWorker` (train/async_process.py) samples in a child
process: it keeps this class's bookkeeping (versions, queue, snapshots, `ahead`, the push/take order and
the proximal log-probs, all below) and its loop thread, and replaces only the sampling side (`_start_sampler`,
`_load`, `_probe`, `_sample`, `_interrupt`, `_stop_sampler`); both sample through `sample_rollout`, the
stage's own `_rollout`. Everything below holds for both.

Versions. The policy's version is the number of rollouts the trainer has consumed: version r is the weights
at the start of rollout r's first optimizer step (after r x grpo.num_iterations steps; with one step a
rollout, the optimizer steps taken). Those are the only weights the worker ever needs, so the trainer pushes
them once a rollout, when it takes rollout r. The worker samples rollout r with version max(v0, r - k),
k = rollout.max_staleness and v0 the rollout the stage started at: a trained sample is at most k rollouts
stale, and a whole rollout, so every GRPO group in it, is sampled by one version. With k = 1 that is the
newest version there can be when the worker starts rollout r (version r exists only once the trainer asks
for rollout r); for larger k, pinning the version keeps a run reproducible under a fixed train.seed. When
the weights it needs have not been pushed yet the worker waits (nothing is sampled only to be dropped), so
at most k rollouts wait in its queue. k = 0 is synchronous: the same samples, metrics and weights as
rollout.mode=sync.

Weights. The worker holds its own copy of the policy module (frozen tensors, e.g. the base under LoRA,
are shared, not copied: nobody writes them) and its own hf engine over it. At each push the trainer hands
over its trainable tensors: straight into the copy when the worker is not sampling (then, with
rollout.sync_check, the probe of rollout/sync_check.py proves the copy samples like the trainer), else as
a snapshot the worker copies in before the rollout that needs it (checked tensor for tensor).

Engines. With rollout.engine=hf the worker samples from its copy with an hf engine of its own; with openai
its engine pushes each version the copy takes to the server as adapters of its own names. With vllm
(thread worker, the trainer's device) there is one vLLM instance a process and card, the stage's: the worker
samples with it and pushes each version the copy takes into it, and it stays awake while the trainer trains
(no sleep mode; the planner holds its envelope through the training step). The trainer's evaluations
borrow it between two rollouts (`borrowed_engine`): the trainer's weights are pushed and probed, and the
copy's are pushed back before the worker samples again.

Devices. With distributed.rollout_gpus the worker's device is a GPU of its own (config/devices.py
`rollout_device`, e.g. cuda:1 beside the trainer's cuda:0): the copy is then whole there (frozen tensors
too, since they cannot be shared across devices), so are a full fine-tune's frozen reference model (only
the worker scores with it) and the snapshots, and a push copies the trainable tensors across devices.
Each device runs its own stream, so sampling overlaps training; on one GPU the two would queue.

Log-probs. A stale rollout's samples carry `behav_logp`, the log-probs of the version that sampled them (a
no-grad forward of the worker's copy). The PPO ratio of grpo.num_iterations > 1 is taken against the
proximal policy, the trainer's weights at the rollout's first step (version r): `old_logp`. For a fresh
rollout the worker computes it (its copy then holds version r); for a stale one it is the trainer's own
forward at the rollout's first step, kept by the loss (grpo.py) for the later steps: the weights of that
forward are version r, so no separate pass on the trainer's critical path is needed. The loss reweights
stale tokens by rollout.off_policy with w = exp(old_logp - behav_logp) (algos/offpolicy.py); fresh samples
carry no behav_logp, their weight is 1 exactly.

Resume. A checkpoint keeps the queue: the rollouts sampled ahead of the trainer (r + 1 .. r + k when it
trains rollout r, all sampled by versions it has pushed; the checkpoint waits for the worker to finish
them) and the half-used rollout, as sync keeps its buffer. After `--resume` the trainer trains them
first and the worker samples the rest with the versions an uninterrupted run would have used: the same
policy versions, staleness and samples.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import threading
import time
from typing import Optional

import torch

from trainfit.algos import staleness_stats
from trainfit.config import Config, ConfigError, rollout_device
from trainfit.core.heap import cpu_heap_for_decoding
from trainfit.models.logprobs import store_rows
from trainfit.rollout import build_engine
from trainfit.rollout.base import StaleEngineError
from trainfit.rollout.staleness import queued_rollouts, sampled_version
from trainfit.rollout.sync_check import check_sync
from trainfit.train import memstats
from trainfit.train.stage import StepBatch


def worker_copy(model, device=None) -> torch.nn.Module:
    """A copy of `model` for the worker on `device` (None: the model's own). On the model's device its
    trainable tensors are copied and its frozen ones shared; on another device every parameter and buffer
    is copied straight there (the memo hands deepcopy the moved tensors, so none is duplicated on the
    trainer's device first) and kept trainable or frozen as it was."""
    here = next(model.parameters()).device
    if device is None or torch.device(device) == here:
        memo = {id(p): p for p in model.parameters() if not p.requires_grad}
        return copy.deepcopy(model, memo)
    memo: dict = {}
    for t in itertools.chain(model.parameters(), model.buffers()):
        moved = t.detach().to(device, copy=True)
        memo[id(t)] = torch.nn.Parameter(moved, requires_grad=t.requires_grad) \
            if isinstance(t, torch.nn.Parameter) else moved
    return copy.deepcopy(model, memo).to(device)


def trainable_named(model) -> list[tuple[str, torch.Tensor]]:
    """The tensors a push carries: the trainable parameters by name (adapters under LoRA, all under full)."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def check_rollout_device(cfg: Config, device) -> None:
    """What the config rules cannot see: the device the trainer got and the GPUs this machine shows."""
    split, kind = cfg.device_split(), torch.device(device).type
    if split.separate and (kind != "cuda" or torch.cuda.device_count() <= max(split.rollout)):
        raise ConfigError(f"distributed.rollout_gpus={cfg.distributed.rollout_gpus} runs the rollout worker on "
                          f"cuda:{max(split.rollout)}, but this stage trains on {device} and "
                          f"{torch.cuda.device_count()} CUDA device(s) are visible. Run on a machine with "
                          f"distributed.num_gpus={cfg.distributed.num_gpus} GPUs visible, or set "
                          "distributed.rollout_gpus=0 (the worker then samples on the trainer's device).")
    if cfg.rollout.worker == "process" and torch.device(device).type != "cpu":
        raise ConfigError(f"rollout.worker=process runs the rollout worker in a child process on the CPU, but this "
                          f"stage trains on {device} (train.device={cfg.train.device}), and the process worker "
                          "does not take weights on a GPU yet. Set train.device=cpu, or rollout.worker=thread.")


@torch.no_grad()
def _store_logprobs(stage, model, samples: list[dict], key: str) -> None:
    """`model`'s log-probs of `samples`' tokens under `key`, a micro-batch at a time, on `stage`'s device
    (the worker's view of the stage: its behaviour log-probs)."""
    mb = stage.cfg.train.micro_batch_size
    for i in range(0, len(samples), mb):
        chunk = samples[i:i + mb]
        logp, mask, _ = stage._logprobs(model, chunk)
        store_rows(chunk, key, logp, mask)


class RolloutWorker:
    """Samples rollouts start, start+1, ... up to `last` - 1 in a thread, each with the version the bound
    allows (the bookkeeping the process worker shares; the sampling side is the thread's own). The
    trainer's weights are version `start` when it is made; `queued` are rollouts sampled before a resume
    (start, start+1, ...), handed to the trainer first."""

    def __init__(self, stage, start: int, last: int, queued: Optional[dict[int, StepBatch]] = None):
        cfg = stage.cfg
        self.k, self.v0, self.last = cfg.rollout.max_staleness, start, last
        self.device = torch.device(rollout_device(cfg.device_split(), str(stage.device)))
        self.stage = stage
        # rollout.engine=vllm: the worker samples with the stage's own vLLM instance; the trainer borrows it
        # between rollouts for its evaluations (`borrowed_engine`).
        self.shared_engine = cfg.rollout.engine == "vllm"
        self._lent = False
        self.sync_metrics: dict = {}   # the last probe's (the start's, for an engine with its own weights)
        self._start_sampler(stage, start)
        self._copy_version = start                   # the version the copy holds
        self._snapshots: dict[int, dict] = {}        # version -> trainable tensors, pushed while it sampled
        self._ready: dict[int, StepBatch] = dict(queued or {})
        self._busy = False                           # sampling from the copy now
        self._next = max(self._ready, default=start - 1) + 1   # the rollout it samples next
        self._error: Optional[BaseException] = None
        self._stop = False
        self._cv = threading.Condition()
        self.most_snapshots = self.most_queued = 0   # held at once so far (held_snapshots, queued_rollouts bound them)
        self.closed = False
        self._thread = threading.Thread(target=self._run, name="trainfit-rollout", daemon=True)
        self._thread.start()

    def _start_sampler(self, stage, start: int) -> None:
        """The sampling side: the worker's copy of the policy, its engine and its view of the stage."""
        cfg = stage.cfg
        self.model = worker_copy(stage.model, self.device)
        if self.shared_engine:   # vllm: the stage's instance (one a process and card), awake from now on
            self.engine = stage.engine
            self.engine.wake()
            self.engine.sync(self.model)   # version `start`
        else:
            with self._on_device():
                self.engine = build_engine(cfg.rollout, self.model, stage.tokenizer, stop=stage.task.stop_strings(),
                                           workdir=stage.stage_dir, model_cfg=cfg.model)
            self.engine.processor = stage.vision
            own_engine_weights(self.engine, self.model)   # version `start`
        if not self.engine.shares_weights:   # vllm, openai: proven to sample version `start`, as each push after
            self._probe(stage.model, start)
        # The stage as the rollout code sees it: the worker's engine and module, the rest shared.
        self.view = copy.copy(stage)
        self.view.engine, self.view.model, self.view.device = self.engine, self.model, self.device
        self.view.episodes_as_ready = True   # multi-turn: an episode goes on as soon as its environment answers
        if stage.ref_model is not None:   # only the worker scores with it: moved (in place) to its device
            self.view.ref_model = stage.ref_model.to(self.device)
        self._mine = dict(trainable_named(self.model))

    # ---- trainer side --------------------------------------------------------------------------
    def next_batch(self, rnd: int, model) -> StepBatch:
        """Push version `rnd` (the trainer's weights now, at rollout `rnd`'s first step) and take rollout
        `rnd`. With k = 0 the push comes first (rollout `rnd` is sampled by it); else the take, so the
        worker is idle at the push and it goes straight into the copy. Only the take is the trainer's
        wait (time_rollout_wait_s); the push, and its probe, are time_sync_s."""
        if self.k == 0:
            self._timed_push(model, rnd)
        with memstats.phase(None, "rollout_wait"):   # the trainer idle, waiting for samples
            batch = self._take(rnd)
        if self.k > 0:
            self._timed_push(model, rnd)
        return batch

    def _timed_push(self, model, version: int) -> None:
        with memstats.phase(None, "sync"):
            self.push(model, version)

    def push(self, model, version: int) -> None:
        with self._cv:
            if version <= self._copy_version:   # the copy was made from these weights (the first rollout)
                return
            if not self._busy and self._need(self._next) >= version:
                self._load(dict(trainable_named(model)), version, check=False)   # the probe checks it
                self._probe(model, version)
            else:
                self._snapshots[version] = {n: p.detach().to(self.device, copy=True)
                                            for n, p in trainable_named(model)}
                self.most_snapshots = max(self.most_snapshots, len(self._snapshots))
            self._cv.notify_all()

    def ahead(self, first: int, end: int) -> dict[int, StepBatch]:
        """Rollouts first .. end - 1 (those before `last`), waiting for the worker to finish them: what a
        checkpoint keeps. They stay queued for the trainer."""
        want = range(first, min(end, self.last))
        with self._cv:
            self._cv.wait_for(lambda: all(r in self._ready for r in want) or self._error is not None or self._stop)
            if self._error is not None:
                raise self._error
            return {r: self._ready[r] for r in want if r in self._ready}

    def _take(self, rnd: int) -> StepBatch:
        with self._cv:
            self._cv.wait_for(lambda: rnd in self._ready or self._error is not None)
            if self._error is not None:
                raise self._error
            batch = self._ready.pop(rnd)
            self._cv.notify_all()
        return batch

    def close(self) -> None:
        """Stop the thread and close the engine; once (a stage may close at its last step and again at its end)."""
        if self.closed:
            return
        self.closed = True
        with self._cv:
            self._stop = True
            busy = self._busy
            self._cv.notify_all()
        if busy:   # the stage ended early (train.stop_at_accuracy, an error): no step will train this rollout
            self._interrupt()
        self._thread.join()
        self._stop_sampler()

    def _interrupt(self) -> None:
        """Cut the rollout being sampled short, where that can be done (not in a thread: it is waited for)."""

    def _stop_sampler(self) -> None:
        if not self.shared_engine:   # the stage's vLLM instance stays for its last evaluation
            self.engine.close()

    @contextlib.contextmanager
    def borrowed_engine(self):
        """The stage's engine for an evaluation of the trainer's (rollout.engine=vllm, which the worker samples
        with): taken between two rollouts (the worker waits, the trainer waits for its rollout to end), given
        back holding the copy's weights again; yields whether it was lent. Nothing to lend for a worker with
        an engine of its own, or once closed."""
        if not self.shared_engine or self.closed:
            yield False
            return
        with self._cv:
            self._cv.wait_for(lambda: not self._busy or self._error is not None)
            self._lent = True
        try:
            yield True
        finally:
            self.engine.wake()
            self.engine.sync(self.model)   # the version the copy holds, as the worker left it
            with self._cv:
                self._lent = False
                self._cv.notify_all()

    def _on_device(self):
        """The worker's GPU as the current device, for engine work done from the trainer's thread (caches
        and CUDA graphs are made on the current device); a no-op on the CPU."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _probe(self, model, version: int) -> None:
        """rollout.sync_check: the copy's engine against the trainer's weights (both at `version`)."""
        r = self.stage.cfg.rollout
        if r.sync_check == "never":
            return
        with self._on_device():
            rep = check_sync(self.engine, model, self.stage.tokenizer, self.stage.device,
                             n_prompts=r.sync_probe_prompts, tolerance=r.sync_tolerance,
                             what=f" (async worker, policy version {version})")
        self.sync_metrics = {"sync_logp_diff": rep.mean_abs_diff, "sync_logp_diff_max": rep.max_abs_diff}

    # ---- worker side ---------------------------------------------------------------------------
    def _need(self, rnd: int) -> int:
        return sampled_version(rnd, self.k, self.v0)

    def _load(self, tensors: dict, version: int, check: bool) -> None:
        """`tensors` (version `version`) into the copy; with `check`, proven there tensor for tensor."""
        self._copy_version = version
        load_version(self.engine, self.model, self._mine, tensors, version, check)

    def _run(self) -> None:
        try:
            if self.device.type == "cuda":   # a thread starts on cuda:0; the copy's kernels and graphs run here
                torch.cuda.set_device(self.device)
            while True:
                with self._cv:
                    rnd = self._next
                    need = self._need(rnd)
                    self._cv.wait_for(lambda: self._stop or rnd >= self.last or (
                        not self._lent and len(self._ready) < max(queued_rollouts(self.k), 1)   # k = 0: the hand-off
                        and (self._copy_version == need or need in self._snapshots)))
                    if self._stop or rnd >= self.last:
                        return
                    snap = self._snapshots.pop(need, None)
                    for v in [v for v in self._snapshots if v < need]:
                        del self._snapshots[v]
                    self._busy = True
                if snap is not None:
                    self._load(snap, need, check=True)
                tick = time.perf_counter()
                batch = self._sample(rnd, need)
                batch.metrics["time_async_rollout_s"] = time.perf_counter() - tick   # overlapped with training
                with self._cv:
                    self._ready[rnd] = batch
                    self.most_queued = max(self.most_queued, len(self._ready))
                    self._busy = False
                    self._next = rnd + 1
                    self._cv.notify_all()
        except BaseException as e:  # handed to the trainer, which raises it at its next take
            with self._cv:
                self._error = e
                self._busy = False
                self._cv.notify_all()

    def _sample(self, rnd: int, version: int) -> StepBatch:
        self.view.sync_metrics = self.sync_metrics
        return sample_rollout(self.view, rnd, version)


def own_engine_weights(engine, model) -> None:
    """A worker's engine that holds its own copy of the weights (openai: the server's adapters) gets adapter
    names of its own (the trainer's engine, which evaluates, pushes to the same server) and the copy's weights.
    The hf engine samples from the copy itself."""
    if not engine.shares_weights:
        engine.tag = "-async"
        engine.sync(model)


def load_version(engine, model, mine: dict, tensors: dict, version: int, check: bool) -> None:
    """Version `version`'s `tensors` into the worker's copy (`model`, its trainable tensors `mine`), proven
    there with `check`, then on to an engine that holds its own copy of the weights (openai)."""
    load_checked(mine, tensors, version, check)
    if not engine.shares_weights:
        engine.sync(model)


def load_checked(mine: dict, tensors: dict, version: int, check: bool) -> None:
    """Copy `tensors` into the worker's copy `mine` (name -> tensor); with `check`, prove it took them."""
    with torch.no_grad():
        for n, p in tensors.items():
            mine[n].copy_(p)
    bad = [n for n, p in tensors.items() if not torch.equal(mine[n], p)] if check else []
    if bad:
        raise StaleEngineError(f"the async worker's copy did not take policy version {version}: "
                               f"{len(bad)} tensors differ (first {bad[0]}).")


@torch.no_grad()
def sample_rollout(view, rnd: int, version: int) -> StepBatch:
    """Rollout `rnd` with the worker's copy (`view.model`) at `version`: the stage's own rollout code (at the
    optimizer step that will first train it), then the behaviour log-probs when it will be trained stale.
    `view` is the stage as the worker sees it (its copy and engine); the thread and the process worker both
    sample through here."""
    with cpu_heap_for_decoding():   # as the sync rollout decodes (core/heap.py)
        batch = view._rollout(rnd, rnd * view.cfg.grpo.num_iterations)
        if version < rnd:
            # num_iterations > 1: the rollout code's `old_logp` came from this copy, so they are the
            # behaviour log-probs; the proximal ones are the trainer's, at its take (grpo.py).
            if batch.samples and "old_logp" in batch.samples[0]:
                for s in batch.samples:
                    s["behav_logp"] = s.pop("old_logp")
            else:
                _store_logprobs(view, view.model, batch.samples, "behav_logp")
    for s in batch.samples:
        s["version"] = version
    # One version for the whole rollout (counted even when every sample was left out: zero advantages).
    batch.metrics.update(staleness_stats([version], rnd), policy_version=float(version))
    return batch
