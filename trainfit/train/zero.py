"""DeepSpeed ZeRO-3 and ZeRO-Offload around trainfit's own model, optimizer and schedule.

    optimizer = cpu_adam(groups, lr=..., betas=..., eps=..., weight_decay=...)  # offload_optimizer
    engine = parallel.deepspeed_initialize(model, optimizer, cfg)                # registers the engine
    with full_weights(model):      # ZeRO-3: every parameter gathered, hooks off (hf rollout, eval, save)
        ...
    with gathered_trainable(policy):   # ZeRO-3: the adapters whole while an engine saves them (a sync)
        engine.sync(policy)
    states = StatesAsleep(model)   # distributed.offload_train_states_during_rollout
    states.sleep(); ...generate...; states.wake()

ZeRO-3 partitions every parameter (a rank keeps 1/N of each; `param.data` is empty outside a forward)
and gathers each layer in its forward through hooks on the module. Those hooks make every forward a
collective, so generation, whose step count differs per rank, runs on the whole gathered model with the
hooks taken off (as DeepSpeed's `unwrap_model_for_generation` and TRL do; here the start-of-forward hook
too, which checks with the other ranks); evaluation and saving the final model use the same context.
That is only done for the rollout where the engine generates with the trainer's module (rollout.engine=hf,
`Config.rollout_gathers_whole`). An engine with its own copy (vllm, openai) never needs the whole model
on a rank: vLLM's sync gathers one parameter at a time (rollout/vllm_engine.py `_full_tensor`), an
adapter sync gathers the adapters alone (`gathered_trainable`), and the scoring forwards run under the
partition hooks, a layer gathered at a time, as training's do. The planner counts either (plan/states.py).

`StatesAsleep` moves the optimizer's fp32 master weights, Adam moments and gradient buffers to CPU RAM
while the engine generates and back before scoring (distributed.offload_train_states_during_rollout, as
OpenRLHF's --deepspeed_enable_sleep). DeepSpeed's `engine.offload_states` moves the gradient buffers; its
master-weight and moment moves assert DeepSpeed's FusedAdam (0.19), so those two are moved here the same
way (`.data` swapped to a pinned host copy: the optimizer keeps the same tensor objects).

ZeRO-Offload keeps the fp32 optimizer partition (master weights, Adam moments) in CPU RAM and steps it
there with DeepSpeed's CPU Adam, a C++ op compiled on first use (`ensure_op_cache`). The client
optimizer must be that class: DeepSpeed refuses a torch optimizer next to offload.
"""

from __future__ import annotations

import contextlib
import os
import sys
import weakref
from pathlib import Path

from trainfit.core.dist import zero3_partitioned

# The DeepSpeed engine wrapping each raw module: stages hold the module (the rollout engine samples it),
# the loop holds the engine. Weak both ways (the engine holds the module): a finished stage's pair is
# not kept alive here.
_ENGINES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def op_cache_dir() -> Path:
    """Where DeepSpeed's JIT-built ops (CPU Adam, the CPU accelerator's shared-memory comm op) are
    cached: inside the Python environment, since they are built against its torch and DeepSpeed
    (and for this machine's CPU). `make test` builds them there once."""
    return Path(sys.prefix) / "torch_extensions"


def ensure_op_cache() -> None:
    """Point torch's extension builder at `op_cache_dir` unless the user chose a directory."""
    if "TORCH_EXTENSIONS_DIR" not in os.environ and os.access(sys.prefix, os.W_OK):
        os.environ["TORCH_EXTENSIONS_DIR"] = str(op_cache_dir())


def build_ops() -> None:
    """Compile (or load from the cache) the ops a CPU DeepSpeed run loads: CPU Adam and the CPU
    accelerator's shared-memory comm op. Built once they load in seconds; the first build takes
    ~2.5-3 minutes each on 2 cores (`make test` does it at install)."""
    ensure_op_cache()
    from deepspeed.accelerator import get_accelerator

    for name in ("CPUAdamBuilder", "ShareMemCommBuilder"):
        builder = get_accelerator().create_op_builder(name)
        if builder is not None and builder.is_compatible():
            builder.load(verbose=False)


def cpu_adam(params: list, **kw):
    """DeepSpeed's CPU Adam in AdamW mode (decoupled weight decay, as torch.optim.AdamW) over `params`
    (parameters or param-group dicts). Same update as torch's AdamW up to float rounding: both compute
    w -= lr * (m / bc1) / (sqrt(v / bc2) + eps) after w *= 1 - lr * wd in fp32, CPU Adam with SIMD
    (AVX-512 / AVX2) in another operation order."""
    ensure_op_cache()
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    return DeepSpeedCPUAdam(params, adamw_mode=True, **kw)


