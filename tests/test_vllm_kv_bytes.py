"""The colocated vLLM engine's KV cache in bytes: one function (rollout/vllm_memory.py) gives the plan's
KV row and the engine's `kv_cache_memory_bytes`, so a vLLM release cannot move the plan. CPU only, no vllm:
the engine's arguments come from its pure helper, fed the model the trainer holds."""

import re
import sys
from pathlib import Path

import pytest
import torch

from trainfit.config import ConfigError
from trainfit.plan import plan
from trainfit.rollout.vllm_engine import cuda_memory_kwargs, weight_bytes
from trainfit.rollout.vllm_memory import (GiB, VLLM_GRAPH_RESERVE, VLLM_MAX_SEQS, VLLM_PROFILE_TOKENS, kv_pool_bytes,
                                          profile_bytes)

sys.path.insert(0, str(Path(__file__).parent))
from conftest import tiny_config  # noqa: E402


def test_kv_pool_is_the_envelope_less_weights_graphs_and_profile_forward():
    # Qwen3-8B-like: hidden 4096, intermediate 12288, vocab 151936, bf16. Profile forward of 8192 tokens:
    # 8192 x (4 x 4096 + 3 x 12288) x 2 = 872,415,232; sampler 256 rows x 151936 x 4 x 2 = 311,164,928;
    # together 1,183,580,160 bytes.
    act = profile_bytes(4096, 12288, 151936, 2)
    assert act == 1_183_580_160
    # 0.5 of an 80 GiB card = 40 GiB; less 16 GiB of weights, 1 GiB reserve and the forward:
    # 42,949,672,960 - 17,179,869,184 - 1,073,741,824 - 1,183,580,160 = 23,512,481,792.
    assert VLLM_GRAPH_RESERVE == GiB
    assert kv_pool_bytes(80 * GiB, 0.5, 16 * GiB, act) == 23_512_481_792
    # Tensor parallel 2: each rank holds 8 GiB of weights and half the MLP's intermediate:
    # 8192 x (16384 + 18432) x 2 + 311,164,928 = 881,590,272;
    # 42,949,672,960 - 8,589,934,592 - 1,073,741,824 - 881,590,272 = 32,404,406,272.
    assert kv_pool_bytes(80 * GiB, 0.5, 16 * GiB, profile_bytes(4096, 12288, 151936, 2, tp=2), tp=2) == 32_404_406_272


def _kv_row(p) -> int:
    note = next(n for n in p.notes if "kv_cache_memory_bytes=" in n)
    return int(re.search(r"kv_cache_memory_bytes=(\d+)", note).group(1))


@pytest.mark.parametrize("util", [0.3, 0.6])
def test_engine_asks_vllm_for_the_kv_bytes_the_plan_shows(tmp_path, tiny_lm, util):
    """The plan of preset:tiny with rollout.engine=vllm on an H200, and the arguments the engine builds on
    CUDA from the model it is given (random init, CPU): the same KV bytes, and the envelope as the knob."""
    cfg = tiny_config(tmp_path, "grpo", **{"rollout.engine": "vllm", "rollout.gpu_memory_utilization": util})
    p = plan(cfg, gpu="h200", suggest=False)
    model, _ = tiny_lm
    dtype = next(model.parameters()).dtype
    kwargs = cuda_memory_kwargs(cfg.rollout, model.config, weight_bytes(model), dtype, p.gpu_memory)
    assert kwargs["kv_cache_memory_bytes"] == _kv_row(p)
    assert kwargs["gpu_memory_utilization"] == util and kwargs["enable_sleep_mode"] is True
    # the profiling forward's sizes are passed, not left to vLLM's card-dependent defaults
    assert (kwargs["max_num_batched_tokens"], kwargs["max_num_seqs"]) == (VLLM_PROFILE_TOKENS, VLLM_MAX_SEQS)


def test_engine_refuses_an_envelope_without_room_for_a_kv_cache(tmp_path, tiny_lm):
    cfg = tiny_config(tmp_path, "grpo", **{"rollout.engine": "vllm", "rollout.gpu_memory_utilization": 0.01})
    model, _ = tiny_lm
    with pytest.raises(ConfigError, match="rollout.gpu_memory_utilization=0.01"):
        cuda_memory_kwargs(cfg.rollout, model.config, weight_bytes(model), torch.float32, 24 * GiB)
