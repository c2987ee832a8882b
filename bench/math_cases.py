"""The math answer table (tests/data/math_cases.json): what Math-Verify alone says of each case, against
trainfit's `math_verify` reward, and the cases where they differ as README rows.

"Math-Verify alone" is the library's own `parse` of the reference answer (given as trainfit gives it,
`$...$` added: `math_reward.latex_answer`) and of the completion, then `verify`: no rewriting of
look-alike characters, scientific notation or currency, and no final number in prose.

    python -m bench.math_cases            # the table and the README rows of the cases that differ
    python -m bench.math_cases --write    # also record each case's `math_verify` in the JSON
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from trainfit.tasks.math_reward import latex_answer, math_equal

CASES = Path(__file__).resolve().parents[1] / "tests" / "data" / "math_cases.json"


def math_verify_alone(completion: str, answer: str) -> float:
    """1.0 where Math-Verify, given the texts as they are, finds them equal."""
    from math_verify import parse, verify

    try:
        gold, pred = parse(latex_answer(answer)), parse(completion)
        return 1.0 if gold and pred and verify(gold, pred) else 0.0
    except Exception:   # what Math-Verify raises on malformed text counts as not equal, as in the reward
        return 0.0


def cell(text: str) -> str:
    """A case's text in a README table cell: non-ASCII characters named by code point, pipes escaped."""
    shown = "".join(c if c.isascii() and c.isprintable() else f"<U+{ord(c):04X}>" for c in text)
    return "`" + shown.replace("\n", " ").replace("|", "\\|") + "`"


def main(argv: list[str]) -> int:
    cases = json.loads(CASES.read_text())
    for case in cases:
        case["math_verify"] = math_verify_alone(case["completion"], case["answer"])
        case["trainfit"] = 1.0 if math_equal(case["completion"], case["answer"]) else 0.0
    wrong = [c for c in cases if c["trainfit"] != c["expected"]]
    agree = sum(c["math_verify"] == c["expected"] for c in cases)
    print(f"{len(cases)} cases: trainfit scores {len(cases) - len(wrong)} as expected, Math-Verify alone {agree}.")
    for c in wrong:
        print(f"  NOT AS EXPECTED: {c['answer']!r} vs {c['completion']!r}: {c['trainfit']} (expected {c['expected']})")
    print("\n| answer | completion | Math-Verify alone | trainfit | why |\n| --- | --- | --- | --- | --- |")
    for c in cases:
        if c["math_verify"] != c["trainfit"]:
            print(f"| {cell(c['answer'])} | {cell(c['completion'])} | {c['math_verify']:g} | {c['trainfit']:g} | "
                  f"{c['note']} |")
    if "--write" in argv:
        CASES.write_text(json.dumps([{k: v for k, v in c.items() if k != "trainfit"} for c in cases], indent=1) + "\n")
        print(f"\nwrote {CASES}")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
