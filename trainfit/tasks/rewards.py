"""Reward functions: built-ins, loading user functions, and scoring a batch.

A reward function has this signature (built-ins and user functions alike):

    def my_reward(prompts: list[str], completions: list[str], **fields: list) -> list[float]:
        ...

- `prompts[i]` is the prompt text that produced `completions[i]` (a GRPO group repeats a prompt).
- every keyword is a field of the task rows, as a list aligned with `completions`. `answer` (the
  reference answer, always a str) is always present; JSONL rows add their own fields (metadata,
  `format_regex`, ...). A row without a field gets None in that position.
- return one finite float per completion (a list, tuple, numpy array or tensor).

Accept `**fields` (or `**kwargs`) to ignore fields you do not use; a function without it is called
with only the fields it names, e.g. `def r(prompts, completions, answer)`.

Point `task.rewards` at one with `module:function` (importable module) or
`path/to/file.py:function` (relative to the directory trainfit runs in).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import math
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from trainfit.config import ConfigError

from .base import Example, RewardFn
from .math_reward import math_verify
from .math_text import normalise_math

if TYPE_CHECKING:  # torch is imported where rewards are scored: `plan` checks reward functions without it
    import torch

# The answer-tag format: the whole completion is one tag holding an integer.
ANSWER_TAG_REGEX = r"^\s*<answer>\s*-?\d+\s*</answer>\s*$"
# A number as people write it: optional sign, thousands commas, decimals, exponent.
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)(?:[eE][-+]?\d+)?")


def parse_number(text: Any) -> Optional[float]:
    """The whole of `text` as a finite number ("1,000" -> 1000.0), else None."""
    s = str(text).strip().replace(",", "")
    try:
        x = float(s)
    except ValueError:
        return None
    return x if math.isfinite(x) else None


def last_number(text: str) -> Optional[float]:
    """The last number written in `text` ("so 3 + 4 = 7." -> 7.0), else None."""
    found = _NUMBER.findall(text)
    return parse_number(found[-1]) if found else None


def numeric_equal(completion: str, answer: Any) -> bool:
    """The completion's last number equals the answer within 1e-6 relative, both read after the rewrites
    that keep a number's value (`math_text.normalise_math`: a Unicode minus is a minus, `\\$18` is 18)."""
    x, a = last_number(normalise_math(completion)), parse_number(normalise_math(str(answer)))
    return x is not None and a is not None and math.isclose(x, a, rel_tol=1e-6, abs_tol=0.0)


def exact_equal(completion: str, answer: Any) -> bool:
    """The completion is the answer, ignoring surrounding whitespace."""
    return completion.strip() == str(answer).strip()


def exact_match(prompts: list, completions: list[str], answer: list, **fields: list) -> list[float]:
    return [1.0 if exact_equal(c, a) else 0.0 for c, a in zip(completions, answer)]


def numeric_match(prompts: list, completions: list[str], answer: list, **fields: list) -> list[float]:
    return [1.0 if numeric_equal(c, a) else 0.0 for c, a in zip(completions, answer)]


def format_reward(prompts: list, completions: list[str], format_regex: Optional[list] = None,
                  **fields: list) -> list[float]:
    """1.0 where the completion matches the row's `format_regex` (default: the answer-tag format)."""
    regexes = format_regex if format_regex is not None else [None] * len(completions)
    return [1.0 if re.search(rx or ANSWER_TAG_REGEX, c) else 0.0 for c, rx in zip(completions, regexes)]


BUILTIN_REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match, "numeric_match": numeric_match, "format": format_reward, "math_verify": math_verify}


def load_reward(spec: str) -> RewardFn:
    """A user reward function from `module:function` or `path/to/file.py:function`."""
    where = f"task.rewards entry {spec!r}"
    target, _, fname = spec.rpartition(":")
    if not target or not fname:
        raise ConfigError(
            f"{where} is neither `default`, a built-in ({', '.join(BUILTIN_REWARDS)}), nor "
            f"`module:function` / `path/to/file.py:function`; write e.g. my_rewards.py:{spec or 'reward'}.")
    if target.endswith(".py") or "/" in target or "\\" in target:
        module = _load_file(Path(target).expanduser(), where, fname)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise ConfigError(
                f"{where}: cannot import module {target!r} ({e}); install it or add its directory to "
                f"PYTHONPATH, or give a file path such as path/to/{target.split('.')[-1]}.py:{fname}.") from None
        except Exception as e:
            raise ConfigError(f"{where}: importing module {target!r} failed with {type(e).__name__}: {e}; "
                              "fix the error in that module.") from None
    if not hasattr(module, fname):
        defined = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_"))
        raise ConfigError(f"{where}: {target} has no function {fname!r} (functions there: "
                          f"{', '.join(defined) or 'none'}); fix the name after the colon.")
    fn = getattr(module, fname)
    if not callable(fn):
        raise ConfigError(f"{where}: {target}:{fname} is not callable (it is a {type(fn).__name__}); point at a "
                          "function fn(prompts, completions, **fields) -> list[float].")
    return fn


def _load_file(path: Path, where: str, fname: str):
    if not path.is_file():
        raise ConfigError(f"{where}: file {str(path)!r} does not exist (looked for {path.resolve()}); give "
                          f"an absolute path or one relative to the directory you run trainfit in, e.g. "
                          f"rewards.py:{fname}.")
    # A stable, unique module name per file, registered so pickling and dataclasses inside it work.
    name = "_trainfit_reward_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(name, None)
        raise ConfigError(f"{where}: running {path} failed with {type(e).__name__}: {e}; fix the error "
                          "in that file.") from None
    return module


