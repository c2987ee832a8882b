"""Asynchronous rollouts (rollout.mode=async): a worker thread samples the next rollouts while the trainer trains.

Versions. The policy's version is the number of optimizer steps it has taken. GRPO trains rollout r at
step r (one rollout per step), so the trainer is at version r when it trains it. The worker samples
rollout r with version max(v0, r - k) of the weights, k = rollout.max_staleness and v0 the version the
stage started (or resumed) at: every sample is at most k versions stale, and a whole rollout, so every
GRPO group in it, is sampled by one version. With k = 1 that is the newest version there can be when
the worker starts rollout r (version r exists only once the trainer asks for rollout r); for larger k,
pinning the version keeps a run reproducible under a fixed train.seed. When the weights it needs have
not been pushed yet the worker waits (nothing is sampled only to be dropped), so at most k rollouts wait
in its queue. k = 0 is synchronous: the same samples, metrics and weights as rollout.mode=sync.

Weights. The worker holds its own copy of the policy module (frozen tensors, e.g. the base under LoRA,
are shared, not copied: nobody writes them) and its own hf engine over it. After every optimizer step the
trainer pushes its trainable tensors: straight into the copy when the worker is not sampling (then, with
rollout.sync_check, the probe of rollout/sync_check.py proves the copy samples like the trainer), else as
a snapshot the worker copies in before the rollout that needs it (checked tensor for tensor).

Devices. With distributed.rollout_gpus the worker's device is a GPU of its own (config/devices.py
`rollout_device`, e.g. cuda:1 beside the trainer's cuda:0): the copy is then whole there (frozen tensors
too, since they cannot be shared across devices), so are a full fine-tune's frozen reference model (only
the worker scores with it) and the snapshots, and a push copies the trainable tensors across devices.
Each device runs its own stream, so sampling overlaps training; on one GPU the two would queue.

Correction. Samples sampled by an older version carry that version's log-probs (`behav_logp`, a
no-grad forward of the worker's copy); the loss reweights them by rollout.off_policy
(algos/offpolicy.py). Samples of the trainer's own version carry none: their weight is 1 exactly.

Resume. The queue is not checkpointed: after `--resume` at step s the worker starts from the loaded
weights (version s), so rollouts s .. s+k-1 are sampled by version s (staleness below k) and the
queue refills from there.
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
from trainfit.config import rollout_device
from trainfit.core.heap import cpu_heap_for_decoding
from trainfit.models.logprobs import store_rows
from trainfit.rollout import build_engine
from trainfit.rollout.base import StaleEngineError
from trainfit.rollout.staleness import queued_rollouts, sampled_version
from trainfit.rollout.sync_check import check_sync
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


class RolloutWorker:
    """Samples rollouts start, start+1, ... up to `last` in a thread, each with the version the bound allows."""

    def __init__(self, stage, start: int, last: int):
        cfg = stage.cfg
        self.k, self.v0, self.last = cfg.rollout.max_staleness, start, last
        self.device = torch.device(rollout_device(cfg.device_split(), str(stage.device)))
        self.model = worker_copy(stage.model, self.device)
        with self._on_device():
            self.engine = build_engine(cfg.rollout, self.model, stage.tokenizer, stop=stage.task.stop_strings(),
                                       model_cfg=cfg.model)
        self.engine.processor = stage.vision
        # The stage as the rollout code sees it: the worker's engine and module, the rest shared.
        self.view = copy.copy(stage)
        self.view.engine, self.view.model, self.view.device = self.engine, self.model, self.device
        if stage.ref_model is not None:   # only the worker scores with it: moved (in place) to its device
            self.view.ref_model = stage.ref_model.to(self.device)
        self.stage = stage
        self._mine = dict(trainable_named(self.model))
        self._copy_version = start                   # the version the copy holds
        self._snapshots: dict[int, dict] = {}        # version -> trainable tensors, pushed while it sampled
        self._ready: dict[int, StepBatch] = {}
        self._busy = False                           # sampling from the copy now
        self._next = start                           # the rollout it samples next
        self._error: Optional[BaseException] = None
        self._stop = False
        self._cv = threading.Condition()
        self.sync_metrics: dict = {}
        self.most_snapshots = self.most_queued = 0   # held at once so far (held_snapshots, queued_rollouts bound them)
        self._thread = threading.Thread(target=self._run, name="trainfit-rollout", daemon=True)
        self._thread.start()

    # ---- trainer side --------------------------------------------------------------------------
    def next_batch(self, step: int, model) -> StepBatch:
        """Push version `step` (the trainer's weights now) and take rollout `step`. With k = 0 the push
        comes first (rollout `step` is sampled by it); else the take, so the worker is idle at the push
        and it goes straight into the copy."""
        if self.k == 0:
            self.push(model, step)
        batch = self._take(step)
        if self.k > 0:
            self.push(model, step)
        return batch

    def push(self, model, version: int) -> None:
        with self._cv:
            if version <= self._copy_version:   # the copy was made from these weights (the first step)
                return
            if not self._busy and self._need(self._next) >= version:
                self._load({n: p for n, p in trainable_named(model)}, version)
                self._probe(model, version)
            else:
                self._snapshots[version] = {n: p.detach().to(self.device, copy=True)
                                            for n, p in trainable_named(model)}
                self.most_snapshots = max(self.most_snapshots, len(self._snapshots))
            self._cv.notify_all()

    def _take(self, rnd: int) -> StepBatch:
        with self._cv:
            self._cv.wait_for(lambda: rnd in self._ready or self._error is not None)
            if self._error is not None:
                raise self._error
            batch = self._ready.pop(rnd)
            self._cv.notify_all()
        return batch

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join()
        self.engine.close()

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

    def _load(self, tensors: dict, version: int) -> None:
        with torch.no_grad():
            for n, p in tensors.items():
                self._mine[n].copy_(p)
        self._copy_version = version

    def _run(self) -> None:
        try:
            if self.device.type == "cuda":   # a thread starts on cuda:0; the copy's kernels and graphs run here
                torch.cuda.set_device(self.device)
            while True:
                with self._cv:
                    rnd = self._next
                    need = self._need(rnd)
                    self._cv.wait_for(lambda: self._stop or rnd >= self.last or (
                        len(self._ready) < max(queued_rollouts(self.k), 1)   # k = 0: the hand-off itself
                        and (self._copy_version == need or need in self._snapshots)))
                    if self._stop or rnd >= self.last:
                        return
                    snap = self._snapshots.pop(need, None)
                    for v in [v for v in self._snapshots if v < need]:
                        del self._snapshots[v]
                    self._busy = True
                if snap is not None:
                    self._load(snap, need)
                    bad = [n for n, p in snap.items() if not torch.equal(self._mine[n], p)]
                    if bad:
                        raise StaleEngineError(f"the async worker's copy did not take policy version {need}: "
                                               f"{len(bad)} tensors differ (first {bad[0]}).")
                tick = time.perf_counter()
                with cpu_heap_for_decoding():   # as the sync rollout decodes (core/heap.py)
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

    @torch.no_grad()
    def _sample(self, rnd: int, version: int) -> StepBatch:
        """Rollout `rnd` with the copy at `version`: the stage's own rollout code, then the behaviour
        log-probs when it will be trained stale."""
        view = self.view
        view.sync_metrics = self.sync_metrics
        batch = view._rollout(rnd, rnd)
        if version < rnd:
            mb = view.cfg.train.micro_batch_size
            for i in range(0, len(batch.samples), mb):
                chunk = batch.samples[i:i + mb]
                logp, mask, _ = view._logprobs(self.model, chunk)
                store_rows(chunk, "behav_logp", logp, mask)
        for s in batch.samples:
            s["version"] = version
        # One version for the whole rollout (counted even when every sample was left out: zero advantages).
        batch.metrics.update(staleness_stats([version], rnd), policy_version=float(version))
        return batch

