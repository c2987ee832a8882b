"""Reading configs: YAML files and `key.sub=value` overrides into a validated `Config`, pipelines
(`stages:`) expanded into one Config per stage, and pydantic errors turned into one readable paragraph
naming the key, the value and the fix. The schema itself is trainfit/config.py.
"""


from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Optional

import yaml

from trainfit.config import errors
from trainfit.config.base import ConfigError, deep_merge
from trainfit.config.schema import Config, validate


def load_config(path: Optional[str | Path] = None, overrides: Optional[list[str]] = None,
                base: Optional[dict] = None) -> Config:
    """Load YAML (or start from `base`), apply `key.sub=value` overrides, validate. Raises ConfigError."""
    raw: dict = copy.deepcopy(base) if base else {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"Config file {str(p)!r} does not exist; pass the path to a YAML file such as examples/demo.yaml.")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p} is not valid YAML: {e}. Fix the syntax at the line shown.") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p} must hold a mapping of sections (model:, train:, ...), not a {type(loaded).__name__}.")
        raw = deep_merge(raw, loaded)
    for ov in overrides or []:
        raw = apply_override(raw, ov)
    return validate(raw)


def apply_override(raw: dict, override: str) -> dict:
    if "=" not in override:
        raise ConfigError(f"Override {override!r} is not of the form key=value; write e.g. train.lr=1e-5.")
    key, _, text = override.partition("=")
    key = key.strip()
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    if text.lstrip().startswith("#"):  # YAML would read it as a comment (None): task.answer_pattern=####\s*(.+)
        value = text.strip()
    out = copy.deepcopy(raw)
    node: Any = out
    parts = key.split(".")
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):  # a pipeline stage by index: stages.1.train.max_steps=5
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"Override {override!r}: {'.'.join(parts[:i]) or part!r} has {len(node)} entries; "
                                  f"write an index 0..{len(node) - 1}, e.g. {'.'.join(parts[:i])}.0.train.max_steps=5.")
            if last:
                node[int(part)] = value
            else:
                node = node[int(part)]
        elif last:
            node[part] = value
        else:
            node = node.setdefault(part, {})
            if not isinstance(node, (dict, list)):
                raise ConfigError(f"Override {override!r}: {part!r} is a value, not a section.")
    return out



def valid_keys() -> list[str]:
    """All dotted keys of the schema (for suggestions and docs)."""
    return errors.valid_keys(Config)


def field_doc(dotted: str) -> Optional[str]:
    """The description of a dotted key, e.g. train.lr."""
    return errors.field_doc(Config, dotted)


def format_validation_error(e, raw: dict) -> str:
    return errors.format_validation_error(Config, e, raw)


def compact(cfg: Config) -> str:
    """The values that differ from the defaults, as `key=value` pairs (what this run asked for)."""
    default = _schema_defaults()
    mine = _flatten(cfg.model_dump(mode="json", exclude={"stages"}))
    always = ("stage", "model.name", "task.name", "data.path")
    return " ".join(f"{k}={v}" for k, v in mine.items()
                    if default.get(k) != v or (k in always and v is not None))


def _schema_defaults() -> dict:
    """Every field's default, flattened. Built with `model_construct` so that no cross-field rule runs:
    a default config is not a valid run (task.name=jsonl needs task.path, ...) and must not be one."""
    return _flatten(Config.model_construct().model_dump(mode="json", exclude={"stages"}))


def _flatten(d: dict, prefix: str = "") -> dict:
    out: dict = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