def resolve_weighted(task_cfg, task) -> list[tuple[str, RewardFn, float]]:
    """(name, function, weight) for each reward. `default` expands to the task's own rewards, each
    taking the weight given to `default`."""
    specs = list(task_cfg.rewards)
    if not specs:
        raise ConfigError("task.rewards is empty; list at least one reward, e.g. [default].")
    weights = task_cfg.reward_weights
    if weights is None:
        weights = [1.0] * len(specs)
    elif len(weights) != len(specs):
        raise ConfigError(f"task.reward_weights has {len(weights)} entries but task.rewards has "
                          f"{len(specs)}; give one weight per reward.")
    out: list[tuple[str, RewardFn, float]] = []
    origin: dict[str, str] = {}
    for spec, w in zip(specs, weights):
        if spec == "default":
            items = task.reward_funcs()
        elif spec in BUILTIN_REWARDS:
            items = [(spec, BUILTIN_REWARDS[spec])]
            getattr(BUILTIN_REWARDS[spec], "require", lambda: None)()   # its package, before the run starts
        else:
            items = [(spec.rpartition(":")[2], load_reward(spec))]
        for name, fn in items:
            if name in origin:
                # Metrics are keyed by name, and a repeated reward is better said with a weight.
                raise ConfigError(
                    f"task.rewards gives two rewards named {name!r} (from {origin[name]!r} and {spec!r}; "
                    f"`default` for task {task.name} is {[n for n, _ in task.reward_funcs()]}); drop one "
                    "and raise its weight in task.reward_weights instead, or rename the function.")
            origin[name] = spec
            out.append((name, fn, float(w)))
    return out


def resolve_rewards(task_cfg, task) -> list[tuple[str, RewardFn]]:
    """The reward functions of `task.rewards`, in order, with `default` expanded."""
    return [(n, f) for n, f, _ in resolve_weighted(task_cfg, task)]


def resolve_weights(task_cfg, task) -> list[float]:
    """One weight per entry of `resolve_rewards` (task.reward_weights, expanded like `default`)."""
    return [w for _, _, w in resolve_weighted(task_cfg, task)]


# Row fields that would collide with the positional arguments of a reward function.
_RESERVED = ("prompts", "completions")


def gather_fields(examples: Sequence[Example]) -> dict[str, list]:
    """Row fields as keyword lists aligned with `examples`; `answer` always from `Example.answer`."""
    keys: dict[str, None] = {"answer": None}
    for ex in examples:
        keys.update(dict.fromkeys(k for k in ex.fields if k not in _RESERVED))
    out = {k: [ex.fields.get(k) for ex in examples] for k in keys}
    out["answer"] = [ex.answer for ex in examples]
    return out


def _accepted(fn: RewardFn, fields: dict[str, list]) -> dict[str, list]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return fields
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return fields
    names = {p.name for p in params}
    return {k: v for k, v in fields.items() if k in names}


def score(reward_fns: Sequence[tuple[str, RewardFn]], weights: Optional[Sequence[float]],
          prompts: list, completions: list[str], examples: Sequence[Example]
          ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Call each reward function once on the batch and sum them with `weights` (None = all 1).

    Returns (total [N], {name: rewards [N]}), float32, N = len(completions). `examples[i]` is the
    example behind `completions[i]` (repeated across a GRPO group).
    """
    n = len(completions)
    if len(prompts) != n or len(examples) != n:
        raise ValueError(f"score needs aligned inputs: {len(prompts)} prompts, {n} completions, "
                         f"{len(examples)} examples.")
    weights = [1.0] * len(reward_fns) if weights is None else list(weights)
    if len(weights) != len(reward_fns):
        raise ValueError(f"{len(weights)} weights for {len(reward_fns)} reward functions; use "
                         "resolve_weights() to expand task.reward_weights over `default`.")
    import torch

    fields = gather_fields(examples)
    total = torch.zeros(n, dtype=torch.float32)
    per: dict[str, torch.Tensor] = {}
    for (name, fn), w in zip(reward_fns, weights):
        if name in per:
            raise ValueError(f"two reward functions are named {name!r}; names must be unique.")
        try:
            out = fn(list(prompts), list(completions), **_accepted(fn, fields))
        except Exception as e:
            raise RuntimeError(f"reward function {name!r} raised {type(e).__name__}: {e}") from e
        per[name] = _check_output(name, out, n)
        total += float(w) * per[name]
    return total, per


def _check_output(name: str, out: Any, n: int) -> torch.Tensor:
    import torch

    if isinstance(out, torch.Tensor):
        out = out.detach().cpu().reshape(-1).tolist()
    try:
        values = [float(v) for v in out]
    except (TypeError, ValueError) as e:
        raise RuntimeError(f"reward function {name!r} must return a list of floats, one per completion; "
                           f"got {type(out).__name__} ({e}).") from None
    if len(values) != n:
        raise RuntimeError(f"reward function {name!r} returned {len(values)} values for {n} completions; "
                           "return one float per completion.")
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    if bad:
        raise RuntimeError(f"reward function {name!r} returned non-finite values at positions {bad[:8]} "
                           f"({values[bad[0]]}); return finite floats (e.g. 0.0 for a failed parse).")
    return torch.tensor(values, dtype=torch.float32)
