"""Generated arithmetic: "12+7=" -> "19", and a tagged variant "12+7 in tags:" -> "<answer>19</answer>".

Prompts are kept short on purpose: the demo trains a 2-layer random-init model on CPU, where every
prompt token is paid for in every step.

Held-out problems are chosen by a hash of (seed, expression), not by position in a stream, so the
training stream can test membership and skip them: train and eval never share a problem.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import re
from typing import Optional

from trainfit.config import ConfigError

from .base import Example, RewardFn, Task
from .rewards import ANSWER_TAG_REGEX

_FIRST_INT = re.compile(r"\s*(-?\d+)")
_TAGGED_INT = re.compile(r"<answer>\s*(-?\d+)\s*</answer>")


def evaluate(operands: list[int], ops: list[str]) -> int:
    """Value with the usual precedence (* before + and -), as a sum of signed product terms."""
    total, sign, term = 0, 1, operands[0]
    for op, x in zip(ops, operands[1:]):
        if op == "*":
            term *= x
        else:
            total += sign * term
            sign, term = (1 if op == "+" else -1), x
    return total + sign * term


def _expr(operands: list[int], ops: list[str]) -> str:
    return str(operands[0]) + "".join(op + str(x) for op, x in zip(ops, operands[1:]))


def parse_first_int(text: str) -> Optional[int]:
    """The integer the completion starts with (after whitespace): "19" and " 19\n" -> 19, "x19" -> None."""
    m = _FIRST_INT.match(text)
    return int(m.group(1)) if m else None


def parse_tagged_int(text: str) -> Optional[int]:
    """The integer inside the first <answer>...</answer> tag, else None."""
    m = _TAGGED_INT.search(text)
    return int(m.group(1)) if m else None


class ArithmeticTask(Task):
    name = "arithmetic"
    # Problem spaces up to this size are enumerated so the held-out set is exact; larger ones use a
    # hash threshold. A class attribute so tests can force the threshold path on a small space.
    enumerate_limit = 100_000

    def __init__(self, seed: int = 1234, num_eval: int = 200, max_operand: int = 20,
                 num_operands: int = 2, operations: str = "+-", chat: bool = False,
                 num_train: Optional[int] = None) -> None:
        super().__init__(seed=seed, num_eval=num_eval, chat=chat)
        self.num_train = num_train
        self.max_operand = max_operand
        self.num_operands = num_operands
        self.ops = list(dict.fromkeys(operations))  # distinct, in the order given
        if not self.ops or not set(self.ops) <= set("+-*"):
            raise ConfigError(f"task.operations={operations!r} must be a non-empty subset of '+-*'.")
        space = (max_operand + 1) ** num_operands * len(self.ops) ** (num_operands - 1)
        # Keep at least half of the problems for training; a tiny space cannot spare more.
        if num_eval > space // 2:
            raise ConfigError(
                f"task.num_eval={num_eval} is more than half of the {space} distinct problems of "
                f"max_operand={max_operand}, num_operands={num_operands}, operations={operations!r}; "
                f"set task.num_eval <= {space // 2} or raise task.max_operand.")
        self._heldout_set: Optional[frozenset[str]] = None
        if space <= self.enumerate_limit:
            every = (_expr(list(xs), list(ops))
                     for xs in itertools.product(range(max_operand + 1), repeat=num_operands)
                     for ops in itertools.product(self.ops, repeat=num_operands - 1))
            ranked = sorted(every, key=self._hash)
            self._heldout_set = frozenset(ranked[:num_eval])
            self._eval = [self._example_from_expr(e) for e in ranked[:num_eval]]
        else:
            # Expect ~4x num_eval held-out problems (at least 1% of the space), so the eval draw
            # below finds num_eval distinct ones quickly and training loses little.
            self._p = min(0.5, max(0.01, 4 * num_eval / space))
            self._eval = self._draw_eval()

    def _hash(self, expr: str) -> float:
        """A uniform number in [0, 1) fixed by (seed, expression)."""
        h = hashlib.blake2b(f"{self.seed}|{expr}".encode(), digest_size=8).digest()
        return int.from_bytes(h, "big") / 2.0 ** 64

    def is_heldout(self, expr: str) -> bool:
        if self._heldout_set is not None:
            return expr in self._heldout_set
        return self._hash(expr) < self._p

    def _draw(self, rng: random.Random) -> tuple[str, int]:
        operands = [rng.randint(0, self.max_operand) for _ in range(self.num_operands)]
        ops = [rng.choice(self.ops) for _ in range(self.num_operands - 1)]
        return _expr(operands, ops), evaluate(operands, ops)

    def _draw_eval(self) -> list[Example]:
        rng = random.Random(f"trainfit-arith-eval|{self.seed}")
        seen: dict[str, None] = {}
        for _ in range(100 * self.num_eval + 10_000):
            if len(seen) >= self.num_eval:
                break
            expr, _ = self._draw(rng)
            if self.is_heldout(expr):
                seen[expr] = None
        return [self._example_from_expr(e) for e in seen]

    def _example_from_expr(self, expr: str) -> Example:
        # Re-parse rather than carry operands around: the expression is the identity of a problem.
        operands = [int(x) for x in re.split(r"[+\-*]", expr)]
        ops = re.findall(r"[+\-*]", expr)
        answer = str(evaluate(operands, ops))
        return self.make_example(self.prompt_text(expr), answer, self.target_text(answer),
                                 {"expression": expr, "answer": answer})

    def prompt_text(self, expr: str) -> str:
        return f"{expr}="

    def target_text(self, answer: str) -> str:
        return answer

    def train_example(self, i: int) -> Example:
        # A fresh generator per index makes example i independent of which others were drawn
        # (resume, data-parallel ranks); rejection keeps every held-out problem out of training.
        if self.num_train is not None:  # a fixed set of problems: index i cycles over it
            i %= self.num_train
        rng = random.Random(f"trainfit-arith|{self.seed}|{i}")
        while True:
            expr, value = self._draw(rng)
            if not self.is_heldout(expr):
                answer = str(value)
                return self.make_example(self.prompt_text(expr), answer, self.target_text(answer),
                                         {"expression": expr, "answer": answer})

    def eval_examples(self) -> list[Example]:
        return list(self._eval)

    def is_correct(self, completion: str, ex: Example) -> bool:
        value = parse_first_int(completion)
        return value is not None and str(value) == ex.answer


class ArithmeticTaggedTask(ArithmeticTask):
    """The same problems, answered in a format: "<answer>19</answer>". Rewards: format, correctness."""

    name = "arithmetic_tagged"

    def prompt_text(self, expr: str) -> str:
        return f"{expr} in tags:"

    def target_text(self, answer: str) -> str:
        return f"<answer>{answer}</answer>"

    def is_correct(self, completion: str, ex: Example) -> bool:
        value = parse_tagged_int(completion)
        return value is not None and str(value) == ex.answer

    def is_formatted(self, completion: str) -> bool:
        return re.search(ANSWER_TAG_REGEX, completion) is not None

    def format_reward(self, prompts: list, completions: list[str], **fields: list) -> list[float]:
        return [1.0 if self.is_formatted(c) else 0.0 for c in completions]

    def reward_funcs(self) -> list[tuple[str, RewardFn]]:
        return [("format", self.format_reward), ("correctness", self.correctness_reward)]

    def stop_strings(self) -> list[str]:
        return ["</answer>"]
