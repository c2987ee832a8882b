"""Reading configs: YAML files and `key.sub=value` overrides into a validated `Config`, pipelines
(`stages:`) expanded into one Config per stage, and pydantic errors turned into one readable paragraph
naming the key, the value and the fix. The schema itself is trainfit/config.py.
"""

from __future__ import annotations

import copy
import difflib
from pathlib import Path
from typing import Any, Optional

import yaml
from pydantic import BaseModel, ValidationError

from trainfit.config import Config, ConfigError

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


def validate(raw: dict) -> Config:
    """Validate a raw mapping into a Config, turning pydantic errors into one readable paragraph."""
    try:
        return Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, raw)) from None


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


def deep_merge(a: dict, b: dict) -> dict:
    out = copy.deepcopy(a)
    for k, v in b.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def valid_keys() -> list[str]:
    """All dotted keys of the schema (for suggestions and docs)."""
    keys: list[str] = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, f"{prefix}{name}.")
            else:
                keys.append(prefix + name)
    walk(Config, "")
    return keys


def field_doc(dotted: str) -> Optional[str]:
    model: Any = Config
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        f = getattr(model, "model_fields", {}).get(part)  # a Union-typed field has no sub-fields
        if f is None:
            return None
        if i == len(parts) - 1:
            return f.description
        model = f.annotation
    return None


def format_validation_error(e: ValidationError, raw: dict) -> str:
    lines = []
    keys = valid_keys()
    errors, leaves = e.errors(), list(keys)
    keys += sorted({k.split(".")[0] for k in keys if "." in k})  # section names
    for n, err in enumerate(errors):
        loc = ".".join(str(x) for x in err["loc"] if not str(x).startswith("function-after"))
        member = _union_member(err["loc"], leaves)
        if member is not None:  # one error per member of an `auto | int` field: one sentence for the field
            loc, err = member, {**err, "loc": tuple(member.split(".")), "type": "union", "msg": " or ".join(
                _member_name(x) for x in errors if _union_member(x["loc"], leaves) == member)}
            if any(_union_member(x["loc"], leaves) == member for x in errors[:n]):
                continue
        if err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(loc, keys, n=1, cutoff=0.5)
            if not close:  # compare the leaf name within its section
                leaf = loc.split(".")[-1]
                close = difflib.get_close_matches(leaf, [k.split(".")[-1] for k in keys], n=1, cutoff=0.6)
                close = [k for k in keys if k.split(".")[-1] == close[0]][:1] if close else []
            hint = f"did you mean {close[0]!r}?" if close else "see `trainfit keys` for the valid keys."
            lines.append(f"Unknown config key {loc!r}; {hint}")
        elif err["type"] == "value_error":
            lines.append(str(err["msg"]).removeprefix("Value error, "))
        else:
            value = _lookup(raw, err["loc"])
            doc = field_doc(loc)
            allowed = _expected(err) if err["type"] != "union" else f"expected {err['msg']}"
            lines.append(f"Invalid value for {loc!r}: {value!r} ({allowed})."
                         + (f" {loc} is: {doc}" if doc else ""))
    return " ".join(lines)


def _expected(err: dict) -> str:
    return f"expected {err['ctx']['expected']}" if err.get("ctx", {}).get("expected") else err["msg"]


def _member_name(err: dict) -> str:
    """What one member of a Union-typed field accepts, in a few words."""
    if err.get("ctx", {}).get("expected"):
        return err["ctx"]["expected"]
    return "an integer" if err["type"].startswith("int_") else "a number" if err["type"].startswith("float_") else err["msg"]


def _union_member(loc: tuple, keys: list[str]) -> Optional[str]:
    """The key of a Union-typed field when `loc` names one of its members (train.cpu_threads.int), else None."""
    parts = [str(x) for x in loc]
    if ".".join(parts) in keys:
        return None
    for cut in range(len(parts) - 1, 1, -1):
        if ".".join(parts[:cut]) in keys:
            return ".".join(parts[:cut])
    return None


def _lookup(raw: Any, loc: tuple) -> Any:
    node = raw
    for part in loc:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            return "<missing>"
    return node


def expand_stages(cfg: Config) -> list[Config]:
    """A pipeline config becomes one Config per stage (base merged with the stage's overrides)."""
    if not cfg.stages:
        return [cfg]
    base = cfg.model_dump(exclude={"stages"})
    out = []
    for i, entry in enumerate(cfg.stages):
        if not isinstance(entry, dict) or "stage" not in entry:
            raise ConfigError(f"stages[{i}] must be a mapping with a `stage:` key (pretrain, sft, rm, dpo, grpo or ppo) and "
                              "the overrides for that stage.")
        merged = deep_merge(base, entry)
        try:
            out.append(validate(merged))
        except ConfigError as e:
            raise ConfigError(f"In stages[{i}] ({entry['stage']}): {e}") from None
    return out


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
