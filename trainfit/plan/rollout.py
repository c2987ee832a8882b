"""The rollout engine's memory (HF generate or a colocated vLLM) and the work of a step for the roofline.

HF generate (in-process): the KV cache is 2 x layers x kv_heads x head_dim x bytes per token
(sliding-window layers capped at the window; Mamba keeps a fixed recurrent state instead, see
recurrent_state_bytes), for the
sequences generated together (`rollout.batch_size`, else all the step's completions on this GPU),
at prompt + max_new_tokens tokens (`prompt` is the longest prompt the data gives, lengths.py: the
batch is left-padded to it). On top of it: the prefill forward's working set (traced, no grad;
trainfit's decoding loop, rollout/decode.py, prefills each distinct prompt once, so a GRPO batch
prefills rows / G prompts; `generate` prefills every row), or while decoding the sampling rows plus
one layer's cache copy as DynamicCache grows by concatenation. Sampling one step holds, per row and
vocabulary entry: the step's bf16 logits (2 bytes) and their fp32 copy (4), and the per-row seeded
Gumbel noise (rollout/sampling.gumbel_noise) hashes the vocabulary in int64: its input, its result and a
shifted temporary live together (24); a temperature / top-k / top-p warper keeps one more fp32
copy (4), top-p sorts it (fp32 values, int64 indices, softmax, cumsum, masks: 26, before the noise).
With the static cache (rollout.hf_cache, static on CUDA by default) the cache is allocated whole at
prompt + max_new_tokens for every row (finished rows stay), while the prefill's dynamic cache of the
distinct prompts is copied into it; with CUDA graphs the rows round up to the batch bucket (a power
of two from 8), the length to a multiple of 128, and the cache stays on the card through training,
so the graphs replay.

vLLM (colocated): the engine takes `gpu_memory_utilization` x the card for itself (weights, CUDA
graphs and other non-torch memory, its profiling activations, and the KV cache in what is left: the
bytes rollout/vllm_memory.kv_pool_bytes gives, which the engine passes as kv_cache_memory_bytes).
Between rollouts it sleeps: level 1 drops the KV cache and offloads the weights to CPU RAM, level
2 drops both; what stays on the card is taken as VLLM_GRAPH_RESERVE.
"""

from __future__ import annotations

import math

from trainfit.config import ModelConfig, RolloutConfig, TrainConfig
from trainfit.config.stages import stage_spec
from trainfit.plan.states import DTYPE_BYTES, base_weight_bytes
from trainfit.rollout.buckets import STATIC_LENGTH_STEP, batch_bucket
from trainfit.rollout.staleness import WORKER_PROCESS_RUNTIME, held_snapshots, queue_bytes, queued_rollouts
from trainfit.rollout.vllm_memory import VLLM_PROFILE_TOKENS  # noqa: F401 - plan/screens.py reads it here
from trainfit.rollout.vllm_memory import VLLM_GRAPH_RESERVE, kv_pool_bytes, profile_bytes

GiB = 1024 ** 3
SAMPLING_BYTES = 2 + 4 + 24    # per vocab entry per row: bf16 logits, fp32 scores, Gumbel hashing (int64 x 3)
WARPED_BYTES, TOP_P_BYTES = 4, 26


def sampling_bytes(r) -> int:
    """Bytes per row and vocabulary entry at one decoding step's peak (see the module docstring)."""
    if r.temperature == 0:
        return 6  # greedy: logits and their fp32 copy, then argmax
    warped = r.temperature != 1.0 or r.top_k or r.top_p < 1.0
    return 6 + (WARPED_BYTES if warped else 0) + max(SAMPLING_BYTES - 6, TOP_P_BYTES if r.top_p < 1.0 else 0)


def uses_decode_loop(r, facts) -> bool:
    """Whether the hf engine decodes with trainfit's loop (decode.supports_decode_loop: standard
    decoder-only text models) or with `generate` (Mamba, multimodal models, rollout.decoder=generate)."""
    if r.decoder != "auto":
        return r.decoder == "trainfit"
    return not facts.ssm_state_per_seq and not facts.n_vision


