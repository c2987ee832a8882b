"""The math answer table (tests/data/math_cases.json, GSM8K- and MATH-style answers with the score a user
would give): trainfit's `math_verify` reward scores each as expected, what Math-Verify alone says is
recorded as the library says it today, and the README lists every case where the two differ. Also the
rewrites of `math_text` on their own: values kept, ranges and operators left alone."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path

import pytest

from bench.math_cases import CASES, cell, math_verify_alone
from trainfit.tasks import math_verify
from trainfit.tasks.math_reward import answer_is_math
from trainfit.tasks.math_text import as_number, final_number, normalise_math

TABLE = json.loads(CASES.read_text())
README = Path(__file__).resolve().parents[1] / "docs" / "data.md"   # the table of differences (was in README.md)


def test_the_table_covers_both_styles_and_the_three_reported_answers():
    assert len(TABLE) >= 40 and {c["kind"] for c in TABLE} == {"gsm8k", "math"}
    assert sum(c["expected"] == 0.0 for c in TABLE) >= 15          # wrong answers that must stay wrong
    reported = {("-3", "The answer is \u22123."), ("1000", "1e3"), ("18", "So she pays \\$18 in total.")}
    assert {(c["answer"], c["completion"]) for c in TABLE if c["expected"] == 1.0} >= reported


@pytest.mark.parametrize("case", TABLE, ids=[f"{i}-{c['note']}" for i, c in enumerate(TABLE)])
def test_math_verify_reward_scores_each_case_as_expected(case):
    got = math_verify(["p"], [case["completion"]], answer=[case["answer"]])
    assert got == [case["expected"]], case
    assert answer_is_math(case["answer"])   # so task.name: dataset checks the row the same way (answer_equal)


def test_recorded_math_verify_alone_is_what_the_library_says():
    # `python -m bench.math_cases --write` records it; a Math-Verify release that reads a case otherwise
    # shows here (and the README's list of differences is then to be rewritten from that script).
    assert [math_verify_alone(c["completion"], c["answer"]) for c in TABLE] == [c["math_verify"] for c in TABLE]


def test_readme_lists_exactly_the_cases_where_trainfit_and_math_verify_differ():
    rows = {line for line in README.read_text().splitlines() if line.startswith("| `")}
    differ = [c for c in TABLE if c["math_verify"] != c["expected"]]
    assert differ
    for c in differ:
        row = f"| {cell(c['answer'])} | {cell(c['completion'])} | {c['math_verify']:g} | {c['expected']:g} |"
        assert any(r.startswith(row) for r in rows), row
    same = [c for c in TABLE if c["math_verify"] == c["expected"]]
    assert not [c for c in same if any(r.startswith(f"| {cell(c['answer'])} | {cell(c['completion'])} |")
                                       for r in rows)]


@pytest.mark.parametrize("text, rewritten", [
    ("\u22123", "-3"),                              # Unicode minus
    ("x = \u20143", "x = -3"),                      # em dash before a number
    ("3\u20135", "3\u20135"),                       # a range stays a range
    ("3 \u2013 5", "3 \u2013 5"),
    ("\uff11\uff10\uff10\uff10\uff05", "1000%"),    # full-width digits and percent
    ("1\u202f000\u200b", "1 000"),                  # narrow no-break space; zero-width space dropped
    ("$1\\,000\\,000$", "$1000000$"),
    ("1e3", "1000"), ("2.5E-4.", "0.00025."), ("6.02e23", "602000000000000000000000"),
    ("2.5 \\times 10^{3}", "2500"), ("1 \u00d7 10\u207b\u00b3", "0.001"),
    ("x^2 \\cdot 10^3", "x^2 \\cdot 10^3"),        # not x^2000
    ("1/2 \\cdot 10^3", "1/2 \\cdot 10^3"),        # not 1/2000
    ("0x1e3", "0x1e3"), ("item2e3", "item2e3"),     # not numbers
    ("pays \\$18 or \u20ac5 or US$7", "pays 18 or 5 or 7"),
    ("$18$", "$18$"),                               # a math delimiter, not a currency
])
def test_normalise_math_keeps_values(text, rewritten):
    assert normalise_math(text) == rewritten


@pytest.mark.parametrize("text, number", [
    ("So she pays 18 in total.", "18"), ("#### 1,000", "1000"), ("x = -3", "-3"), ("It is 25 percent.", "25"),
    ("5\\,\\text{cm}", "5"), ("Answer: 2", "2"),
    ("x^2", None), ("1/2", None), ("18 + x", None), ("18x", None), ("(1, 18)", None), ("1:2", None),
    ("3\u20135", None), ("5 - 3", None), ("no number", None), ("2.5.", "2.5"),
])
def test_final_number_is_a_number_standing_alone(text, number):
    assert final_number(text) == (None if number is None else Decimal(number))


@pytest.mark.parametrize("answer, number", [
    ("\\$1,000", "1000"), ("25\\%", "25"), ("5\\text{ cm}", "5"), ("\\$32,\\!348", "32348"), ("\u22123", "-3"),
    ("1e3", "1000"), ("\\frac{1}{2}", None), ("[2, 5)", None), ("x", None), ("1.2.3", None),
])
def test_as_number_reads_a_plain_number_answer(answer, number):
    assert as_number(answer) == (None if number is None else Decimal(number))
