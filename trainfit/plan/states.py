"""Model-state bytes, counted exactly: weights, adapters, gradients, optimizer state, master weights.

What the trainer does, and so what is counted:
- weights are loaded in `model.dtype`; transformers keeps a few modules in fp32 whatever the dtype
  (`_keep_in_fp32_modules`), and floating buffers (rotary tables) are counted in fp32;
- full fine-tuning keeps gradients and torch AdamW's two moments (exp_avg, exp_avg_sq) in the
  parameter dtype; there are no fp32 master weights unless a mixed-precision engine adds them
  (DeepSpeed with bf16/fp16 keeps fp32 master weights and fp32 moments: 4 + 4 + 4 bytes a parameter);
- LoRA/DoRA adapters are fp32 (peft's `autocast_adapter_dtype=True`): A [r, in] and B [out, r] per
  adapted linear, plus DoRA's magnitude [out]; their gradients and moments are fp32 too;
- QLoRA quantizes every nn.Linear but the output head with bitsandbytes:
  NF4/FP4: 0.5 byte a weight, an fp32 absmax per block of 64 weights, and the 16-entry fp32 code;
  with double quantization the absmax are 8-bit in blocks of 256 with an fp32 absmax per block and
  one fp32 offset. LLM.int8: 1 byte a weight and an fp32 scale per output row. Every parameter that
  is not quantized (embeddings, norms, biases, the LM head) is then cast to fp32 before the adapters
  are attached (`trainfit.models.kbit.kbit_upcast`, as peft's prepare_model_for_kbit_training does);
- bitsandbytes 8-bit Adam (`Optimizer2State.init_state`) keeps, for a tensor of n >= 4096 elements
  (`min_8bit_size`), two uint8 moments [n] and two fp32 absmax [ceil(n / 256)]; smaller tensors get
  two fp32 moments [n]. The two 256-entry fp32 quantization maps (signed and unsigned dynamic) are
  shared by every tensor of the optimizer (each state holds a reference): 2 KiB once. Paged variants
  have the same bytes, but moments of tensors of 1e5 elements or more live in CUDA unified memory
  (cudaMallocManaged) that can be paged out to CPU and that torch.cuda.max_memory_allocated does
  not see; they are counted here as resident on the GPU (what a step touches);
- torch AdamW's `step` counters live on the CPU and are not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainfit.models.shapes import ArchFacts, LinearGroup, match_targets

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
NF4_BLOCK = 64            # weights per absmax block (bitsandbytes quantize_4bit default)
DQ_BLOCK = 256            # absmax values per block of the second quantization
NF4_CODE_BYTES = 16 * 4   # the 16-value fp32 code table each quantized tensor carries
BNB_ADAM_BLOCK = 256      # 8-bit optimizer block size
BNB_MIN_8BIT = 4096       # tensors smaller than this keep 32-bit optimizer state
BNB_QMAPS = 2 * 256 * 4   # the signed and unsigned dynamic maps, fp32 [256] each, one pair per optimizer


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def nf4_bytes(numel: int, double_quant: bool) -> int:
    """Bytes of one NF4/FP4-quantized weight tensor of `numel` elements, constants included."""
    blocks = _ceil(numel, NF4_BLOCK)
    packed = _ceil(numel, 2)
    if double_quant:
        absmax = blocks + 4 * _ceil(blocks, DQ_BLOCK) + 4  # uint8 absmax, fp32 absmax of absmax, fp32 offset
    else:
        absmax = 4 * blocks
    return packed + absmax + NF4_CODE_BYTES


def int8_bytes(g: LinearGroup) -> int:
    """LLM.int8 weight: int8 values + one fp32 scale per output row, per tensor."""
    return g.in_features * g.out_features + 4 * g.out_features


def adam8bit_bytes(numel: int) -> int:
    """One tensor's own 8-bit AdamW state (the shared quantization maps are counted once, apart)."""
    if numel < BNB_MIN_8BIT:
        return 8 * numel
    return 2 * numel + 2 * 4 * _ceil(numel, BNB_ADAM_BLOCK)


