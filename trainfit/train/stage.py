"""The stage interface the optimizer loop (loop.py) and run.py drive: a stage is built from a config, prepares
each step's batch, computes the loss of a micro-batch, summarizes, evaluates, saves its own state and its
final model; and the batch it hands over. A stage's class is named in the stage table (config/stages.py,
`stage_class`) and bound here by that name, so the table needs no import of the trainer."""

from __future__ import annotations

import hashlib
import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Protocol, Sequence

import torch

from trainfit.config import Config, ConfigError
from trainfit.config.stages import StageSpec
from trainfit.core.dist import Ranks
from trainfit.models.compile import compile_blocks
from trainfit.models.images import is_vlm_config
from trainfit.models.policy import LoadedModel, load_policy, unwrap
from trainfit.models.save import save_pretrained
from trainfit.rollout import build_engine
from trainfit.tasks import build_task


@dataclass
class StepBatch:
    samples: list                           # one optimizer step's samples, in order
    totals: dict[str, float]                # whole-step normalisers (tokens, sequences) for the loss
    metrics: dict[str, float] = field(default_factory=dict)   # e.g. rollout rewards, lengths


class Stage(Protocol):
    task: Any                               # the task it samples or trains on, or None
    head: str                               # train.fused_head as resolved: off | chunked | liger
    data_notes: Sequence[str]               # what the data sources fed ("read 7473 rows of ...")

    @classmethod
    def build(cls, cfg: Config, stage_dir: Path, ranks: Ranks, device) -> tuple[LoadedModel, "Stage"]: ...
    def prepare(self, step: int) -> StepBatch: ...
    def loss(self, model, micro: list, totals: dict) -> tuple[torch.Tensor, dict[str, float]]: ...
    def summarize(self, batch: StepBatch, sums: dict[str, float]) -> dict[str, float]: ...
    def evaluate(self, model) -> dict[str, float]: ...
    def notices(self) -> list[str]: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...
    def close(self) -> None: ...
    def save_final(self, path: Path, state_dict=None) -> Path: ...


class BaseStage:
    """The defaults of the Stage interface: no task, the plain head, no data notes, no notices, and a
    final dir saved as a policy (a sharded model passes `state_dict`, the gathered full weights). `build`
    binds the loaded model and the stage dir the final save reads (`bound`)."""

    task: Any = None
    head: str = "off"
    data_notes: Sequence[str] = ()
    loaded: Optional[LoadedModel] = None
    stage_dir: Optional[Path] = None

    def bound(self, loaded: LoadedModel, stage_dir: Path) -> "BaseStage":
        self.loaded, self.stage_dir = loaded, stage_dir
        return self

    def notices(self) -> list[str]:
        return []

    def close(self) -> None:
        """Stop what the stage started besides the loop (threads, engines); called once the stage ends, however."""

    def save_final(self, path: Path, state_dict=None) -> Path:
        return save_pretrained(self.loaded, path, base_dir=self.stage_dir / "base", state_dict=state_dict)


def stage_class(spec: StageSpec) -> type:
    """The train/ class of a stage, from the table's `stage_class` ("module:Class")."""
    module, name = spec.stage_class.split(":")
    return getattr(importlib.import_module(module), name)


def policy_parts(cfg: Config, stage_dir: Path, ranks: Ranks, device) -> tuple[LoadedModel, Any, Optional[Any]]:
    """What a policy stage starts from: the policy (blocks compiled when asked, before any parallel wrapper),
    and with a task, the task and the rollout engine that samples it."""
    loaded = load_policy(cfg.model, cfg.peft, device, seed=cfg.train.seed)
    if cfg.train.compile:
        compile_blocks(loaded.model)
    task = build_task(cfg.task) if cfg.task.name else None
    engine = None
    if task is not None:
        engine = build_engine(cfg.rollout, loaded.model, loaded.tokenizer, stop=task.stop_strings(), workdir=stage_dir,
                              model_cfg=cfg.model)
        # Sharded weights are gathered inside every forward: all ranks must decode the same number of steps.
        engine.synced = ranks.distributed and cfg.engine() == "fsdp"
    stage_dir.mkdir(parents=True, exist_ok=True)
    return loaded, task, engine


@dataclass
class StageResult:
    stage_dir: Path
    final_dir: Path
    first_eval: dict[str, float]
    last_eval: dict[str, float]
    steps: int
    seconds: float


def padding_free(cfg: Config, model) -> bool:
    """train.padding_free resolved for a grpo / ppo / dpo stage and its policy (Config.padding_free). A
    vision-language policy places its image tokens and rope positions per row, so it trains padded:
    `auto` says nothing, `on` is a ConfigError."""
    vision = is_vlm_config(unwrap(model, peft=True).config)
    if vision and cfg.train.padding_free == "on" and cfg.padding_free():
        raise ConfigError(f"train.padding_free=on with a vision-language policy ({cfg.model.name}): packed rows are "
                          "for text models (image tokens and their positions are placed per row); set "
                          "train.padding_free=auto.")
    return cfg.padding_free(vision)


def step_seed(seed: int, step) -> int:
    """Every step reseeds from (seed, step), so a resumed run samples exactly what it would have."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{step}".encode()).digest()[:4], "little")
