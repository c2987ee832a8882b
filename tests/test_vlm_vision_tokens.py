"""No engine lets a vision-language policy sample a vision token (a sampled image pad would be read as
an image by the next forward): the hf engine bans them in its logits (test_vlm_grpo.py); the openai
engine asks the server for it with `logit_bias`."""

from __future__ import annotations

import torch

from trainfit.config import ModelConfig, PeftConfig, RolloutConfig
from trainfit.models.policy import load_policy
from trainfit.rollout.base import Completion
from trainfit.rollout.openai_engine import OpenAIEngine
from trainfit.data.image_examples import vision_token_ids


def test_vision_token_ids_are_the_processor_special_tokens():
    loaded = load_policy(ModelConfig(name="preset:vlm-tiny"), PeftConfig(), torch.device("cpu"))
    proc, tok = loaded.processor, loaded.tokenizer
    ids = vision_token_ids(proc)
    assert {tok.convert_tokens_to_ids(t) for t in (proc.image_token, proc.start_token, proc.end_token)} <= set(ids)
    assert all(tok.convert_ids_to_tokens(i).startswith("<|") for i in ids) and vision_token_ids(None) == []


def test_openai_engine_asks_the_server_to_ban_vision_tokens(tmp_path, monkeypatch):
    # No server: what is checked is the request body the engine builds.
    monkeypatch.setattr(OpenAIEngine, "wait_healthy", lambda self, timeout_s: None)
    monkeypatch.setattr(OpenAIEngine, "models", lambda self: ["base"])
    loaded = load_policy(ModelConfig(name="preset:vlm-tiny"), PeftConfig(), torch.device("cpu"))
    eng = OpenAIEngine(RolloutConfig(engine="openai", base_url="http://127.0.0.1:9/v1"), loaded.tokenizer,
                       workdir=tmp_path)
    bodies: list[dict] = []
    eng._complete = lambda body: bodies.append(body) or Completion([1], "x", True, [0.0])
    try:
        eng.generate([[1, 2, 3]], seeds=[0])
        assert "logit_bias" not in bodies[-1]            # a text policy: nothing banned
        eng.processor = loaded.processor
        eng.generate([[1, 2, 3]], seeds=[0])
    finally:
        eng.close()
    assert bodies[-1]["logit_bias"] == {str(i): -100 for i in vision_token_ids(loaded.processor)}