def adam8bit_total(tensors: list[int]) -> int:
    """All of a bitsandbytes 8-bit AdamW's state over tensors of these sizes: per-tensor state plus
    the two shared quantization maps when at least one tensor is large enough to be 8-bit."""
    maps = BNB_QMAPS if any(n >= BNB_MIN_8BIT for n in tensors) else 0
    return sum(adam8bit_bytes(n) for n in tensors) + maps


@dataclass
class States:
    """Bytes of one model's states on one GPU (after partitioning) and in CPU RAM (offload)."""

    weights: int = 0            # all parameters and buffers as stored (quantized base included)
    adapters: int = 0           # of which: LoRA/DoRA adapter weights (0 for full fine-tuning)
    grads: int = 0
    optimizer: int = 0
    master: int = 0
    # Offloaded states in CPU RAM, per GPU process, each kind apart so a plan row holds what its name says.
    cpu_weights: int = 0        # offload_params: the base's partition (adapters apart)
    cpu_adapters: int = 0       # offload_params: the adapters' partition
    cpu_grads: int = 0          # FSDP offload: the gradients' shards (reduce-scattered to CPU RAM each micro-step)
    cpu_optimizer: int = 0      # offload_optimizer: Adam's moments
    cpu_master: int = 0         # offload_optimizer: fp32 master weights
    cpu_step_temp: int = 0      # offload_optimizer: the step's temporaries (it runs on the CPU)
    trainable_params: int = 0   # parameter count (not bytes)
    trainable_tensors: int = 0
    gathered: int = 0           # ZeRO-3 working set: full weights of the layers being computed
    rollout_gather: int = 0     # DeepSpeed ZeRO-3 rollout with the hf engine: the rest of the weights, gathered whole
    rollout_sync: int = 0       # ZeRO-3 sync to an engine with its own copy: the tensors gathered at once
    asleep: int = 0             # distributed.offload_train_states_during_rollout: states in CPU RAM while generating
    comm_buffers: int = 0       # DDP / ZeRO gradient buckets
    step_temp: int = 0          # optimizer-step temporaries (foreach sqrt, fp32 gradient partition)
    detail: str = ""

    @property
    def cpu(self) -> int:
        """Every offloaded byte, per GPU process."""
        return (self.cpu_weights + self.cpu_adapters + self.cpu_grads + self.cpu_optimizer + self.cpu_master
                + self.cpu_step_temp)


def adapter_tensors(facts: ArchFacts, peft: str, r: int, targets) -> list[int]:
    """numel of every adapter tensor: lora_A [r, in], lora_B [out, r], DoRA magnitude [out]."""
    out: list[int] = []
    for g in match_targets(facts, targets):
        out += [r * g.in_features] * g.count + [g.out_features * r] * g.count
        if peft == "dora":
            out += [g.out_features] * g.count
    return out


def base_weight_bytes(facts: ArchFacts, dtype: str, quantization: str = "none", double_quant: bool = True) -> int:
    """Bytes of the (frozen or full) base: everything in `dtype`, or with a k-bit base, the quantized
    linears plus every other parameter in fp32 (`models.kbit.kbit_upcast`)."""
    b = DTYPE_BYTES[dtype]
    buffers = 4 * facts.n_buffer_elems
    if quantization == "none":
        return facts.n_params * b + facts.n_fp32_params * (4 - b) + buffers
    quant_numel = sum(g.numel for g in facts.linears)
    if quantization == "4bit":
        qbytes = sum(g.count * nf4_bytes(g.in_features * g.out_features, double_quant) for g in facts.linears)
    else:
        qbytes = sum(g.count * int8_bytes(g) for g in facts.linears)
    return (facts.n_params - quant_numel) * 4 + qbytes + buffers


def optimizer_bytes(tensors: list[int], optimizer: str, state_bytes: int) -> int:
    """Moments of AdamW over tensors of the given sizes (state_bytes: bytes of one moment element)."""
    if optimizer in ("adamw_8bit", "paged_adamw_8bit"):
        return adam8bit_total(tensors)
    return 2 * state_bytes * sum(tensors)


