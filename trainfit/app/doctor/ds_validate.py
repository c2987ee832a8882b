"""A DeepSpeed JSON through DeepSpeed's own config classes, where DeepSpeed is installed.

`deepspeed.initialize` builds `deepspeed.runtime.config.DeepSpeedConfig` from the file before anything
else; its sections are pydantic models (DeepSpeedZeroConfig with its offload_optimizer /
offload_param models, DeepSpeedFP16Config, DeepSpeedBF16Config, ...) that forbid unknown keys and
check types, enums and cross-field rules, plus a few asserts of its own. Building that object here
reports, before a job is launched, every setting the engine would refuse at start: a misspelt or
misplaced key (`aio` inside zero_optimization, fp16's loss-scale keys under bf16), an offload
device that does not exist, partial offload below ZeRO-3, bf16_optimizer_states without its
bf16_master_weights_and_grads companion.

DeepSpeedConfig does not need torch.distributed: without it the world size reads as 1. The batch
keys are therefore replaced by a consistent 1 x 1 here; trainfit's own batch rule (lint_deepspeed,
DeepSpeed's arithmetic with the job's world size) checks them. "auto" values are removed, as the HF
integration fills them (and ds.auto_unfilled reports them where nothing does), and fp16 + bf16 both
on (ds.fp16_and_bf16) is not reported twice. A section DeepSpeed rejects is reported and dropped,
and the rest validated again, so one call reports every rejected section.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import io
import logging
import re
import sys
from typing import Any, Optional

from trainfit.app.doctor.findings import Finding

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# pydantic model (error title) -> the key of the section it validates.
SECTIONS = {"DeepSpeedZeroConfig": "zero_optimization", "DeepSpeedFP16Config": "fp16", "DeepSpeedBF16Config": "bf16",
            "CompileConfig": "compile", "DeepSpeedTPConfig": "tensor_parallel",
            "WeightQuantConfig": "weight_quantization"}
# Top-level sections, to say where a key misplaced inside another section belongs.
TOP_LEVEL = ("aio", "optimizer", "scheduler", "fp16", "bf16", "zero_optimization", "activation_checkpointing",
             "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comms_logger", "checkpoint", "data_types",
             "gradient_clipping", "steps_per_print", "wall_clock_breakdown", "compile")
MAX_ROUNDS = 8


def deepspeed_module() -> tuple[Optional[Any], str]:
    """(deepspeed.runtime.config, version), or (None, why) when DeepSpeed does not import here. Its
    import logs the accelerator it picks to stdout: kept off doctor's output (--json must stay JSON)."""
    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(io.StringIO()):
            import deepspeed
            from deepspeed.runtime import config as ds_config
            from deepspeed.utils import logger
    except ImportError:
        return None, "DeepSpeed is not installed here"
    except Exception as e:  # a broken install (CUDA mismatch, missing ops) is the user's to see, not a crash
        return None, f"DeepSpeed did not import here ({type(e).__name__}: {str(e)[:120]})"
    for h in logger.handlers:  # a first import made its stdout handler on the buffer: give it stdout back
        if isinstance(h, logging.StreamHandler) and h.stream is buf:
            h.setStream(sys.stdout)
    return ds_config, getattr(deepspeed, "__version__", "?")


def validate(d: dict, path: str) -> list[Finding]:
    """Findings for what DeepSpeed's config classes reject in `d` (the parsed file), or one info
    finding saying the check was skipped where DeepSpeed does not import."""
    ds_config, version = deepspeed_module()
    if ds_config is None:
        return [Finding("ds.unvalidated", "info", f"{version}, so this file was not validated by DeepSpeed's own "
                        "config classes (trainfit's checks ran; unknown or misplaced keys inside sections, bad "
                        "values and DeepSpeed's cross-field rules were not checked).",
                        "Install the DeepSpeed the job uses (pip install 'trainfit[deepspeed]') and run doctor "
                        "again.", path)]
    work = _normalised(d)
    out: list[Finding] = []
    for _ in range(MAX_ROUNDS):
        err, warned = _build(ds_config, work)
        out += [_deprecated(m, path) for m in warned]
        if err is None:
            break
        found, section = _findings(err, work, version, path)
        out += found
        if section is None or section not in work:
            break  # cannot tell which section failed: validating again would report the same error
        work.pop(section)
    return _unique(out)


