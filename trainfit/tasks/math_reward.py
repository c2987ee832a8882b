"""`math_verify`: answers checked by Hugging Face's Math-Verify (`pip install 'trainfit[math]'`).

The completion is parsed as Math-Verify parses model output (the last \\boxed{}, LaTeX or plain
expression, units and thousands separators handled) and compared with the reference answer, parsed as
LaTeX math (`$...$` is added when the answer has none), symbolically and numerically:
\\frac{1}{2} = 0.5 = 1/2, $2+3x$ = 3x+2, "#### 72" and "\\boxed{72}" = 72. A completion with nothing
parsable, or an answer that does not parse, scores 0. An escaped dollar (`\\$18.90`, a currency sign in
MATH's answers) is text, not a math delimiter: such an answer is wrapped like any other.

Math-Verify bounds each parse and comparison with a signal alarm (5 s), which only works in the main
thread; elsewhere (a threaded reward server) the calls run without that bound.
"""

from __future__ import annotations

import functools
import re
import threading

from trainfit.config import ConfigError

_TIMEOUT_S = 5
_LATEX_CMD = re.compile(r"\\[A-Za-z]+")
# A `$` not escaped by a backslash: a math delimiter (`\$` is a currency sign inside the math).
_DELIMITER = re.compile(r"(?<!\\)\$")
_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def require() -> None:
    """ConfigError with the fix when Math-Verify is not installed."""
    try:
        import math_verify  # noqa: F401
    except ImportError:
        raise ConfigError("the `math_verify` reward checks answers with Hugging Face's Math-Verify, which is not "
                          "installed: `pip install 'trainfit[math]'`, or use numeric_match / exact_match in "
                          "task.rewards.") from None


def _timeout() -> int | None:
    return _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=65536)
def parse_answer(answer: str) -> tuple:
    """The reference answer as Math-Verify sees it (empty: nothing parsable). Cached: a GRPO group
    checks every completion against the same answer."""
    from math_verify import parse

    s = str(answer).strip()
    text = s if _DELIMITER.search(s) or "\\boxed" in s else f"${s}$"
    try:
        return tuple(parse(text, parsing_timeout=_timeout()))
    except Exception:  # Math-Verify's own errors and timeouts: the answer is not parsable
        return ()


def math_equal(completion: str, answer: str) -> bool:
    """The completion's final answer equals the reference answer by Math-Verify."""
    from math_verify import parse, verify

    gold = parse_answer(str(answer))
    if not gold:
        return False
    try:
        pred = parse(completion, parsing_timeout=_timeout())
        return bool(pred) and bool(verify(list(gold), pred, timeout_seconds=_timeout()))
    except Exception:  # malformed output that makes the parser or sympy raise scores 0
        return False


def math_verify(prompts: list, completions: list[str], answer: list, **fields: list) -> list[float]:
    """1.0 where Math-Verify finds the completion's answer equal to the row's `answer`."""
    require()
    return [1.0 if math_equal(c, a) else 0.0 for c, a in zip(completions, answer)]


math_verify.require = require   # resolve_weighted checks the package before a run starts


def looks_mathematical(answer: str) -> bool:
    """A number, or a short expression: digits or LaTeX commands, and no words of two letters or more
    outside LaTeX commands ("3x+2", "\\frac{1}{2}", "(1, 2)", "x^2"; not "Paris", "72 dollars", "B")."""
    s = str(answer).strip()
    if not s:
        return False
    if _NUMBER.fullmatch(s):
        return True
    if re.search(r"[A-Za-z]{2,}", _LATEX_CMD.sub(" ", s)):
        return False
    return bool(re.search(r"\d", s) or _LATEX_CMD.search(s))
