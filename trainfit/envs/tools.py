"""Tool use: the model calls Python functions, reads their results, and is scored on its final answer.

The tools' JSON schemas (from type hints and Google-style docstrings, `transformers.utils.get_json_schema`)
reach the model through the chat template's `tools=` argument. The model calls a tool Qwen/Hermes style:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "37 * 12"}}
    </tool_call>

Each call's result comes back as a `tool` message; a malformed call, an unknown tool or bad arguments
come back as an error text in a `tool` message too, so the model can correct itself. A reply without a
tool call is the final answer: the episode ends with the task's rewards on it. `info["format"]` is 1.0
when every call of the episode parsed and ran and the final answer is non-empty (a small format signal
for metrics; it is not added to the reward).
"""

from __future__ import annotations

import ast
import inspect
import json
import operator
import re
from typing import Any, Callable, Optional, Sequence

from trainfit.config import ConfigError
from trainfit.tasks import score
from trainfit.tasks.rewards import load_reward

from .base import BaseEnv, StepResult
from .cua_actions import json_too_deep

# Tool arguments are the user's own JSON and may nest; deeper than this is no call anyone writes.
MAX_CALL_DEPTH = 32

_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "array": list,
               "object": dict}

# ---- the built-in tool ------------------------------------------------------------------------------
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def safe_eval(expression: str) -> float:
    """Arithmetic on number literals only, walked on the AST: no names, calls or attributes, no eval."""
    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression ({e.msg})") from None
    return _eval(tree.body)