def _normalised(d: dict) -> dict:
    """The file as DeepSpeed should read it here: batch keys 1 x 1 (checked by trainfit's rule with
    the world size), no "auto" (the HF integration fills them), fp16 off when bf16 is also on."""
    work = _drop_auto(copy.deepcopy(d))
    for k in BATCH_KEYS:
        work.pop(k, None)
    work["train_micro_batch_size_per_gpu"], work["gradient_accumulation_steps"] = 1, 1
    fp16, bf16 = work.get("fp16"), work.get("bf16", work.get("bfloat16"))
    if isinstance(fp16, dict) and isinstance(bf16, dict) and fp16.get("enabled") and bf16.get("enabled"):
        fp16["enabled"] = False  # reported as ds.fp16_and_bf16
    return work


def _drop_auto(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _drop_auto(v) for k, v in x.items() if not (isinstance(v, str) and v.strip().lower() == "auto")}
    return x


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _build(ds_config, work: dict) -> tuple[Optional[Exception], list[str]]:
    """(the exception DeepSpeedConfig raised or None, DeepSpeed's deprecation warnings)."""
    from deepspeed.utils import logger

    collect, level, propagate = _Collect(), logger.level, logger.propagate
    saved = list(logger.handlers)
    logger.handlers, logger.propagate = [collect], False  # DeepSpeed logs to stdout: collected instead
    logger.setLevel(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            ds_config.DeepSpeedConfig(copy.deepcopy(work))
        err = None
    except Exception as e:  # pydantic ValidationError, AssertionError, ValueError, DeepSpeedConfigError, ...
        err = e
    finally:
        logger.handlers, logger.propagate = saved, propagate
        logger.setLevel(level)
    return err, [m for m in collect.messages if "deprecated" in m]


def _deprecated(message: str, path: str) -> Finding:
    first = message.strip().splitlines()[0][:240]
    m = re.search(r"Config parameter (\w+) is deprecated(?: use (\S+) instead)?", message)
    if m and m.group(2):
        fix = f"Replace {m.group(1)} with {m.group(2)}."
    elif "format of ZeRO optimization" in message:
        fix = 'Write "zero_optimization": {"stage": N} (a mapping) instead of true / false.'
    else:
        fix = (f"Remove or replace {m.group(1) if m else 'the key named'} (DeepSpeed's config docs give the "
               "current key).")
    return Finding("ds.deprecated", "warning", f"DeepSpeed warns: {first}", fix, path)


def _findings(err: Exception, work: dict, version: str, path: str) -> tuple[list[Finding], Optional[str]]:
    """Findings for one failed DeepSpeedConfig build, and the top-level section that failed."""
    from pydantic import ValidationError

    head = f"DeepSpeed {version} rejects this file when the engine starts"
    if isinstance(err, ValidationError):
        section = SECTIONS.get(err.title) or _section_of(work, err.errors())
        if section == "bf16" and "bf16" not in work and "bfloat16" in work:
            section = "bfloat16"
        out = []
        for e in err.errors():
            loc = [str(x) for x in e["loc"]]
            key = ".".join(([section] if section else []) + loc) or (section or "?")
            reason = _reason(e)
            out.append(Finding("ds.rejected", "error", f"{head}: {key}: {reason} ({err.title}).",
                               _fix(e, key, loc, err.title, work), path))
        return out, section
    msg = str(err).strip() or type(err).__name__
    section = next((sec for title, sec in SECTIONS.items() if title in msg), None)
    if section and "must be a mapping" in msg:  # e.g. "fp16": true where DeepSpeed reads {"enabled": true}
        example = '{"stage": 2}' if section == "zero_optimization" else '{"enabled": true}'
        return [Finding("ds.rejected", "error", f"{head}: {section} is {type(work.get(section)).__name__}, "
                        "not a mapping.", f'Write {section} as a mapping, e.g. "{section}": {example}.', path)], section
    key = _key_in(msg, work)
    fix = (f"Change {key} so that DeepSpeed's rule holds: {msg}" if key else
           f"Fix what DeepSpeed names: {msg} (DeepSpeedConfig(PATH) from deepspeed.runtime.config shows its "
           "traceback).")
    return [Finding("ds.rejected", "error", f"{head}: {msg}" + (f" (key {key})" if key else ""), fix, path)], \
        key.split(".")[0] if key else None


def _reason(e: dict) -> str:
    msg = e["msg"]
    if e["type"] in ("assertion_error", "value_error"):
        msg = re.sub(r"^(Assertion failed|Value error), ", "", msg)
    got = e.get("input")
    if e["type"] not in ("assertion_error", "value_error", "missing") and not isinstance(got, (dict, list)):
        msg += f" (got {got!r})"
    return msg


def _fix(e: dict, key: str, loc: list[str], title: str, work: dict) -> str:
    kind = e["type"]
    if kind == "extra_forbidden":
        leaf = loc[-1] if loc else key
        fields = _fields(title, loc[:-1])
        close = difflib.get_close_matches(leaf, fields, n=1, cutoff=0.75)
        if close:
            return f"Rename {key} to {key.rsplit('.', 1)[0]}.{close[0]} (the key DeepSpeed knows)."
        if leaf in TOP_LEVEL and "." in key:
            return f"Move {leaf} out of {key.rsplit('.', 1)[0]} to the top level of the file, where DeepSpeed reads it."
        owner = next((s for t, s in SECTIONS.items() if t != title and leaf in _fields(t, [])), None)
        if owner:
            return f"Remove {key}: {leaf} belongs to the {owner} section, not to {key.rsplit('.', 1)[0]}."
        return f"Remove {key}: DeepSpeed does not know it there (known keys: {', '.join(sorted(fields)[:12])} ...)."
    if kind in ("enum", "literal_error"):
        return f"Set {key} to one of {e.get('ctx', {}).get('expected', 'the values DeepSpeed accepts')}."
    if kind in ("assertion_error", "value_error"):
        return f"Change {key} so that DeepSpeed's rule holds: {_reason(e)}"
    return f"Set {key} to a valid value: {e['msg'].lower()}."


def _fields(title: str, path: list[str]) -> list[str]:
    """Field names of the pydantic model `title` (a DeepSpeedConfigModel), or of a nested model on `path`."""
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    def subclasses(c):
        for s in c.__subclasses__():
            yield s
            yield from subclasses(s)

    model = next((c for c in subclasses(DeepSpeedConfigModel) if c.__name__ == title), None)
    for name in path:
        if model is None or name not in model.model_fields:
            return []
        ann = model.model_fields[name].annotation
        model = next((a for a in (ann, *getattr(ann, "__args__", ())) if isinstance(a, type)
                      and issubclass(a, DeepSpeedConfigModel)), None)
    return list(model.model_fields) if model is not None else []


def _section_of(work: dict, errors: list[dict]) -> Optional[str]:
    """The top-level section whose dict holds the first error's location (a model without a SECTIONS entry)."""
    loc = [str(x) for x in (errors[0]["loc"] if errors else ())]
    for k, v in work.items():
        node = v
        for part in loc[:1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(v, dict) and loc and node is not None:
            return k
    return None


def _key_in(msg: str, work: dict) -> Optional[str]:
    """The dotted key of the first setting of the file that an assertion message names."""
    flat = dict(_flatten(work))
    for word in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", msg):
        if "_" in word or word in work:
            hit = next((k for k in flat if k == word or k.endswith("." + word)), None)
            if hit:
                return hit
    return None


def _flatten(d: Any, prefix: str = ""):
    if isinstance(d, dict):
        for k, v in d.items():
            yield f"{prefix}{k}", v
            yield from _flatten(v, f"{prefix}{k}.")


def _unique(findings: list[Finding]) -> list[Finding]:
    seen, out = set(), []
    for f in findings:
        if (f.code, f.message) not in seen:
            seen.add((f.code, f.message))
            out.append(f)
    return out
