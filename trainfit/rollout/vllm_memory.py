"""The colocated vLLM engine's memory, in bytes, as both the planner (plan/rollout.py) and the engine
(rollout/vllm_engine.py) compute it: one function, so what the plan shows is what the engine asks for.

`rollout.gpu_memory_utilization` x the card is the engine's envelope (the user's knob). Inside it:
the engine's copy of the weights (split over tensor-parallel ranks), CUDA graphs and other non-torch
memory (VLLM_GRAPH_RESERVE, stated), the working set of its largest forward (`profile_bytes`: vLLM
profiles, and later prefills, max_num_batched_tokens tokens at a time), and the KV cache in what is left.
The engine passes that KV size as vLLM's `kv_cache_memory_bytes` (vllm/config/cache.py: "when not-None
[it] ignores gpu_memory_utilization" for sizing; vllm/v1/worker/gpu_worker.py determine_available_memory
returns it as is), so a vLLM release that sizes its pool differently cannot move the plan: between vLLM
0.20 and 0.25 the pool at the same utilization of 0.5 grew from 19.8 to 34.3 GiB. The utilization is
still passed: vLLM checks at start that that much of the card is free (v1/worker/utils.request_memory).
"""

from __future__ import annotations

GiB = 1024 ** 3
VLLM_GRAPH_RESERVE = 1 * GiB   # stated: CUDA graphs + non-torch allocations of vLLM; stays while asleep
VLLM_PROFILE_TOKENS = 8192     # vLLM's profiling forward (max_num_batched_tokens), passed by the engine
VLLM_MAX_SEQS = 256            # sequences a step samples at most (max_num_seqs), passed by the engine
# Passed on CUDA because vLLM's defaults move with the card and the release: 0.25 gives the LLM class
# 16384 tokens and 1024 sequences on a card of >= 70 GiB other than an A100, 8192 and 256 elsewhere
# (vllm/engine/arg_utils.py _get_default_max_num_seqs_and_batched_tokens).


def profile_bytes(hidden: int, intermediate: int, vocab: int, dtype_bytes: int, tp: int = 1,
                  tokens: int = VLLM_PROFILE_TOKENS, seqs: int = VLLM_MAX_SEQS) -> int:
    """The engine's largest forward: `tokens` tokens at the MLP's peak, where the residual and the normed
    input ([T, hidden] each) live beside the fused gate/up output ([T, 2 x intermediate]) and its
    activation ([T, intermediate]); two more [T, hidden] for the attention output and the next layer's
    input; then the sampler's fp32 logits and probabilities for `seqs` rows ([S, vocab] x 2). Intermediate
    sizes split over tensor-parallel ranks, the hidden size does not. A stated estimate: the GPU check
    compares it with vLLM's own profile."""
    return tokens * (4 * hidden + 3 * intermediate // max(1, tp)) * dtype_bytes + seqs * vocab * 4 * 2


def kv_pool_bytes(card_bytes: int, utilization: float, weight_bytes: int, activation_bytes: int,
                  tp: int = 1) -> int:
    """KV cache bytes per GPU: the envelope less the weights (each tensor-parallel rank holds 1/tp),
    the graph reserve and the profiling forward. Zero or less: the envelope has no room for a cache."""
    return int(utilization * card_bytes) - weight_bytes // max(1, tp) - VLLM_GRAPH_RESERVE - activation_bytes
