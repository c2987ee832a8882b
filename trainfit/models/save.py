"""Saving a policy as a directory that plain transformers / peft load (full weights, or adapters over a
loadable base), with its tokenizer and image processor."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import torch

from trainfit.models.policy import LoadedModel
from trainfit.models.presets import parse_preset
from trainfit.models.save_shards import LazyWeights, write_shards

# A sharded model's final save reads its tensors one at a time (train/final_save.py); a one-process save passes none.
Gathered = Optional[Union[dict, LazyWeights]]


def save_pretrained(loaded: LoadedModel, out_dir: Path, base_dir: Optional[Path] = None,
                    state_dict: Gathered = None) -> Path:
    """Write a directory that plain transformers / peft can load.

    With adapters, the adapter config must point to a loadable base: a preset or an in-memory merge
    has no hub id, and a GGUF file is no transformers directory (its folder has no config.json), so
    the base (for GGUF: its dequantized weights, in the model's dtype) is saved once to `base_dir`
    and referenced by absolute path, which peft's `AutoPeftModelForCausalLM` resolves from any cwd.

    `state_dict`: a sharded model's whole tensors by name. Only what the files hold is read from it (the
    adapters, the base where one is saved), and whole weights are written a bounded shard at a time.
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
        # A sharded model's tensors: its trainable ones (the adapters), which peft saves.
        adapters = ({n: state_dict[n] for n, p in model.named_parameters() if p.requires_grad}
                    if state_dict is not None else None)
        model.save_pretrained(str(out_dir), **({"state_dict": adapters} if adapters is not None else {}))
        loaded.tokenizer.save_pretrained(str(out_dir))
    else:
        _save_plain(model, loaded.tokenizer, out_dir, state_dict=state_dict)
    if loaded.processor is not None:  # preprocessor_config.json: AutoImageProcessor loads it back
        loaded.processor.image_processor.save_pretrained(str(out_dir))
        if base_dir is not None and (base_dir / "config.json").exists():
            loaded.processor.image_processor.save_pretrained(str(base_dir))
    return out_dir


def _base_of(peft_state: Gathered) -> LazyWeights:
    """The base weights in a peft model's full state, under the base model's own names."""
    prefix = "base_model.model."
    return LazyWeights.of(peft_state).subset(lambda k: k.startswith(prefix) and "lora_" not in k,
                                             lambda k: k[len(prefix):].replace(".base_layer", ""))


def _save_plain(model, tokenizer, out_dir: Path, strip_peft: bool = False, state_dict: Gathered = None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    if state_dict is not None:  # a sharded model's whole tensors
        save_weights_streamed(model, out_dir, LazyWeights.of(state_dict))
    elif strip_peft:
        # Save the base weights without lora_* tensors, under the original module names.
        sd = {k.replace(".base_layer", ""): v for k, v in model.state_dict().items() if "lora_" not in k}
        model.save_pretrained(str(out_dir), state_dict=sd)
    else:
        model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))


def save_weights_streamed(model, out_dir: Path, weights: LazyWeights) -> None:
    """`model`'s config and `weights` (its tensors by the names transformers saves) as `save_pretrained`
    writes them, each tensor read only when its shard is written."""
    if _converts_weights(model):   # transformers renames or fuses tensors on save: it needs them all at once
        model.save_pretrained(str(out_dir), state_dict=dict(weights.items()))
        return
    write_shards(out_dir, weights)
    # What save_pretrained records beside the weights: the dtype, the class (FSDP2's wrapper class unnamed).
    # After the weights: a saved base counts as whole once its config.json is there (save_pretrained above).
    model.config.dtype = str(_dtype(model)).split(".")[1]
    model.config.architectures = [type(model).__name__.removeprefix("FSDP")]
    model.config.save_pretrained(str(out_dir))
    if model.can_generate():
        model.generation_config.save_pretrained(str(out_dir))


def _dtype(model) -> torch.dtype:
    """The first floating-point parameter's dtype, as transformers' `model.dtype`."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _converts_weights(model) -> bool:
    """transformers maps some models' tensors to other names or layouts on save (a conversion mapping)."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange
    except ImportError:   # another transformers: let it write, as it knows its own mappings
        return True
    found = getattr(model, "_weight_conversions", None)
    if found is None:   # as revert_weight_conversion decides for a model not loaded by from_pretrained
        found = [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]
    return bool(found)
