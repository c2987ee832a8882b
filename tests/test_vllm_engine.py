"""The colocated vLLM engine. The GPU tests need CUDA and `pip install 'trainfit[vllm]'`; run them with
`pytest -m gpu tests/test_vllm_engine.py`. The CPU tests check what needs no GPU."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from trainfit.config import ConfigError, ModelConfig, PeftConfig, RolloutConfig
from trainfit.models import load_policy
from trainfit.rollout import build_engine
from trainfit.rollout.base import StaleEngineError
from trainfit.rollout.sync_check import check_sync, probe_prompts
from trainfit.rollout.vllm_engine import _max_lora_rank

HAS_VLLM = importlib.util.find_spec("vllm") is not None
PROMPTS = [[19, 13, 20, 31], [5, 6], [40, 41, 42]]


@pytest.mark.skipif(HAS_VLLM, reason="vllm is installed")
def test_missing_vllm_says_how_to_install(tmp_path):
    lm = load_policy(ModelConfig(name="preset:tiny"), PeftConfig(), torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"pip install 'trainfit\[vllm\]'"):
        build_engine(RolloutConfig(engine="vllm"), lm.model, lm.tokenizer, workdir=tmp_path)


@pytest.mark.skipif(HAS_VLLM, reason="with vllm installed the ranks come from vllm's own list")
def test_max_lora_rank_rounds_up_to_an_allowed_value():
    assert [_max_lora_rank(r) for r in (1, 4, 8, 9, 16, 100, 300)] == [1, 8, 8, 16, 16, 128, 320]


@pytest.fixture(scope="module")
def colocated(tmp_path_factory):
    if not HAS_VLLM:
        pytest.skip("needs vllm: pip install 'trainfit[vllm]'")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from trainfit.rollout.vllm_engine import VLLMEngine

    dev = torch.device("cuda", 0)
    # preset:small: head_dim 32, which every vLLM attention backend supports (tiny's 16 is not).
    lm = load_policy(ModelConfig(name="preset:small", dtype="bf16"), PeftConfig(method="lora", r=8), dev)
    cfg = RolloutConfig(engine="vllm", gpu_memory_utilization=0.3, max_new_tokens=8, max_prompt_length=64,
                        sleep_level=1)
    engine = VLLMEngine(cfg, lm.model, lm.tokenizer, workdir=tmp_path_factory.mktemp("stage"))
    yield lm, engine, dev
    engine.close()


def perturb_lora(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_((torch.randn(p.shape, generator=g) * 0.2).to(p))


@pytest.mark.gpu
def test_vllm_generates_with_seeds(colocated):
    lm, engine, _ = colocated
    a = engine.generate(PROMPTS, seeds=[1, 2, 3], logprobs=True)
    b = engine.generate(PROMPTS, seeds=[1, 2, 3], logprobs=True)
    c = engine.generate(PROMPTS, seeds=[7, 8, 9])
    assert [x.token_ids for x in a] == [x.token_ids for x in b] != [x.token_ids for x in c]
    assert all(len(x.logprobs) == len(x.token_ids) > 0 for x in a) and c[0].logprobs is None
    assert a[0].text == lm.tokenizer.decode(a[0].token_ids, skip_special_tokens=True)


@pytest.mark.gpu
def test_vllm_lora_sync_passes_check_and_stale_fails(colocated):
    lm, engine, dev = colocated
    model, tok = lm.model, lm.tokenizer
    engine.wake()
    engine.sync(model)
    check_sync(engine, model, tok, dev, n_prompts=4, tolerance=0.05)
    before = engine.generate(probe_prompts(tok, 2), seeds=[0, 1], logprobs=True)
    perturb_lora(model, 1)
    with pytest.raises(StaleEngineError):  # trained but not synced
        check_sync(engine, model, tok, dev, n_prompts=4, tolerance=0.05)
    engine.sleep()  # a rollout round ends; the next one wakes and syncs
    engine.wake()
    engine.sync(model)
    assert engine.lora.lora_name == "trainfit-v2"
    check_sync(engine, model, tok, dev, n_prompts=4, tolerance=0.05)
    after = engine.generate(probe_prompts(tok, 2), seeds=[0, 1], logprobs=True)
    assert [x.logprobs for x in after] != [x.logprobs for x in before]