def register(model, engine) -> None:
    _ENGINES[model] = weakref.ref(engine)


def zero3_engine(model):
    """The ZeRO-3 DeepSpeed engine around `model` (the raw module or the engine itself), else None."""
    if type(model).__name__ == "DeepSpeedEngine":
        engine = model
    else:
        try:
            ref = _ENGINES.get(model)
        except TypeError:  # not weak-referenceable: no module of ours
            ref = None
        engine = ref() if ref is not None else None
    if engine is not None and engine.zero_optimization_stage() == 3:
        return engine
    return None


@contextlib.contextmanager
def full_weights(model):
    """Inside: every ZeRO-3 parameter of `model` whole on every rank, with the partition hooks off, so
    forwards (generation, evaluation) are local and `state_dict()` / `save_pretrained` see full
    tensors. A collective to enter: every rank enters. Changes made inside are not kept (read-only).
    A no-op for any other model."""
    engine = zero3_engine(model)
    if engine is None:
        yield
        return
    from deepspeed.runtime.zero import GatheredParameters

    offload = engine.optimizer.parameter_offload  # owns the partition hooks on the module
    module = offload.module
    with GatheredParameters(list(module.parameters())):
        # Every hook off, the start-of-forward one too: it checks with the other ranks (a collective).
        start = module._forward_pre_hooks.pop(offload.fwd_pre_hook.id, None)
        for hook in offload.forward_hooks + offload.backward_hooks:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield
        finally:  # in the order DeepSpeed registered them: start-of-forward first, then per module
            if start is not None:
                module._forward_pre_hooks[offload.fwd_pre_hook.id] = start
            offload._register_deepspeed_module(module)


@contextlib.contextmanager
def gathered_trainable(model):
    """Inside: the trainable ZeRO-3 parameters of `model` (a policy's adapters) whole on every rank, the
    frozen base left partitioned. A collective to enter; a no-op without ZeRO-3 partitions. Those an outer
    gather holds (`full_weights`: an evaluation's sync) are whole already: DeepSpeed refuses to nest them."""
    params = [p for p in model.parameters() if p.requires_grad and zero3_partitioned(p)]
    if not params:
        yield
        return
    from deepspeed.runtime.zero import GatheredParameters

    with GatheredParameters(params):
        yield


class StatesAsleep:
    """The ZeRO-3 optimizer's states of `model` (fp32 master partition, Adam moments, gradient buffers)
    moved to CPU RAM by `sleep` and back by `wake`; both idempotent, no-ops for a model without a ZeRO-3
    engine. The bf16 weight partitions stay: the sync and the scoring forwards gather from them."""

    def __init__(self, model):
        self.model = model
        self.devices: list = []   # (tensor, its device) for each tensor moved, while asleep
        self.asleep = False

    @staticmethod
    def _tensors(opt) -> list:
        """The fp32 partitions and the Adam moments keyed by them (empty before the first step)."""
        moments = [st[k] for st in opt.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq") if k in st]
        return list(opt.fp32_partitioned_groups_flat) + moments

    def sleep(self) -> None:
        engine = zero3_engine(self.model)
        if engine is None or self.asleep:
            return
        from deepspeed.accelerator import get_accelerator
        from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

        accel = get_accelerator()
        grads = [OffloadStateTypeEnum.lp_grads, OffloadStateTypeEnum.contiguous_grad_buffer]
        engine.offload_states(include=grads, device=OffloadDeviceEnum.cpu, pin_memory=True)
        for t in self._tensors(engine.optimizer):
            host = accel.pin_memory(t.new_empty(t.shape, device="cpu"))
            host.copy_(t.data)
            self.devices.append((t, t.device))
            t.data = host
        self.asleep = True
        accel.empty_cache()   # the freed blocks go back to the card (the engine allocates outside torch's cache)

    def wake(self) -> None:
        if not self.asleep:
            return
        for t, device in self.devices:
            t.data = t.data.to(device)
        self.devices, self.asleep = [], False
        zero3_engine(self.model).reload_states()   # the gradient buffers


def main() -> None:
    """`python -m trainfit.train.zero` (make's dev install): build the ops into the environment's cache,
    saying first what it builds and why (the build is silent for minutes)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    ensure_op_cache()
    where = os.environ.get("TORCH_EXTENSIONS_DIR", str(op_cache_dir()))
    print(f"building DeepSpeed's CPU ops (CPU Adam for ZeRO-Offload, the CPU accelerator's shared-memory comm op) "
          f"into {where}, for trainfit's DeepSpeed runs to load in seconds: ~3 minutes each on 2 cores the "
          "first time, nothing to do once built", flush=True)
    build_ops()
    print(f"DeepSpeed ops cached in {where}")


if __name__ == "__main__":
    main()
