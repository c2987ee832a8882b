"""`trainfit serve`: the policy behind an OpenAI-compatible HTTP API (FastAPI + uvicorn).

    trainfit serve runs/demo --port 8000                    # a run dir: its final model (or latest checkpoint)
    trainfit serve preset:tiny --adapter out/final          # a base model with a LoRA adapter on top
    curl localhost:8000/v1/completions -d '{"prompt": "12+7=", "max_tokens": 8, "seed": 1}' \\
         -H 'content-type: application/json'

Agent harnesses and eval tools talk to it as to OpenAI or vLLM; `rollout.engine: openai` trains against
it (or against `vllm serve --enable-lora`) by pushing LoRA adapters through /v1/load_lora_adapter.
"""

from __future__ import annotations

import importlib

# Lazy: `trainfit.app.serve.commands` is imported by every CLI start, which must not pay for torch/fastapi.
_EXPORTS = {"create_app": "app", "Batcher": "batcher", "SamplingKey": "policy", "ServedPolicy": "policy",
            "load_served_policy": "policy", "resolve_run_dir": "policy"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"trainfit.app.serve.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'trainfit.app.serve' has no attribute {name!r}")
