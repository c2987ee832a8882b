"""`math_verify`: answers checked by Hugging Face's Math-Verify (`pip install 'trainfit[math]'`).

The completion is parsed as Math-Verify parses model output (the last \\boxed{}, LaTeX or plain
expression, units and thousands separators handled) and compared with the reference answer, parsed as
LaTeX math (`$...$` is added when the answer has none), symbolically and numerically:
\\frac{1}{2} = 0.5 = 1/2, $2+3x$ = 3x+2, "#### 72" and "\\boxed{72}" = 72. A completion with nothing
parsable, or an answer that does not parse, scores 0. An escaped dollar (`\\$18.90`, a currency sign in
MATH's answers) is text, not a math delimiter: such an answer is wrapped like any other.

Both texts are first rewritten by `math_text.normalise_math` (the Unicode minus and other look-alikes,
scientific notation, a currency sign before a number: `−3` = -3, `1e3` = 1000), and where Math-Verify still
finds no equality, an answer that is one number is compared with the completion's final number standing
alone in prose ("So she pays \\$18 in total." = 18; "... 180" is not). tests/data/math_cases.json holds
the cases, and the README lists those where this differs from Math-Verify alone.

`task.name: dataset` decides per row (`answer_equal`): an answer that looks mathematical and parses is
judged by Math-Verify, any other (`\\text{Evelyn}`, "Paris") by normalised text: the completion's last
\\boxed{} (else what follows its last "####", else the whole completion) against the answer, both with
`\\text{}` unwrapped, `$`, case, spacing and a final period ignored.

Math-Verify bounds each parse and comparison with a signal alarm (5 s), which only works in the main
thread; elsewhere (a threaded reward server) the calls run without that bound.
"""

from __future__ import annotations

import functools
import re
import threading

from trainfit.config import ConfigError

from .math_text import as_number, final_number, normalise_math

_TIMEOUT_S = 5
_LATEX_CMD = re.compile(r"\\[A-Za-z]+")
# A `$` not escaped by a backslash: a math delimiter (`\$` is a currency sign inside the math).
_DELIMITER = re.compile(r"(?<!\\)\$")
_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
# A unit written as text after a number ("5\text{ cm}", "3\mbox{ m}^2"): Math-Verify drops it.
_UNIT = re.compile(r"(\d)\s*\\(?:text|mbox|mathrm)\{[^{}]*\}(?:\^\{?\d\}?)?\s*$")
_OPERATOR = re.compile(r"[-+*/^=<>]")
# Text wrappers unwrapped before a text comparison: \text{Evelyn} = Evelyn.
_TEXT_WRAP = re.compile(r"\\(?:text|textbf|textit|mathrm|mbox)\{([^{}]*)\}")


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


def latex_answer(answer: str) -> str:
    """A reference answer as Math-Verify is given it: stripped, and `$...$` added unless it has a math
    delimiter or a \\boxed{}."""
    s = str(answer).strip()
    return s if _DELIMITER.search(s) or "\\boxed" in s else f"${s}$"


@functools.lru_cache(maxsize=65536)
def parse_answer(answer: str) -> tuple:
    """The reference answer as Math-Verify sees it (empty: nothing parsable). Cached: a GRPO group
    checks every completion against the same answer."""
    from math_verify import parse

    try:
        return tuple(parse(latex_answer(normalise_math(str(answer))), parsing_timeout=_timeout()))
    except Exception:  # Math-Verify's own errors and timeouts: the answer is not parsable
        return ()


def math_equal(completion: str, answer: str) -> bool:
    """The completion's final answer equals the reference answer: by Math-Verify on both texts
    `normalise_math`ed, else, for an answer that is one number, by the completion's final number in prose
    (`final_number` of `final_text`: "So she pays \\$18 in total." = 18, not "... 180")."""
    from math_verify import parse, verify

    text = normalise_math(str(completion))
    gold = parse_answer(str(answer))
    try:
        pred = parse(text, parsing_timeout=_timeout()) if gold else []
        if pred and verify(list(gold), pred, timeout_seconds=_timeout()):
            return True
    except Exception:  # malformed output that makes the parser or sympy raise: the prose check decides
        pass
    number = as_number(str(answer))
    return number is not None and final_number(final_text(text)) == number


def math_verify(prompts: list, completions: list[str], answer: list, **fields: list) -> list[float]:
    """1.0 where the completion's answer equals the row's `answer` (`math_equal`)."""
    require()
    return [1.0 if math_equal(c, a) else 0.0 for c, a in zip(completions, answer)]


math_verify.require = require   # resolve_weighted checks the package before a run starts


def looks_mathematical(answer: str) -> bool:
    """A number (with a unit in \\text{} allowed), or a short expression: digits, LaTeX commands or an
    operator between one-letter variables, and no words of two letters or more outside LaTeX commands
    ("3x+2", "\\frac{1}{2}", "(1, 2)", "x^2", "p - q", "5\\text{ cm}"; not "Paris", "72 dollars", "B")."""
    s = normalise_math(str(answer)).strip()
    if not s:
        return False
    if _NUMBER.fullmatch(s):
        return True
    s = _UNIT.sub(r"\1", s)
    if re.search(r"[A-Za-z]{2,}", _LATEX_CMD.sub(" ", s)):
        return False
    return bool(re.search(r"\d", s) or _LATEX_CMD.search(s) or (re.search(r"[A-Za-z]", s) and _OPERATOR.search(s)))


@functools.lru_cache(maxsize=65536)   # one answer a row, judged for every completion of its group
def answer_is_math(answer: str) -> bool:
    """The row is judged by Math-Verify: its answer looks mathematical and Math-Verify parses it."""
    return looks_mathematical(answer) and bool(parse_answer(str(answer)))


def final_text(completion: str) -> str:
    """The completion's final answer as text: its last \\boxed{...} (braces balanced), else what follows
    its last "####", else the whole completion."""
    start = completion.rfind("\\boxed{")
    if start >= 0:
        depth, i = 1, start + len("\\boxed{")
        for j in range(i, len(completion)):
            depth += {"{": 1, "}": -1}.get(completion[j], 0)
            if depth == 0:
                return completion[i:j]
    if "####" in completion:
        return completion.rsplit("####", 1)[1]
    return completion


def normalise_text(text: str) -> str:
    """Text as compared: \\text{} unwrapped, `$`, LaTeX spacing, case, runs of spaces and a final
    period ignored ("\\text{Evelyn}" = "evelyn")."""
    s = _TEXT_WRAP.sub(r"\1", str(text)).replace("\\$", "").replace("$", "").replace("\\!", "")
    s = re.sub(r"\\[,;: ]", " ", s)   # LaTeX spaces
    return " ".join(s.split()).rstrip(".").strip().casefold()


def text_equal(completion: str, answer: str) -> bool:
    """The completion's final answer (`final_text`) equals the answer as normalised text."""
    return normalise_text(final_text(completion)) == normalise_text(answer)


def answer_equal(completion: str, answer: str) -> bool:
    """`task.name: dataset`'s check, decided per row: Math-Verify where the answer is math
    (`answer_is_math`), normalised text elsewhere."""
    return math_equal(completion, answer) if answer_is_math(answer) else text_equal(completion, answer)
