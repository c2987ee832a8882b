"""Rollout engines: generate completions for the trainer.

`hf` runs in-process on the trainer's module; `openai` talks to an OpenAI-compatible server (vLLM,
SGLang, `trainfit serve`) and syncs LoRA adapters to it; `vllm` runs a colocated vLLM in this process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from trainfit.config import ConfigError, ModelConfig, RolloutConfig
from trainfit.rollout.base import EngineError, RolloutEngine, StaleEngineError

__all__ = ["Completion", "EngineError", "HFEngine", "OpenAIEngine", "RolloutEngine", "StaleEngineError",
           "VLLMEngine", "build_engine"]


def __getattr__(name: str):
    # Imported on use: the hf engine needs torch and transformers (the planner reads rollout/ without them),
    # the openai engine httpx, the vllm one a GPU stack most runs never load.
    if name in ("Completion", "HFEngine"):
        from trainfit.rollout import hf
        return getattr(hf, name)
    if name == "OpenAIEngine":
        from trainfit.rollout.openai_engine import OpenAIEngine
        return OpenAIEngine
    if name == "VLLMEngine":
        from trainfit.rollout.vllm_engine import VLLMEngine
        return VLLMEngine
    raise AttributeError(f"module 'trainfit.rollout' has no attribute {name!r}")


def build_engine(cfg: RolloutConfig, model, tokenizer, stop: Sequence[str] = (), workdir: Optional[Path] = None,
                 model_cfg: Optional[ModelConfig] = None):
    """The engine `cfg.engine` names. `workdir` is the stage directory (default sync dir: workdir/rollout_sync).
    `model_cfg`: the policy's model section (vllm reads its image pixel limits)."""
    if cfg.engine == "hf":
        from trainfit.rollout.hf import HFEngine
        return HFEngine(model, tokenizer, cfg, stop)
    if cfg.engine == "openai":
        from trainfit.rollout.openai_engine import OpenAIEngine
        return OpenAIEngine(cfg, tokenizer, stop, workdir=workdir)
    if cfg.engine == "vllm":
        from trainfit.rollout.vllm_engine import VLLMEngine
        return VLLMEngine(cfg, model, tokenizer, stop, workdir=workdir, model_cfg=model_cfg)
    raise ConfigError(f"rollout.engine={cfg.engine!r} is not a known engine; use hf, openai or vllm.")
