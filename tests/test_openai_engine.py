"""The openai rollout engine against a real `trainfit serve` subprocess: health, seeds, log-probs, LoRA sync."""

from __future__ import annotations

import importlib.util
import os
import time

import httpx
import pytest
import torch

from trainfit.config import ConfigError, ModelConfig, PeftConfig, RolloutConfig
from trainfit.models.policy import load_policy
from trainfit.models.save import save_pretrained
from trainfit.rollout import build_engine
from trainfit.rollout.base import EngineError, StaleEngineError
from trainfit.rollout.hf import HFEngine
from trainfit.rollout.openai_engine import OpenAIEngine
from trainfit.rollout.sync_check import check_sync, probe_prompts
from serve_helpers import free_port, serve_subprocess

CPU = torch.device("cpu")
KEY_ENV = "TRAINFIT_TEST_SERVE_KEY"
PROMPTS = [[19, 13, 20, 31], [5, 6], [40, 41, 42]]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`trainfit serve` on a saved preset:tiny base, behind an API key; killed at the end."""
    tmp = tmp_path_factory.mktemp("serve")
    save_pretrained(load_policy(ModelConfig(name="preset:tiny"), PeftConfig(), CPU), tmp / "base")
    with serve_subprocess(tmp / "base", tmp / "server.log", "--batch-wait-ms", "20", "--served-model-name",
                          "tiny-base", "--api-key-env", KEY_ENV, env={KEY_ENV: "k3y"}) as (url, proc):
        yield {"url": url, "base": tmp / "base", "tmp": tmp, "proc": proc}


@pytest.fixture(scope="module")
def trainer(server):
    """The trainer's side: the same base with a fresh LoRA adapter (B = 0, so it starts as the base)."""
    return load_policy(ModelConfig(name=str(server["base"])), PeftConfig(method="lora", r=4), CPU)


@pytest.fixture(scope="module")
def engine(server, trainer):
    os.environ[KEY_ENV] = "k3y"
    cfg = RolloutConfig(engine="openai", base_url=server["url"], api_key_env=KEY_ENV, max_new_tokens=6,
                        health_timeout_s=90)
    with pytest.raises(httpx.ConnectError):  # the server is still starting: the engine has to wait
        httpx.get(server["url"].removesuffix("/v1") + "/health")
    try:
        eng = OpenAIEngine(cfg, trainer.tokenizer, workdir=server["tmp"])
    except EngineError:
        print((server["tmp"] / "server.log").read_text())
        raise
    yield eng
    eng.close()
    os.environ.pop(KEY_ENV, None)


def perturb_lora(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def test_waits_for_health_and_samples_with_seeds(engine, trainer):
    assert engine.base_model == "tiny-base" and engine.model_name == "tiny-base"
    a = engine.generate(PROMPTS, seeds=[1, 2, 3], logprobs=True)
    b = engine.generate(PROMPTS, seeds=[1, 2, 3], logprobs=True)
    c = engine.generate(PROMPTS, seeds=[4, 5, 6])
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c]
    assert all(len(x.token_ids) == 6 and len(x.logprobs) == 6 and not x.finished for x in a)
    assert c[0].logprobs is None  # not asked for
    # The server samples exactly as the trainer's own engine would (same weights, same seeds).
    ref = HFEngine(trainer.model, trainer.tokenizer, RolloutConfig(max_new_tokens=6)).generate(
        PROMPTS, seeds=[1, 2, 3], logprobs=True)
    assert [x.token_ids for x in a] == [x.token_ids for x in ref]
    assert max(abs(u - v) for x, y in zip(a, ref) for u, v in zip(x.logprobs, y.logprobs)) < 1e-4
    assert a[0].text == trainer.tokenizer.decode(a[0].token_ids, skip_special_tokens=True)


def test_lora_sync_is_verified_and_staleness_detected(engine, trainer, server):
    model, tok = trainer.model, trainer.tokenizer
    probe = probe_prompts(tok, 4)
    engine.sync(model)
    assert engine.model_name == "trainfit-v1" and "trainfit-v1" in engine.models()
    assert check_sync(engine, model, tok, CPU, n_prompts=4, tolerance=0.05).mean_abs_diff < 1e-4
    before = engine.generate(probe, seeds=[0, 1, 2, 3], logprobs=True)

    perturb_lora(model, seed=1)  # one "optimizer step"
    engine.sync(model)
    assert engine.model_name == "trainfit-v2"
    assert "trainfit-v2" in engine.models() and "trainfit-v1" not in engine.models()  # old one unloaded
    assert not (server["tmp"] / "rollout_sync" / "v1").exists() and (server["tmp"] / "rollout_sync" / "v2").is_dir()
    after = engine.generate(probe, seeds=[0, 1, 2, 3], logprobs=True)
    diffs = [abs(u - v) for x, y in zip(before, after) for u, v in zip(x.logprobs, y.logprobs)]
    assert sum(diffs) / len(diffs) > 0.05  # the server now samples from the new adapter
    report = check_sync(engine, model, tok, CPU, n_prompts=4, tolerance=0.05)
    assert report.mean_abs_diff < 1e-4 and report.tokens > 0

    perturb_lora(model, seed=2)  # trained again, but not synced: the engine is stale
    with pytest.raises(StaleEngineError, match="does not sample from the trained weights"):
        check_sync(engine, model, tok, CPU, n_prompts=4, tolerance=0.05)


def test_full_weight_model_cannot_sync(engine, server):
    plain = load_policy(ModelConfig(name=str(server["base"])), PeftConfig(), CPU)
    with pytest.raises(EngineError, match="adapters only"):
        engine.sync(plain.model)


def test_unreachable_server_fails_fast_naming_the_url(trainer):
    url = f"http://127.0.0.1:{free_port()}/v1"
    start = time.monotonic()
    with pytest.raises(EngineError, match=f"{url}.*did not become healthy"):
        OpenAIEngine(RolloutConfig(engine="openai", base_url=url, health_timeout_s=1), trainer.tokenizer)
    assert time.monotonic() - start < 5


def test_build_engine_dispatch(trainer, tmp_path):
    with pytest.raises(ConfigError, match="base_url"):
        build_engine(RolloutConfig(engine="openai"), trainer.model, trainer.tokenizer)
    assert isinstance(build_engine(RolloutConfig(), trainer.model, trainer.tokenizer), HFEngine)
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(ConfigError, match=r"trainfit\[vllm\]"):
            build_engine(RolloutConfig(engine="vllm"), trainer.model, trainer.tokenizer, workdir=tmp_path)
