"""Saving a policy as a directory that plain transformers / peft load (full weights, or adapters over a
loadable base), with its tokenizer and image processor."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from trainfit.models.policy import LoadedModel
from trainfit.models.presets import parse_preset


def save_pretrained(loaded: LoadedModel, out_dir: Path, base_dir: Optional[Path] = None,
                    state_dict: Optional[dict] = None) -> Path:
    """Write a directory that plain transformers / peft can load.

    With adapters, the adapter config must point to a loadable base: a preset or an in-memory merge
    has no hub id, and a GGUF file is no transformers directory (its folder has no config.json), so
    the base (for GGUF: its dequantized weights, in the model's dtype) is saved once to `base_dir`
    and referenced by absolute path, which peft's `AutoPeftModelForCausalLM` resolves from any cwd.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    model = loaded.model
    if loaded.is_peft:
        base_ref = loaded.source
        if loaded.from_gguf or parse_preset(loaded.source) or not (Path(base_ref).exists() or "/" in base_ref):
            assert base_dir is not None, "an adapter over a generated base needs base_dir"
            if not (base_dir / "config.json").exists():
                base = model.get_base_model()
                with model.disable_adapter():
                    _save_plain(base, loaded.tokenizer, base_dir, strip_peft=True,
                                state_dict=_base_of(state_dict) if state_dict is not None else None)
            base_ref = str(base_dir.resolve())
        for cfg in model.peft_config.values():
            cfg.base_model_name_or_path = base_ref
        # A sharded model's gathered tensors (by name): peft picks its adapters out of them.
        model.save_pretrained(str(out_dir), **({"state_dict": state_dict} if state_dict is not None else {}))
        loaded.tokenizer.save_pretrained(str(out_dir))
    else:
        _save_plain(model, loaded.tokenizer, out_dir, state_dict=state_dict)
    if loaded.processor is not None:  # preprocessor_config.json: AutoImageProcessor loads it back
        loaded.processor.image_processor.save_pretrained(str(out_dir))
        if base_dir is not None and (base_dir / "config.json").exists():
            loaded.processor.image_processor.save_pretrained(str(base_dir))
    return out_dir


def _base_of(peft_state: dict) -> dict:
    """The base weights in a peft model's full state, under the base model's own names."""
    prefix = "base_model.model."
    return {k[len(prefix):].replace(".base_layer", ""): v for k, v in peft_state.items()
            if k.startswith(prefix) and "lora_" not in k}


def _save_plain(model, tokenizer, out_dir: Path, strip_peft: bool = False, state_dict: Optional[dict] = None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    if state_dict is not None:  # gathered full weights of a sharded model
        model.save_pretrained(str(out_dir), state_dict=state_dict)
    elif strip_peft:
        # Save the base weights without lora_* tensors, under the original module names.
        sd = {k.replace(".base_layer", ""): v for k, v in model.state_dict().items() if "lora_" not in k}
        model.save_pretrained(str(out_dir), state_dict=sd)
    else:
        model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
