"""The served policy: what `trainfit serve` loads, its LoRA adapters, and one batched generate call.

The model is loaded once. Adapters are attached to it with peft under their served names; a request
selects one by name (`set_adapter`) or the base (adapters disabled), so N adapters cost N adapter-sized
tensors, not N copies of the model. Generation runs through `HFEngine`, the trainer's own engine, so
sampling (per-row seeded Gumbel-max) and log-probs are exactly the trainer's.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

import torch
import yaml

from trainfit.config import ConfigError, ModelConfig, PeftConfig, RolloutConfig
from trainfit.rollout.base import Completion
from trainfit.rollout.hf import HFEngine


class SamplingKey(NamedTuple):
    """Requests with equal keys can share one generate call (same adapter, same warpers, same limits)."""
    adapter: Optional[str]      # None = the base model with adapters disabled
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int                  # 0 = off
    stop: tuple[str, ...]


@dataclass
class RunModel:
    """What a trainfit run directory holds for serving: a final model dir, or a checkpoint + its config."""
    name: str                              # a directory load_policy takes, or the run's model.name
    checkpoint: Optional[Path] = None      # step-N dir whose model.safetensors goes on top
    config: Optional[Path] = None          # the stage's config.yaml (model, peft) for a checkpoint


def _has_model(d: Path) -> bool:
    return (d / "config.json").is_file() or (d / "adapter_config.json").is_file()


def resolve_run_dir(path: Path) -> Optional[RunModel]:
    """The finished model of a trainfit run (or stage) directory, or a step-N checkpoint; None if it is
    not one of those.

    Stages are `<i>-<stage>/` in a pipeline run, else the run dir itself. A run dir serves its last
    stage's `final/` only: a run that stopped or is still training has no result yet, and serving an
    earlier stage's model or a checkpoint under the run's name would pass it off as the run's. It
    raises ConfigError naming the newest weights there are, to serve explicitly (a step-N dir serves).
    """
    if (path / "state.json").is_file() and (path / "model.safetensors").is_file():  # a step-N dir
        return RunModel("", checkpoint=path, config=path.parent.parent / "config.yaml")
    if not (path / "config.yaml").is_file() or _has_model(path):
        return None
    stages = sorted((p for p in path.iterdir() if p.is_dir() and re.fullmatch(r"\d+-\w+", p.name)),
                    key=lambda p: int(p.name.split("-", 1)[0]))
    count = _stage_count(path / "config.yaml")
    last = path if count <= 1 else next((p for p in stages if p.name.startswith(f"{count - 1}-")), None)
    if last is not None and _has_model(last / "final"):
        return RunModel(str(last / "final"))
    newest = _newest_weights(stages or [path])
    where = f"; the newest weights there are {newest}, which `trainfit serve {newest}` serves" if newest else ""
    raise ConfigError(f"{path} is a trainfit run without a final model (its last stage has not finished: the run is "
                      f"still training, stopped, or was restarted){where}. Serve the run dir once training has "
                      "finished, or resume it with `trainfit train <config> --resume`.")


def _stage_count(config_yaml: Path) -> int:
    """Stages of the run whose resolved config this is (0 or 1 = a single stage in the run dir itself)."""
    try:
        cfg = yaml.safe_load(config_yaml.read_text()) or {}
    except yaml.YAMLError:
        return 1
    return len(cfg.get("stages") or []) if isinstance(cfg, dict) else 1


def _newest_weights(stages: list[Path]) -> Optional[Path]:
    """The last stage's final/ or latest complete checkpoint, looking back from the last stage started."""
    from trainfit.train.checkpoint import latest_checkpoint

    for stage in reversed(stages):
        if _has_model(stage / "final"):
            return stage / "final"
        ckpt = latest_checkpoint(stage / "checkpoints")
        if ckpt is not None:
            return ckpt
    return None