def _eval(node: ast.AST):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        a, b = _eval(node.left), _eval(node.right)
        # Bounded powers: 9**9**9 would take the process down instead of answering.
        if isinstance(node.op, ast.Pow) and (abs(b) > 64 or abs(a) > 1e6):
            raise ValueError("power too large (base up to 1e6, exponent up to 64)")
        return _BINOPS[type(node.op)](a, b)
    raise ValueError(f"unsupported syntax {type(node).__name__}: use numbers, + - * / // % ** and parentheses")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "(37 + 5) * 12".
    """
    x = safe_eval(expression)
    if isinstance(x, float) and x.is_integer() and abs(x) < 1e15:
        return str(int(x))
    return f"{x:.12g}" if isinstance(x, float) else str(x)


# ---- loading user tools -----------------------------------------------------------------------------
def tool_schema(fn: Callable, where: str = "tool") -> dict:
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as e:
        raise ConfigError(f"{where}: cannot build the tool's JSON schema ({e}); give the function type hints and "
                          "a Google-style docstring with a description and an `Args:` line per argument.") from None


def load_tools(specs: Sequence[str]) -> list[Callable]:
    """The functions of `env.tools` (`module:function` / `path/file.py:function`); empty = [calculator]."""
    if not specs:
        return [calculator]
    out = []
    for spec in specs:
        where = f"env.tools entry {spec!r}"
        if spec.rpartition(":")[0] == "" or not spec.rpartition(":")[2]:
            raise ConfigError(f"{where} is not `module:function` or `path/to/file.py:function`; write e.g. "
                              f"my_tools.py:{spec or 'lookup'}.")
        try:  # the same resolution as reward functions, with this key in the message
            fn = load_reward(spec)
        except ConfigError as e:
            raise ConfigError(str(e).replace(f"task.rewards entry {spec!r}", where)
                              .replace("fn(prompts, completions, **fields) -> list[float]",
                                       "typed function with a docstring")) from None
        tool_schema(fn, where)
        out.append(fn)
    names = [f.__name__ for f in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"env.tools has two functions with the same name ({names}); the model calls tools by "
                          "name, so rename one.")
    return out


# ---- parsing and running calls ----------------------------------------------------------------------
def parse_tool_calls(text: str) -> tuple[list[dict], list[str]]:
    """({"name", "arguments"} calls, error texts) from a reply; errors are for the model to read."""
    calls, errors = [], []
    bodies = _CALL_RE.findall(text)
    if text.count("<tool_call>") > len(bodies):
        errors.append("error: a <tool_call> is not closed with </tool_call>.")
    for body in bodies:
        if json_too_deep(body, MAX_CALL_DEPTH):
            errors.append(f"error: the tool call nests brackets more than {MAX_CALL_DEPTH} deep; write "
                          '{"name": <tool name>, "arguments": {...}}.')
            continue
        try:
            call = json.loads(body.strip())
        except json.JSONDecodeError as e:
            errors.append(f"error: the tool call is not valid JSON ({e.msg} at column {e.colno}); write "
                          '{"name": <tool name>, "arguments": {...}}.')
            continue
        except ValueError:  # an integer of thousands of digits: int()'s digit limit
            errors.append("error: the tool call is not valid JSON (a number too long to read).")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            errors.append('error: a tool call must be a JSON object {"name": <tool name>, "arguments": {...}}.')
            continue
        args = call.get("arguments", {})
        if isinstance(args, str) and not json_too_deep(args, MAX_CALL_DEPTH):  # some models write them as a JSON string
            try:
                args = json.loads(args)
            except ValueError:  # not JSON (JSONDecodeError is a ValueError): the string as written
                pass
        calls.append({"name": call["name"], "arguments": args})
    return calls, errors


def _result_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)


class ToolEnv(BaseEnv):
    """The model may call `tools` (Python functions) any number of turns, then answers."""

    def __init__(self, tools: Sequence[Callable], reward_fns: Sequence[tuple[str, Callable]],
                 reward_weights: Optional[Sequence[float]] = None):
        self.fns = {f.__name__: f for f in tools}
        self.tools = [tool_schema(f) for f in tools]
        self.params = {s["function"]["name"]: s["function"].get("parameters", {}) for s in self.tools}
        self.reward_fns, self.reward_weights = list(reward_fns), reward_weights
        self.example = None
        self.n_calls = self.n_errors = 0

    def reset(self, example) -> list[dict]:
        self.example, self.n_calls, self.n_errors = example, 0, 0
        if example.messages is not None:
            return [dict(m) for m in example.messages]
        return [{"role": "user", "content": example.prompt}]

    def step(self, action: str) -> StepResult:
        if "<tool_call>" not in action:
            return self._final(action)
        calls, errors = parse_tool_calls(action)
        out = [{"role": "tool", "name": "error", "content": e} for e in errors]
        for c in calls:
            text, ok = self.call(c["name"], c["arguments"])
            out.append({"role": "tool", "name": c["name"], "content": text})
            self.n_errors += not ok
        self.n_calls += len(calls) + len(errors)
        self.n_errors += len(errors)
        return StepResult(out, 0.0, False, {"tool_calls": self.n_calls, "tool_errors": self.n_errors})

    def call(self, name: str, arguments: Any) -> tuple[str, bool]:
        """(result or error text, ran without error)."""
        fn = self.fns.get(name)
        if fn is None:
            return f"error: unknown tool {name!r}; available tools: {', '.join(self.fns)}.", False
        if not isinstance(arguments, dict):
            return f"error: the arguments of {name} must be a JSON object, got {_result_text(arguments)}.", False
        problem = self._check_args(name, fn, arguments)
        if problem:
            return f"error: bad arguments for {name}: {problem}.", False
        try:
            return _result_text(fn(**arguments)), True
        except Exception as e:
            return f"error: {name} raised {type(e).__name__}: {e}", False

    def _check_args(self, name: str, fn: Callable, arguments: dict) -> Optional[str]:
        try:
            inspect.signature(fn).bind(**arguments)
        except TypeError as e:
            return str(e)
        props = self.params[name].get("properties", {})
        for k, v in arguments.items():
            want = _JSON_TYPES.get(props.get(k, {}).get("type"))
            if want and (not isinstance(v, want) or (isinstance(v, bool) and want is not bool)):
                return f"{k} must be a JSON {props[k]['type']}, got {_result_text(v)}"
        return None

    def _final(self, answer: str) -> StepResult:
        ex = self.example
        prompt = ex.prompt if ex.prompt is not None else ex.messages
        total, per = score(self.reward_fns, self.reward_weights, [prompt], [answer], [ex])
        fmt = float(self.n_errors == 0 and bool(answer.strip()))
        info = {"tool_calls": self.n_calls, "tool_errors": self.n_errors, "format": fmt,
                **{f"reward/{k}": float(v[0]) for k, v in per.items()}}
        return StepResult([], float(total[0]), True, info)
