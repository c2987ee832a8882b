"""Static-cache decoding (rollout.hf_cache=static) computes what the dynamic loop computes.

The static path preallocates the KV cache at rows x (prompt + max_new_tokens), keeps finished rows in
the batch (fed padding) and, on CUDA, replays the decode step as a CUDA graph. On CPU it must return
the same tokens, finish flags and log-probs (within 1e-5) as the dynamic loop, with the same seeds.
"""

from __future__ import annotations

import pytest
import torch

from trainfit.config import ModelConfig, PeftConfig, RolloutConfig
from trainfit.models.policy import load_policy
from trainfit.rollout.decode import (STATIC_LENGTH_STEP, StaticDecoder, batch_bucket, decode, seeded_pick,
                                     supports_static_cache)
from trainfit.rollout.hf import HFEngine

CPU = torch.device("cpu")
# Two distinct prompts of different lengths, each 4 times (a GRPO group shape), plus a singleton.
PROMPTS = [[19, 13, 20, 31]] * 4 + [[5, 7]] * 4 + [[40, 41, 42, 43, 44, 45, 46]]


@pytest.fixture(scope="module")
def policy():
    return load_policy(ModelConfig(name="preset:tiny", seed=2), PeftConfig(), CPU)


def both(model, tok, cfg: RolloutConfig, **kw):
    """(static, dynamic) completions of the same call through HFEngine's decoding loop."""
    out = []
    for cache in ("static", "dynamic"):
        eng = HFEngine(model, tok, cfg.model_copy(update={"decoder": "trainfit", "hf_cache": cache}))
        out.append(eng.generate(PROMPTS, **kw))
        assert (eng._static is not None) == (cache == "static")
    return out


def assert_same(a_list, b_list, atol=1e-5):
    for a, b in zip(a_list, b_list, strict=True):
        assert a.token_ids == b.token_ids and a.text == b.text and a.finished == b.finished
        assert len(a.logprobs) == len(b.logprobs)
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=atol, rtol=0)


@pytest.mark.parametrize("kw", [
    dict(greedy=True, logprobs=True),
    dict(seeds=list(range(9)), logprobs=True),
    dict(seeds=list(range(100, 109)), logprobs=True, temperature=0.7),
])
def test_static_equals_dynamic(policy, kw):
    static, dynamic = both(policy.model, policy.tokenizer, RolloutConfig(max_new_tokens=12), **kw)
    assert_same(static, dynamic)
    assert len({tuple(c.token_ids) for c in static[:4]}) > 1 or kw.get("greedy")  # sampled rows differ


def test_static_equals_dynamic_with_stops_top_k_top_p_and_lora():
    lm = load_policy(ModelConfig(name="preset:tiny", seed=5), PeftConfig(method="lora", r=4), CPU)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in lm.model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    # Common letters as stop strings, so rows finish at different steps while others go on.
    cfg = RolloutConfig(max_new_tokens=16, top_k=20, top_p=0.9, stop=["e", "q"])
    static, dynamic = both(lm.model, lm.tokenizer, cfg, seeds=list(range(9)), logprobs=True)
    assert_same(static, dynamic)
    lengths = {len(c.token_ids) for c in static}
    assert any(c.finished and len(c.token_ids) < 16 for c in static) and len(lengths) > 1  # ended early, apart


def test_buckets_spare_rows_and_the_kept_cache(policy):
    """Bucketed as on CUDA (without compiling): 9 rows run as 16, the cache is kept and reused by a
    shorter call and by a smaller batch, replaced by a longer call (lengths in steps of 128 tokens);
    every call equals the dynamic loop."""
    model, eos = policy.model, policy.tokenizer.eos_token_id
    assert batch_bucket(9) == 16 and batch_bucket(3) == 8 and batch_bucket(16) == 16
    dec = StaticDecoder(model, compiled=False, bucketed=True)
    seen = []
    for prompts, max_new in ((PROMPTS, 10), (PROMPTS[::-1], 6), (PROMPTS, 125), (PROMPTS[3:6], 5)):
        pick = seeded_pick([], list(range(len(prompts))), greedy=False)
        kw = dict(pad_id=0, eos_id=eos, max_new=max_new, pick=pick, logprob_temperature=1.0)
        a = decode(model, prompts, static=dec, **kw)
        b = decode(model, prompts, **kw)
        assert torch.equal(a.tokens, b.tokens)
        assert torch.allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
        (rows, cache), = dec.pool.items()
        assert rows == 16 and cache.layers[0].keys.shape[0] == 16
        seen.append((cache, cache.layers[0].max_cache_len))
    assert seen[0][1] == STATIC_LENGTH_STEP == 128                      # 7 + 10 tokens, rounded up
    assert seen[1][0] is seen[0][0]                                      # the shorter call reused it
    assert seen[2][0] is not seen[0][0] and seen[2][1] == 256           # 7 + 125 > 128: a longer cache
    assert seen[3][0] is seen[2][0]   # 3 rows (bucket 8) run in the kept 16-row cache: no second cache


def test_hf_cache_auto_is_dynamic_on_cpu_and_static_needs_full_attention(policy):
    eng = HFEngine(policy.model, policy.tokenizer, RolloutConfig())
    assert eng.cfg.hf_cache == "auto" and eng._static_decoder() is None       # CPU: dynamic
    eng = HFEngine(policy.model, policy.tokenizer, RolloutConfig(hf_cache="static"))
    dec = eng._static_decoder()
    assert dec is not None and not dec.compiled and not dec.bucketed           # no CUDA graphs on CPU
    eng.synced = True
    assert eng._static_decoder() is None                                      # FSDP keeps the dynamic loop
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, sliding_window=8)
    cfg._attn_implementation = "sdpa"
    assert not supports_static_cache(MistralForCausalLM(cfg))                 # sliding window: dynamic
    assert supports_static_cache(policy.model)


@pytest.mark.gpu
def test_cuda_graph_step_equals_dynamic_and_replays():
    """On CUDA: the compiled (CUDA-graph) static path returns the dynamic loop's tokens and log-probs,
    and a second call of another batch size in the same bucket reuses the kept cache. Every decode
    step replays a graph (no cudagraph skip), and a second round of the same calls compiles nothing."""
    from torch._dynamo.utils import counters

    counters.clear()
    dev = torch.device("cuda")
    lm = load_policy(ModelConfig(name="preset:tiny", seed=2, dtype="fp32"), PeftConfig(), dev)
    cfg = RolloutConfig(max_new_tokens=12, decoder="trainfit")
    graphs = HFEngine(lm.model, lm.tokenizer, cfg.model_copy(update={"hf_cache": "static"}))
    plain = HFEngine(lm.model, lm.tokenizer, cfg.model_copy(update={"hf_cache": "dynamic"}))
    compiled_frames = []
    for _ in range(2):
        for prompts in (PROMPTS, PROMPTS[:7]):
            for kw in (dict(greedy=True, logprobs=True), dict(seeds=list(range(len(prompts))), logprobs=True)):
                a, b = graphs.generate(prompts, **kw), plain.generate(prompts, **kw)
                for x, y in zip(a, b, strict=True):
                    assert x.token_ids == y.token_ids and x.finished == y.finished
                    assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4, rtol=0)
        compiled_frames.append(counters["frames"]["ok"])
    assert graphs._static.compiled and list(graphs._static.pool) == [16]
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert compiled_frames[1] == compiled_frames[0] > 0      # captured in the first round, replayed in the second
