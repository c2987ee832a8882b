"""Instruments for tracing memory under FakeTensorMode: a live-storage tracker and fake-model helpers.

`LiveTracker` is a dispatch mode that records every storage an op creates (bytes, birth, death, and
the `owner` set by module hooks) plus what autograd saves for backward (through
`saved_tensors_hooks`), so the peak of live bytes over any stretch of the run can be computed
afterwards. It works on fake and on real tensors; the CPU tests compare the two.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from typing import Optional


class LiveTracker:
    """Dispatch mode that follows every storage ops create: birth, death, bytes, and who made it.

    `owner` is set by module hooks (layer0, layer1, model, head); storages listed in `exclude`
    (parameters, buffers) are never counted. Works on fake and on real tensors.
    """

    def __init__(self, exclude: set[int], inputs: "dict[int, int] | None" = None):
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tracker._after_op(out)
                return out

        self.mode = _Mode()
        self.exclude = exclude
        self.owner = "model"
        self.op = 0
        self.serial = 0
        self.live: dict[int, list] = {}      # id(storage) -> [weakref, nbytes, owner, birth, serial]
        self.dead: list[tuple] = []          # (nbytes, owner, birth, death, serial)
        self.saved: dict[int, tuple] = {}    # serial -> (nbytes, owner at birth)
        # Inputs made before tracing (e.g. the body's output fed to the head): not counted as live
        # here, but counted as saved when autograd saves them. id(storage) -> nbytes.
        self.inputs = inputs or {}
        self.saved_inputs: dict[int, int] = {}
        self.marks: dict[str, int] = {}

    def _after_op(self, out) -> None:
        import torch
        from torch.utils._pytree import tree_flatten

        self.op += 1
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.register(t)

    def _died(self, key: int, serial: int) -> None:
        # Weakref callback: the storage went away after op `self.op` returned, so it was alive through it.
        entry = self.live.get(key)
        if entry is not None and entry[4] == serial:
            del self.live[key]
            self.dead.append((entry[1], entry[2], entry[3], self.op + 1, serial))

    def register(self, t) -> Optional[list]:
        s = t.untyped_storage()
        key = id(s)
        if key in self.exclude:
            return None
        entry = self.live.get(key)
        if entry is not None and entry[0]() is s:
            return entry
        self.serial += 1
        serial = self.serial
        ref = weakref.ref(s, lambda _r, key=key, serial=serial: self._died(key, serial))
        entry = [ref, s.nbytes(), self.owner, self.op, serial]
        self.live[key] = entry
        return entry

    def serial_of(self, t) -> Optional[int]:
        """Serial number of a live tensor's storage (ids of dead storages are reused; serials are not)."""
        entry = self.live.get(id(t.untyped_storage()))
        return entry[4] if entry is not None else None

    def pack(self, t):
        """saved_tensors_hooks pack: note the storage as saved for backward (first save wins)."""
        entry = self.register(t)
        if entry is not None:
            self.saved.setdefault(entry[4], (entry[1], entry[2]))
        elif id(t.untyped_storage()) in self.inputs:
            self.saved_inputs[id(t.untyped_storage())] = self.inputs[id(t.untyped_storage())]
        return t

    def saved_bytes(self, owner: "str | None" = None) -> int:
        """Saved-for-backward bytes (of one owner), inputs included, each storage once."""
        total = sum(n for n, o in self.saved.values() if owner is None or o == owner)
        return total + (sum(self.saved_inputs.values()) if owner is None else 0)

    def mark(self, name: str) -> None:
        self.marks[name] = self.op

    def records(self):
        """(nbytes, owner, birth, death or None, serial) of every storage seen."""
        return self.dead + [(e[1], e[2], e[3], None, e[4]) for e in self.live.values()]

    def live_at(self, op: int, skip: set[int] = frozenset()) -> dict[str, int]:
        by_owner: dict[str, int] = defaultdict(int)
        for nbytes, owner, birth, death, key in self.records():
            if birth <= op and (death is None or death > op) and key not in skip:
                by_owner[owner] += nbytes
        return by_owner

    def peak(self, start: int = 0, end: Optional[int] = None, skip: set[int] = frozenset()) -> int:
        """Peak of live bytes between two op indices (events are births and deaths)."""
        events = []
        for nbytes, owner, birth, death, key in self.records():
            if key in skip or (end is not None and birth > end) or (death is not None and death <= start):
                continue
            events.append((max(birth, start), nbytes))
            if death is not None:
                events.append((death, -nbytes))
        events.sort(key=lambda e: (e[0], e[1]))  # frees before allocations at the same op
        live = best = 0
        for _, delta in events:
            live += delta
            best = max(best, live)
        return best


def step_peak(step, model, optimizer) -> int:
    """Peak live tensor bytes of one real CPU training step `step()`, counting the model's parameters
    and buffers and the optimizer's state as resident from the start: what the planner's `train`
    phase predicts (`allocated`). Run a warm-up step first so the optimizer state exists. The cyclic
    collector is paused, so a tensor dies exactly when its last reference goes (as CUDA memory)."""
    import gc

    import torch

    tracker = LiveTracker(set())
    resident = list(model.parameters()) + list(model.buffers())
    resident += [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    for t in resident:
        tracker.register(t)
    gc.disable()
    try:
        with tracker.mode:
            step()
    finally:
        gc.enable()
    return tracker.peak()


def _balanced_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    # Same ops as transformers' eager experts loop, with each expert given an equal share of the
    # routed tokens (N x top_k / E) so that shapes do not depend on data: [n, d] -> [n, 2I] -> [n, d].
    import torch

    n_tok = hidden_states.shape[0]
    k = top_k_index.shape[-1]
    share = max(1, -(-n_tok * k // self.num_experts))
    final = torch.zeros_like(hidden_states)
    for e in range(self.num_experts):
        idx = (torch.arange(share, device=hidden_states.device) + e * share) % n_tok
        slot = torch.zeros_like(idx) + (e % k)
        x = hidden_states[idx]
        gate, up = torch.nn.functional.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        h = torch.nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e])
        h = h * top_k_weights[idx, slot, None]
        final.index_add_(0, idx, h.to(final.dtype))
    return final


def patch_moe(model) -> int:
    patched = 0
    for m in model.modules():
        if type(m).__name__.endswith("Experts") and hasattr(m, "gate_up_proj") and hasattr(m, "num_experts"):
            m.forward = _balanced_experts_forward.__get__(m)
            patched += 1
    return patched


def fake_copy(modules, fake_mode) -> None:
    """Replace the meta parameters and buffers of `modules` by fake CPU tensors (ties kept).

    Fake tensors of the CPU device make SDPA take its fused kernel, as on the GPU; on the meta
    device it would take the math path and keep the [T, T] attention matrix.
    """
    import torch

    convert = fake_mode.fake_tensor_converter.from_meta_and_device
    cpu = torch.device("cpu")
    memo: dict[int, torch.Tensor] = {}  # tied weights stay one tensor
    for root in modules:
        for mod in root.modules():
            for name, p in list(mod._parameters.items()):
                if p is not None:
                    if id(p) not in memo:
                        memo[id(p)] = torch.nn.Parameter(convert(fake_mode, p.detach(), cpu),
                                                         requires_grad=p.requires_grad)
                    mod._parameters[name] = memo[id(p)]
            for name, b in list(mod._buffers.items()):
                if b is not None:
                    mod._buffers[name] = memo.setdefault(id(b), convert(fake_mode, b, cpu))