def all_tensors(facts: ArchFacts) -> list[int]:
    out: list[int] = []
    for numel, count in facts.param_sizes:
        out += [numel] * count
    return out


@dataclass(frozen=True)
class Parallel:
    """How states are split: engine, ZeRO stage, ranks sharing the split, offload."""

    engine: str = "single"       # single | ddp | fsdp | deepspeed
    zero_stage: int = 0
    world: int = 1
    offload_optimizer: bool = False
    offload_params: bool = False
    rollout_whole: bool = False  # the rollout gathers every parameter (Config.rollout_gathers_whole)
    states_asleep: bool = False  # distributed.offload_train_states_during_rollout

    @property
    def mixed_precision(self) -> bool:
        return self.engine == "deepspeed"

    @property
    def fsdp_offload(self) -> bool:
        """FSDP2's CPUOffloadPolicy (train/fsdp.py `shard`): parameter, gradient and optimizer shards in CPU RAM."""
        return self.engine == "fsdp" and self.offload_params

    @property
    def sharding(self) -> str:
        """What partitions the weights (zero_stage 3), as a plan row names it."""
        return "FSDP" if self.engine == "fsdp" else "ZeRO-3"


def parallel_of(cfg) -> Parallel:
    d = cfg.distributed
    world = cfg.world_size
    engine = cfg.engine()
    stage = d.zero_stage if engine == "deepspeed" else (3 if engine == "fsdp" else 0)
    # FSDP2 offloads the optimizer with the parameters (config/rules.py fsdp_offload_errors): one switch.
    fsdp_offload = engine == "fsdp" and d.offload_params
    return Parallel(engine, stage, world, (d.offload_optimizer and engine == "deepspeed") or fsdp_offload,
                    d.offload_params and stage == 3, cfg.rollout_gathers_whole(),
                    d.offload_train_states_during_rollout)


def model_states(facts: ArchFacts, *, dtype: str, trainable: str, peft: str = "none", r: int = 16,
                 targets="all-linear", quantization: str = "none", double_quant: bool = True,
                 optimizer: str = "adamw", par: Parallel = Parallel(), head_params: int = 0,
                 drop_lm_head: bool = False, frozen: tuple = ()) -> States:
    """States of one model on one GPU.

    trainable: "full" (every parameter), "adapters" (peft), or "none" (frozen: reference, reward).
    head_params: parameters of a score head added to the model (value/reward head [1, hidden]); it
    trains with the model unless the model is frozen.
    drop_lm_head: the model has a score head instead of the LM head (value and reward models).
    frozen: sizes of parameter tensors a full fine-tune keeps frozen (a VLM's vision tower / projector):
    weights only, no gradients or optimizer states.
    """
    b = DTYPE_BYTES[dtype]
    st = States()
    base = base_weight_bytes(facts, dtype, quantization if trainable != "full" else "none", double_quant)
    if drop_lm_head:
        base -= facts.n_lm_head * (4 if quantization != "none" and trainable != "full" else b)
    head_bytes = head_params * b
    if trainable == "full":
        tensors = [n for n in all_tensors(facts)]
        if drop_lm_head and facts.n_lm_head:
            tensors.remove(facts.n_lm_head)
        for n in frozen:
            tensors.remove(n)
        tensors += [head_params] if head_params else []
        state_b = b
    elif trainable == "adapters":
        tensors = adapter_tensors(facts, peft, r, targets) + ([head_params] if head_params else [])
        state_b = 4
    else:
        tensors, state_b = [], b
    st.trainable_params = sum(tensors)
    st.trainable_tensors = len(tensors)
    adapters = sum(adapter_tensors(facts, peft, r, targets)) if trainable == "adapters" else 0
    # DeepSpeed casts the whole module to bf16/fp16 (adapters too) and keeps fp32 masters for what trains.
    mixed = par.mixed_precision and dtype != "fp32" and trainable != "none"
    adapter_b = b if mixed else 4
    st.adapters = adapters * adapter_b
    st.weights = base + head_bytes + st.adapters
    grad_b = adapter_b if trainable == "adapters" else b
    st.grads = st.trainable_params * grad_b
    if mixed:
        st.master = 4 * st.trainable_params
        st.optimizer = optimizer_bytes(tensors, optimizer, 4)
    elif trainable != "none":
        st.optimizer = optimizer_bytes(tensors, optimizer, state_b if trainable == "full" else 4)
    if trainable != "none":
        # torch AdamW's foreach path (FSDP, DeepSpeed) keeps one temporary the size of exp_avg_sq (its
        # sqrt) during step(); the fused kernel trainfit uses otherwise (train/loop.py) keeps none.
        foreach = optimizer == "adamw" and par.engine in ("fsdp", "deepspeed")
        st.step_temp = st.trainable_params * (4 if mixed else grad_b) if foreach else 0
    _partition(st, facts, par, b, trainable)
    if par.fsdp_offload and tensors:
        _fsdp_offload(st, tensors, par.world, state_b if not mixed else 4)
    return st


