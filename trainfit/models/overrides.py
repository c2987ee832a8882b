"""`model.config_overrides`: architecture numbers changed before a model is built.

One implementation for the planner and the trainer: shapes.model_source applies `merge_overrides` to
the architecture's config.json dict, which the planner counts and traces and from which the trainer
builds catalog, hub and preset architectures; for a local directory the trainer's config object, read
by transformers, gets the same applied dict through `set_overrides`.
"""

from __future__ import annotations

import difflib

from trainfit.config import ConfigError

# mamba_ssm's (and the guides' presets') names for the transformers MambaConfig fields.
ALIASES = {"d_state": "state_size", "d_conv": "conv_kernel", "d_model": "hidden_size", "n_layer": "num_hidden_layers"}


def known_keys(config: dict) -> set[str]:
    """Fields of an architecture's config: those in its config.json, plus the config class's defaults
    (config.json files omit some) and its aliases (`attribute_map`, e.g. GPT-2's n_layer)."""
    keys = set(config)
    try:
        from transformers import AutoConfig

        cls = type(AutoConfig.for_model(config["model_type"]))
        keys |= set(cls().to_dict()) | set(getattr(cls, "attribute_map", {}) or {})
    except Exception:  # a remote-code or unknown model type: its config.json is all we know
        pass
    return keys - {"model_type", "transformers_version", "_name_or_path", "architectures"}


def merge_overrides(config: dict, overrides: dict, name: str, where: str = "") -> dict:
    """The overrides to apply to `config` (a config.json dict): keys checked against the architecture
    (ConfigError naming an unknown key and its close matches), mamba_ssm aliases resolved, nested dicts
    merged into sub-configs (text_config...), and per-layer lists made to follow a new layer count."""
    out: dict = {}
    known = None
    for key, value in overrides.items():
        if key not in config:
            known = known if known is not None else known_keys(config)
            if key not in known and ALIASES.get(key) in known:
                key = ALIASES[key]
            if key not in known:
                close = difflib.get_close_matches(key, sorted(known), n=5, cutoff=0.5)
                hint = (f"close matches: {', '.join(close)}" if close else "its fields include "
                        + ", ".join(sorted(k for k in config if not k.startswith("_"))[:30]))
                raise ConfigError(f"model.config_overrides has {where}{key!r}, which the architecture of {name!r} "
                                  f"({config.get('model_type', '?')}) does not have; {hint}. Use the field names "
                                  "of its config.json.")
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            out[key] = merge_overrides(config[key], value, name, f"{where}{key}.")
        else:
            out[key] = value
    layers = out.get("num_hidden_layers")
    if isinstance(layers, int):
        # Per-layer lists follow the layer count (as plan/trace.trace_config does for its reduced copy).
        if config.get("layer_types") and "layer_types" not in out:
            lt = list(config["layer_types"])
            out["layer_types"] = [lt[i % len(lt)] for i in range(layers)]
        if config.get("mlp_only_layers") and "mlp_only_layers" not in out:
            out["mlp_only_layers"] = [i for i in config["mlp_only_layers"] if i < layers]
    return out


def set_overrides(obj, applied: dict) -> None:
    """Apply `merge_overrides`' result to a transformers config object (sub-configs recursively)."""
    for k, v in applied.items():
        sub = getattr(obj, k, None)
        if isinstance(v, dict) and sub is not None and hasattr(sub, "to_dict"):
            set_overrides(sub, v)
        else:
            setattr(obj, k, v)