def static_cache(r: RolloutConfig, model: ModelConfig, t: TrainConfig, facts) -> tuple[bool, bool]:
    """(static cache, CUDA graphs) for the hf engine as HFEngine._static_decoder decides them on a GPU
    (decode.supports_static_cache: full attention only; sdpa or eager attention)."""
    if r.engine != "hf" or not uses_decode_loop(r, facts) or facts.kv_window_per_token:  # sliding layers
        return False, False
    if getattr(model, "attn_implementation", "sdpa") not in ("sdpa", "eager"):
        return False, False
    on_gpu = t.device != "cpu"
    static = r.hf_cache == "static" or (r.hf_cache == "auto" and on_gpu)
    return static, static and on_gpu and r.hf_cuda_graphs


def recurrent_state_bytes(facts, seqs: int, dtype: str) -> int:
    """Mamba's cache in `generate` for `seqs` sequences, whatever their length: per layer a conv state
    [seqs, d_inner, conv_kernel] in the model dtype and an ssm state [seqs, d_inner, state_size] in
    fp32 (the selective scan accumulates in fp32 and the cache keeps the state it returns)."""
    conv = facts.ssm_state_per_seq - facts.ssm_fp32_per_seq
    return seqs * (conv * DTYPE_BYTES[dtype] + facts.ssm_fp32_per_seq * DTYPE_BYTES["fp32"])