def _partition(st: States, facts: ArchFacts, par: Parallel, b: int, trainable: str) -> None:
    n, stage = par.world, par.zero_stage
    if par.engine in ("deepspeed", "fsdp") and trainable != "none":
        if stage >= 1:
            st.optimizer //= n
            st.master //= n
            if par.engine == "deepspeed" and stage in (1, 2):
                # ZeRO-1/2 cast the averaged gradient partition to fp32 before the optimizer step.
                st.step_temp = 4 * st.trainable_params // n
            else:
                st.step_temp //= n
        if stage >= 2:
            st.grads //= n
            # reduce + all-gather buckets, sized hidden^2 elements each as HF's "auto" sets them.
            st.comm_buffers = 2 * facts.hidden * facts.hidden * b
    elif par.engine == "ddp" and trainable != "none":
        # DDP's reducer keeps flat gradient buckets as large as the gradients (gradient_as_bucket_view=False).
        st.comm_buffers = st.grads
    if stage == 3 and par.engine in ("deepspeed", "fsdp"):
        whole, whole_adapters = st.weights, st.adapters
        st.weights //= n
        st.adapters //= n
        # The layer being computed plus the prefetched next one are gathered in full; the embedding
        # (one tensor) is gathered whole when it is used.
        st.gathered = max(2 * facts.layer_params, facts.largest_param + facts.layer_params) * b
        if par.offload_params:
            st.cpu_weights, st.cpu_adapters = st.weights - st.adapters, st.adapters
            st.weights = st.adapters = 0
        if par.rollout_whole:  # generation gathers every parameter (train/zero.py full_weights)
            st.rollout_gather = whole - st.weights
        elif par.engine == "deepspeed":
            # The sync to an engine with its own copy: one tensor gathered and copied out at a time
            # (rollout/vllm_engine.py _full_tensor), an adapter sync's adapters whole (zero.gathered_trainable).
            st.rollout_sync = 2 * facts.largest_param * b + (whole_adapters - st.adapters if trainable == "adapters"
                                                             else 0)
    if par.offload_optimizer and trainable != "none":
        st.cpu_optimizer, st.cpu_master, st.cpu_step_temp = st.optimizer, st.master, st.step_temp
        st.optimizer = st.master = st.step_temp = 0
    if par.states_asleep and trainable != "none":   # train/zero.py StatesAsleep (ZeRO-3, config rules)
        st.asleep = st.optimizer + st.master + st.grads


def _fsdp_offload(st: States, tensors: list[int], world: int, state_b: int) -> None:
    """FSDP2's CPU offload of what trains: the gradients' shards reach CPU RAM at every micro-step (reduce-scattered
    on the GPU, then copied; train/parallel.py does not defer the sync), so none stays on the GPU; the optimizer
    (torch AdamW over CPU shards: its for-loop path, one tensor at a time) keeps the temporaries of one tensor,
    the sqrt of its exp_avg_sq and that divided by the bias correction, as it steps the largest shard."""
    st.cpu_grads, st.grads = st.grads, 0
    st.cpu_step_temp = 2 * -(-max(tensors) // world) * state_b