@dataclass
class ServedPolicy:
    model: torch.nn.Module          # the base model; a peft PeftModel once an adapter is attached
    tokenizer: object
    name: str                       # the base model's served name
    source: str = ""                # what was loaded (shown in /v1/models as `root`)
    max_model_len: int = 0          # prompt + completion tokens at most (0 = unbounded)
    adapters: dict[str, str] = field(default_factory=dict)   # served name -> adapter directory
    # Held by generation and by adapter (un)loading: both touch the same peft module.
    lock: threading.RLock = field(default_factory=threading.RLock)
    processor: object = None        # vision-language models: a vision.images.VisionProcessor (image parts)
    notes: list[str] = field(default_factory=list)   # said once at start (a checkpoint served unverified)

    def __post_init__(self):
        if not self.max_model_len:
            self.max_model_len = int(getattr(self.model.config, "max_position_embeddings", 0) or 0)
        self.model.eval()

    def resolve(self, model: Optional[str]) -> Optional[str]:
        """A request's `model` field -> adapter name (None = base). KeyError for an unknown name."""
        if model is None or model == self.name:
            return None
        if model in self.adapters:
            return model
        raise KeyError(model)

    def is_peft(self) -> bool:
        return hasattr(self.model, "peft_config")

    def load_adapter(self, name: str, path: str, replace: bool = False) -> None:
        """Attach the peft adapter at `path` as `name`. ValueError / FileNotFoundError for bad input."""
        if name == self.name:
            raise ValueError(f"adapter name {name!r} is the base model's name; choose another lora_name.")
        if not (Path(path) / "adapter_config.json").is_file():
            raise FileNotFoundError(f"lora_path {path!r} holds no adapter_config.json (not a peft adapter directory).")
        with self.lock:
            if name in self.adapters:
                if not replace:
                    raise ValueError(f"the LoRA adapter {name!r} is already loaded; unload it first or "
                                     "pass load_inplace=true.")
                self._delete(name)
            if self.is_peft():
                self.model.load_adapter(path, adapter_name=name)
            else:
                from peft import PeftModel
                self.model = PeftModel.from_pretrained(self.model, path, adapter_name=name)
            self.model.eval()
            self.adapters[name] = path

    def unload_adapter(self, name: str) -> None:
        with self.lock:
            if name not in self.adapters:
                raise KeyError(name)
            self._delete(name)

    def _delete(self, name: str) -> None:
        del self.adapters[name]
        if self.adapters:
            self.model.delete_adapter(name)
        else:  # the last one: drop the peft wrapper and its (now empty) LoRA layers
            self.model = self.model.unload()

    def generate(self, key: SamplingKey, prompts: list[list[int]], seeds: Sequence[int],
                 batch_size: int = 0, images: Optional[Sequence[list]] = None) -> list[Completion]:
        """One batched generate for requests that share `key`; log-probs are always recorded.
        `images`: per prompt, the images its image tokens stand for (vision-language models)."""
        kw = {"images": images} if images is not None and any(images) else {}
        cfg = RolloutConfig(max_new_tokens=key.max_tokens, temperature=key.temperature, top_p=key.top_p,
                            top_k=key.top_k, stop=list(key.stop), batch_size=batch_size)
        with self.lock:
            if key.adapter is not None and key.adapter not in self.adapters:
                raise KeyError(key.adapter)  # unloaded while the request waited in the queue
            engine = HFEngine(self.model, self.tokenizer, cfg)
            engine.processor = self.processor
            if key.adapter is None and self.is_peft():
                with self.model.disable_adapter():
                    return engine.generate(prompts, seeds=list(seeds), logprobs=True, **kw)
            if key.adapter is not None:
                self.model.set_adapter(key.adapter)
            return engine.generate(prompts, seeds=list(seeds), logprobs=True, **kw)


def _dtype(dtype: str, device: torch.device) -> str:
    if dtype != "auto":
        return dtype
    return "bf16" if device.type == "cuda" else "fp32"  # CPU bf16 matmuls are slow and less exact


def load_served_policy(source: str, *, adapter: Optional[str] = None, device: str = "auto",
                       dtype: str = "auto", name: Optional[str] = None) -> ServedPolicy:
    """Load MODEL_OR_RUN_DIR (anything `load_policy` takes, or a trainfit run dir) for serving.

    `adapter` is a peft adapter directory, or NAME=DIR, attached on top under NAME (default: the
    directory's name). Adapters inside a run (PEFT training) are merged into their base.
    """
    from trainfit.models.policy import load_policy, resolve_device

    dev = resolve_device(device)
    mc = ModelConfig(name=source, dtype=_dtype(dtype, dev))
    run = resolve_run_dir(Path(source)) if Path(source).is_dir() else None
    notes = [checked_checkpoint(run.checkpoint)] if run is not None and run.checkpoint is not None else []
    if run is not None and run.checkpoint is None:
        loaded = load_policy(mc.model_copy(update={"name": run.name}), PeftConfig(), dev)
    elif run is not None:
        loaded = _load_checkpoint(run, mc.dtype, dev)
    else:
        loaded = load_policy(mc, PeftConfig(), dev)
    policy = ServedPolicy(loaded.model, loaded.tokenizer, name or source,
                          source=(run.name or str(run.checkpoint)) if run else source, processor=loaded.processor,
                          notes=[n for n in notes if n])
    if adapter:
        a_name, _, a_path = adapter.rpartition("=") if "=" in adapter else ("", "", adapter)
        try:
            policy.load_adapter(a_name or Path(a_path).name, a_path)
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(f"--adapter {adapter}: {e}") from None
    return policy


def checked_checkpoint(ckpt: Path) -> Optional[str]:
    """Verify a step-N checkpoint against its SHA-256 manifest before serving it: ConfigError when a file is
    damaged (serving it would answer with weights nobody trained); a note when it predates manifests."""
    from trainfit.train.ckpt_manifest import MANIFEST, verify

    check = verify(ckpt)
    if check.status == "bad":
        older = sorted(p.name for p in ckpt.parent.glob("step-*") if p.is_dir() and p.name < ckpt.name)
        other = (f"serve the checkpoint before it (`trainfit serve {ckpt.parent / older[-1]}`, verified the same way)"
                 if older else "serve the run's final model once it has one")
        raise ConfigError(f"checkpoint {ckpt} is damaged, so it is not served: {check.detail}. Copy it again from "
                          f"where it was written, or {other}.")
    if check.status == "unverified":
        return (f"note: {ckpt} has no {MANIFEST} (written before checkpoints carried checksums): serving it without "
                "verifying its files.")
    return None


def _load_checkpoint(run: RunModel, dtype: str, device: torch.device):
    from safetensors.torch import load_file

    from trainfit.config import load_config
    from trainfit.models.policy import load_policy
    from trainfit.models.state import load_trainable_state

    if run.config is None or not run.config.is_file():
        raise ConfigError(f"checkpoint {run.checkpoint} has no config.yaml beside its run; cannot tell which "
                          "model it was trained from.")
    cfg = load_config(str(run.config), [])
    mc = cfg.model.model_copy(update={"dtype": dtype, "gradient_checkpointing": False})
    loaded = load_policy(mc, cfg.peft, device, seed=cfg.train.seed)
    load_trainable_state(loaded.model, loaded.is_peft, load_file(str(run.checkpoint / "model.safetensors")))
    if loaded.is_peft:  # serve the trained policy as the base: merge the adapter into it
        loaded.model = loaded.model.merge_and_unload()
    return loaded