def rollout_items(Item, items, cfg, facts, tr, card, prompt: int, seq: int, bp, notes, problems) -> None:
    r, m = cfg.rollout, cfg.model
    b = DTYPE_BYTES[m.dtype]
    per_dev = bp.per_device_batch  # completions per GPU per step
    if r.engine == "openai":
        notes.append("rollout.engine=openai: generation runs on another server; nothing planned for it here.")
        return
    if r.engine == "hf":
        gen = min(r.batch_size or per_dev, per_dev)
        if facts.ssm_state_per_seq:  # Mamba: fixed-size state, no per-token cache and no growth while decoding
            kv, growth = recurrent_state_bytes(facts, gen, m.dtype), 0
            items.append(Item(f"recurrent state (HF generate, {gen} sequences)", "rollout", rollout=kv,
                              note="layers x d_inner x (conv_kernel x dtype bytes + state_size x 4)"))
        rows = gen
        if uses_decode_loop(r, facts):  # one prefill per distinct prompt; a batch may straddle two groups
            g = stage_spec(cfg.stage).group_size(cfg)
            rows = min(gen, -(-gen // g) + (1 if gen % g else 0))
        static, graphs = static_cache(r, m, cfg.train, facts) if not facts.ssm_state_per_seq else (False, False)
        if static:  # whole at once; the prefill's cache of `rows` prompts is copied in (growth = that copy)

            cache_rows, length = (batch_bucket(gen), -(-seq // STATIC_LENGTH_STEP) * STATIC_LENGTH_STEP) if graphs \
                else (gen, seq)
            kv = facts.kv_elems(length, cache_rows) * b
            growth = facts.kv_elems(prompt, rows) * b
            items.append(Item(f"KV cache (static{', CUDA graphs' if graphs else ''}, {cache_rows} x {length} tokens)",
                              "rollout", rollout=kv, train=kv if graphs else 0,
                              note="2 x layers x kv_heads x head_dim x bytes x tokens"
                                   + ("; kept through training so the captured graphs replay" if graphs else "")))
        elif not facts.ssm_state_per_seq:
            kv = facts.kv_elems(seq, gen) * b
            growth = kv // max(1, facts.n_layers)
            items.append(Item(f"KV cache (HF generate, {gen} x {seq} tokens)", "rollout", rollout=kv,
                              note="2 x layers x kv_heads x head_dim x bytes x tokens"))
        prefill = int(tr.at("nograd_peak", prompt, rows))
        decode = gen * facts.vocab * sampling_bytes(r) + growth
        if static and graphs:  # the graph's logits output [rows, V] and the copy taken of it
            decode += 2 * cache_rows * facts.vocab * b
        items.append(Item("generation working set", "rollout", rollout=max(prefill, decode),
                          note=f"prefill forward of {rows} prompts" if prefill >= decode else "sampling + cache growth"))
        return
    envelope = int(r.gpu_memory_utilization * card.memory)
    # Tensor parallelism splits weights and KV heads over the engine's GPUs (field read if the config has it).
    tp = max(1, int(getattr(r, "tensor_parallel_size", 1) or 1))
    full = base_weight_bytes(facts, m.dtype)
    weights = full // tp
    act = profile_bytes(facts.hidden, facts.intermediate, facts.vocab, b, tp)   # the engine computes the same
    kv_room = kv_pool_bytes(card.memory, r.gpu_memory_utilization, full, act, tp)
    per_token = max(1, facts.kv_elems(1, 1) * b // tp)
    # A group of tp ranks shares one engine (rollout/vllm_engine.py): it generates all their completions
    # in its KV cache, whose capacity `cap` below counts over the group's GPUs.
    need = per_dev * seq * tp
    if kv_room <= 0:
        low = (weights + VLLM_GRAPH_RESERVE + act + seq * per_token) / card.memory
        head = (f"vLLM at rollout.gpu_memory_utilization={r.gpu_memory_utilization} ({envelope / 2**30:.1f} GiB) "
                f"has no room for a KV cache after {weights / 2**30:.1f} GiB of weights; ")
        if low <= 0.95:  # a fact, not advice: whether a larger share fits is planned by suggest.py
            problems.append(head + f"the engine alone needs {math.ceil(low * 20) / 20:.2f} of this card.")
        else:  # the share cannot exceed the card: only splitting the engine (or a bigger card) helps
            problems.append(head + f"the engine alone needs {low:.2f} of this card, so no share fits: split it over "
                            f"GPUs with rollout.tensor_parallel_size, or use a card with more memory.")
    else:
        cap = kv_room // per_token
        notes.append(f"vLLM envelope {envelope / 2**30:.1f} GiB = weights {weights / 2**30:.1f} + graphs/other "
                     f"{VLLM_GRAPH_RESERVE / 2**30:.1f} + activations {act / 2**30:.1f} + KV cache "
                     f"{kv_room / 2**30:.1f} GiB ({cap:,} tokens; this step needs {need:,}"
                     f"{', so generation runs in waves' if cap < need else ''}; kv_cache_memory_bytes={kv_room}).")
    if m.quantization != "none":
        notes.append(f"vLLM is planned with the base in {m.dtype} (its own copy), not the trainer's "
                     f"{m.quantization} weights.")
    if r.mode == "async":   # the worker samples with it while the trainer trains (train/async_rollout.py)
        items.append(Item(f"vLLM engine ({r.gpu_memory_utilization:.0%} of card, awake: rollout.mode=async)", "engine",
                          rollout=envelope, train=envelope,
                          note="the async worker samples with it during the training step: no sleep mode"))
        return
    asleep = {0: envelope, 1: VLLM_GRAPH_RESERVE, 2: VLLM_GRAPH_RESERVE}[r.sleep_level]
    items.append(Item(f"vLLM engine ({r.gpu_memory_utilization:.0%} of card, sleep level {r.sleep_level})", "engine",
                      rollout=envelope, train=asleep, cpu=weights if r.sleep_level == 1 else 0,
                      note="asleep: level 1 offloads weights to CPU RAM and drops the KV cache; 2 drops both"))


def vllm_min_utilization(cfg, facts, tr, card, seq: int) -> float:
    """Smallest gpu_memory_utilization (in steps of 0.05) that leaves vLLM a KV cache for the
    step's completions on this GPU (or at least 16 sequences at a time)."""
    b = DTYPE_BYTES[cfg.model.dtype]
    weights = base_weight_bytes(facts, cfg.model.dtype)
    act = profile_bytes(facts.hidden, facts.intermediate, facts.vocab, b)
    seqs = min(16, cfg.batch_plan().per_device_batch)
    need = weights + VLLM_GRAPH_RESERVE + act + facts.kv_elems(seq, seqs) * b
    return math.ceil(need / card.memory * 20) / 20


def async_items(Item, items, cfg, pol, seq: int, bp, notes, own_device: bool = False) -> None:
    """rollout.mode=async (train/async_rollout.py, sized by rollout/staleness.py): the worker's copy of the
    trainable tensors (frozen ones are shared) and the snapshots pushed while it samples, held through both
    phases; its generation, which runs while the trainer trains; and the rollouts queued in CPU RAM.
    `own_device` (distributed.rollout_gpus): the worker's GPU holds a whole copy (nothing can be shared
    across devices) and its generation is the rollout GPU's own phase, not a load on the training GPU."""
    r, k = cfg.rollout, cfg.rollout.max_staleness
    push = pol.adapters if pol.adapters else pol.trainable_params * DTYPE_BYTES[cfg.model.dtype]
    copy, what = push, "adapters" if pol.adapters else "trainable weights"
    if own_device:
        copy, what = pol.weights, "policy (whole, on the rollout GPU)"
    items.append(Item(f"async worker's copy of the {what}", "rollout", rollout=copy, train=copy,
                      note="trainer's tensors copied across devices after every step" if own_device else
                      "frozen tensors shared with the trainer"))
    if held_snapshots(k):
        items.append(Item(f"weights pushed while the worker samples ({held_snapshots(k)} snapshots)", "rollout",
                          rollout=held_snapshots(k) * push, train=held_snapshots(k) * push))
    during = sum(i.rollout for i in items if i.group == "rollout" and i.rollout and not i.train)
    if k and during and not own_device:
        items.append(Item("async worker's generation, during the training step", "rollout", train=during,
                          note="the rollout phase's cache and working set, sampled while the trainer trains"))
    if r.worker == "process":
        process_items(Item, items, cfg, pol, push)
    rows, new = bp.per_device_batch, r.max_new_tokens * r.max_turns
    queued = queued_rollouts(k) * queue_bytes(rows, seq, new)
    if queued:
        items.append(Item(f"async queue ({queued_rollouts(k)} rollout(s) x {rows} samples, CPU RAM)", "rollout",
                          cpu=queued, note="token ids, masks and behaviour log-probs of sampled rollouts"))
    notes.append(f"rollout.mode=async, max_staleness={k}: the worker samples rollout r with policy version r - {k} "
                 f"on its own copy of the {what}, while the trainer trains; up to {queued_rollouts(k)} rollout(s) "
                 "wait for the trainer.")


def process_items(Item, items, cfg, pol, push: int) -> None:
    """What rollout.worker=process adds to the thread worker (train/async_process.py): the push buffer the
    trainer writes each version into; the whole policy the child loads at its start (twice for a full
    fine-tune's KL reference), freed once it takes the trainer's shared frozen tensors; its runtime."""
    items.append(Item("async worker process's push buffer (shared memory)", "rollout", rollout=push, train=push,
                      note="the trainable tensors as last pushed, copied from there by the child"))
    start = pol.weights * (2 if cfg.grpo.beta > 0 and cfg.peft.method == "none" else 1)
    items.append(Item("async worker process's policy as loaded, at its start", "rollout", rollout=start,
                      note="before the child takes the trainer's shared frozen tensors (then freed); "
                           "counted in the rollout phase it starts in"))
    items.append(Item("async worker process's interpreter, libraries, tokenizer and task", "rollout",
                      cpu=WORKER_PROCESS_RUNTIME, note="measured with preset:tiny (rollout/staleness.py); the "
                                                       "trainer's own runtime is not counted"))
