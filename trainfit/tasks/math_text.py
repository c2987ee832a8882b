"""How people and models write numbers, made readable to Math-Verify, and the final number of a prose answer.

`normalise_math` rewrites, in a completion or an answer, what Math-Verify reads as nothing or as another
number: look-alike characters (the Unicode minus U+2212 and other minus signs, an en or em dash used as a
minus, full-width digits and signs, thin, narrow and no-break spaces, zero-width characters), digit groups
split by LaTeX spaces (`1\\,000`), scientific notation (`1e3`, `2.5E-4`, `2.5 \\times 10^{3}`, `6 × 10³`,
as exact decimals), and a currency sign before a number (`\\$18`, `€18`, `£18`, `US$18`). Each rewrite
keeps the value: `-3` stays apart from `3`, `18` from `180`, and a dash between two numbers (`3–5`) stays
a dash.

`final_number` is the completion's last number when it stands alone as the stated answer ("So she pays
$18 in total.", "#### 1,000", "25 percent"), not inside an expression (`x^2`, `1/2`, `18 + x`): the
check `math_reward.math_equal` falls back on when Math-Verify finds no equality.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Optional

# Minus signs that are not ASCII: U+2212 minus, U+2010/U+2011 hyphens, U+2012 figure dash, U+FE63 small
# and U+FF0D full-width hyphen-minus, U+02D7 modifier minus.
_MINUS = dict.fromkeys(map(ord, "\u2212\u2010\u2011\u2012\ufe63\uff0d\u02d7"), "-")
# Spaces people paste inside numbers (no-break, figure, thin, hair, narrow no-break, ideographic) read as
# a space; zero-width characters and the soft hyphen as nothing.
_SPACES = dict.fromkeys(map(ord, "\u00a0\u2007\u2008\u2009\u200a\u202f\u205f\u3000"), " ")
_INVISIBLE = dict.fromkeys(map(ord, "\u200b\u200c\u200d\u2060\ufeff\u00ad"), None)
# The full-width forms of ASCII (U+FF01..U+FF5E: digits, signs, letters) as ASCII.
_FULL_WIDTH = {c: c - 0xFEE0 for c in range(0xFF01, 0xFF5F) if c != 0xFF0D}
_TRANSLATE = {**_FULL_WIDTH, **_SPACES, **_INVISIBLE, **_MINUS}
_SUPERSCRIPT = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹⁻⁺", "0123456789-+")

# An en or em dash used as a minus: before a digit, not after a word, a closing bracket or a digit and
# a space ("3–5" and "3 – 5" are ranges or differences and stay as they are).
_DASH_MINUS = re.compile(r"(?<![\w)\]}.])(?<!\d )[\u2013\u2014](?=\.?\d)")
# Digit groups joined by a LaTeX space or `{,}`: 1\,000, 1\!000, 1{,}000.
_LATEX_GROUP = re.compile(r"(?<=\d)(?:\\[,!; ]|\{,\})(?=\d{3}(?!\d))")
# A mantissa that is not the end of a power, an index or a divisor (x^2 \cdot 10^3 is not x^2000).
_MANTISSA = r"(?<![\w.^_/÷])(?<!\\div)(?<!\\div )(\d+(?:\.\d+)?|\.\d+)"
# 1e3, 2.5E-4: not inside a word (`x2e3y`) nor a hex string.
_E_NOTATION = re.compile(_MANTISSA + r"[eE]([-+]?\d{1,3})(?!\w|\.\d)")
# 2.5 \times 10^{3}, 2.5\cdot10^3, 6 × 10^3, 6*10^-3, 6 × 10³ (superscripts read first); not raised further.
_TIMES_TEN = re.compile(_MANTISSA + r"\s*(?:\\times|\\cdot|[×·*])\s*10\s*\^\s*"
                        r"(?:\{\s*([-+]?\d{1,3})\s*\}|([-+]?\d{1,3}))(?![\d^])")
_TEN_SUPERSCRIPT = re.compile(r"10([⁰¹²³⁴⁵⁶⁷⁸⁹⁻⁺]+)")
# A currency sign written before a number: `\$`, `€`, `£`, `¥`, `US$`, `USD ` (a bare `$` is a math
# delimiter to Math-Verify, which reads "$18" itself).
_CURRENCY = re.compile(r"(?:\\\$|US\$|USD\s?|[€£¥])\s?(?=[-+]?\.?\d)")

# A number as written: optional sign (a sign after a word or a digit is an operator), digit groups.
_NUMBER = re.compile(r"(?<![\w)\]}.])[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?![\d])|(?<![\w.])\.\d+")
# Around the last number, what makes it part of an expression rather than the stated answer: before it
# an operator, an opening bracket, a list, ratio or range ("1, 2, 18", "1:2", "3–5"); after it an operator,
# a bracket, a LaTeX command other than a unit, a space or `\%`, or a letter joined to it ("18x").
_BEFORE_EXPR = re.compile(r"(?:[-+*/^_×÷·{(\[|]|\\(?:times|cdot|div|frac|sqrt|pi|log|ln|sin|cos|tan)"
                          r"|\d\s*[,:\u2013\u2014])\s*$")
_AFTER_EXPR = re.compile(r"^(?:\s*[-+*/^_×÷·()!\[\]|]|\s*\\(?!%|\$|text|mbox|mathrm|[,;! ])|[A-Za-z]|\.\d)")
# A plain number as an answer may carry a currency sign, a percent sign and a unit in \text{}.
_DECORATION = re.compile(r"\\\$|\$|\\%|%|\\text\{[^{}]*\}|\\mbox\{[^{}]*\}|\\[,;! ]|\{,\}|\s")


def _decimal_text(mantissa: str, exponent: str) -> str:
    """mantissa x 10^exponent written out exactly ("2.5", "-4" -> "0.00025")."""
    value = Decimal(mantissa).scaleb(int(exponent))
    text = format(value, "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def _times_ten(m: re.Match) -> str:
    return _decimal_text(m.group(1), m.group(2) or m.group(3))


def normalise_math(text: str) -> str:
    """`text` with look-alike characters, LaTeX digit groups, scientific notation and currency signs
    before numbers rewritten as Math-Verify reads them (values unchanged)."""
    s = str(text).translate(_TRANSLATE)
    s = _DASH_MINUS.sub("-", s)
    s = _TEN_SUPERSCRIPT.sub(lambda m: "10^{" + m.group(1).translate(_SUPERSCRIPT) + "}", s)
    s = _LATEX_GROUP.sub("", s)
    s = _TIMES_TEN.sub(_times_ten, s)
    s = _E_NOTATION.sub(lambda m: _decimal_text(m.group(1), m.group(2)), s)
    return _CURRENCY.sub("", s)


def as_number(answer: str) -> Optional[Decimal]:
    """A reference answer that is one number, with its currency sign, percent sign, thousands separators
    or \\text{} unit dropped ("\\$1,000", "25\\%", "5\\text{ cm}"), else None."""
    s = _DECORATION.sub("", normalise_math(answer)).replace(",", "")
    if not re.fullmatch(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)", s):
        return None
    try:
        return Decimal(s)
    except InvalidOperation:
        return None


def final_number(text: str) -> Optional[Decimal]:
    """The last number of `text` (already `normalise_math`ed) when it stands alone, not inside an
    expression; None otherwise."""
    found = list(_NUMBER.finditer(text))
    if not found:
        return None
    m = found[-1]
    # The few characters either side decide (the longest marker, `\sqrt` and a space, is short).
    if _BEFORE_EXPR.search(text[max(0, m.start() - 16):m.start()]) or _AFTER_EXPR.match(text[m.end():m.end() + 16]):
        return None
    return Decimal(m.group().replace(",", ""))
