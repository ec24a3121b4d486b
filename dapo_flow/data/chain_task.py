"""``builtin:chain``: multi-step arithmetic whose answer takes tens of tokens of written work.

A prompt asks for ``a op b op c ...`` (by default 3-6 operands in 1..9, ``+`` and ``-``); the
expected response writes every partial result on its own line, then the answer::

    Compute 5-7+3.       ->   5-7=-2
                              -2+3=1
                              Answer: 1

A correct response is ~15-40 tokens (digits are single tokens in the chat model's tokenizer),
so a response budget of 40 tokens leaves little room to ramble: overlong shaping, token-level
loss and clip-higher have something to act on, unlike ``a+b=``'s 1-3 answer tokens.
The verifier reads only the last ``Answer:`` line: a response cut off before it scores wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from dapo_flow.data.tasks import SPLITS, Problem
from dapo_flow.errors import DataError

CHAIN = "builtin:chain"
CHAIN_OPTIONS = ("low", "high", "min_terms", "max_terms", "train_size", "val_size")
_ANSWER = re.compile(r"Answer:\s*(-?\d+)\s*$")


@dataclass(frozen=True)
class ChainTask:
    """Expressions of ``min_terms``..``max_terms`` operands in [low, high] joined by + or -.
    Val expressions are drawn first and never reach train; both splits are seeded."""

    low: int = 1
    high: int = 9
    min_terms: int = 3
    max_terms: int = 6
    train_size: int = 20_000
    val_size: int = 500
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("low", "high", "min_terms", "max_terms", "train_size", "val_size", "seed"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise DataError(f"{CHAIN}: option {name} must be a whole number, got "
                                f"{type(value).__name__} {value!r}")
        if not 0 <= self.low <= self.high <= 999:
            raise DataError(f"{CHAIN}: need 0 <= low <= high <= 999, got low={self.low} high={self.high}")
        if not 2 <= self.min_terms <= self.max_terms <= 8:
            raise DataError(f"{CHAIN}: need 2 <= min_terms <= max_terms <= 8, got "
                            f"min_terms={self.min_terms} max_terms={self.max_terms}")
        if self.train_size < 0 or self.val_size < 0:
            raise DataError(f"{CHAIN}: train_size and val_size must be >= 0")
        if self.train_size + self.val_size > 1_000_000:
            raise DataError(f"{CHAIN}: train_size + val_size must be <= 1,000,000; lower them")
        if self.train_size + self.val_size > self._distinct_bound():
            raise DataError(f"{CHAIN}: train_size + val_size = {self.train_size + self.val_size} is more "
                            f"than the distinct expressions [{self.low}, {self.high}] with "
                            f"{self.min_terms}-{self.max_terms} operands allow; widen the range or lower them")

    def _distinct_bound(self) -> int:
        width = self.high - self.low + 1
        return sum(width ** k * 2 ** (k - 1) for k in range(self.min_terms, self.max_terms + 1))

    def problems(self, split: str) -> list[Problem]:
        """The split's problems in a fixed, seeded order; prompts are the bare expressions
        (``37+45-19``), answers their values (``63``)."""
        if split not in SPLITS:
            raise DataError(f"{CHAIN}: unknown split '{split}'; use one of {SPLITS}")
        rng = np.random.default_rng(self.seed)
        seen: set[str] = set()
        splits: dict[str, list[Problem]] = {"val": [], "train": []}
        for name, size in (("val", self.val_size), ("train", self.train_size)):
            out = splits[name]
            while len(out) < size:
                terms = int(rng.integers(self.min_terms, self.max_terms + 1))
                operands = rng.integers(self.low, self.high + 1, size=terms).tolist()
                ops = rng.choice(["+", "-"], size=terms - 1).tolist()
                expr = str(operands[0]) + "".join(f"{o}{x}" for o, x in zip(ops, operands[1:]))
                if expr in seen:
                    continue
                seen.add(expr)
                out.append(Problem(prompt=expr, answer=str(evaluate(expr)), index=len(out)))
            if name == split:
                return out
        raise AssertionError("unreachable")


def question(expression: str) -> str:
    """The user message of a chain problem."""
    return f"Compute {expression}."


def solution(expression: str) -> str:
    """The worked response the warm start teaches: one line per operation, then the answer."""
    lines = [f"{value}{op}{operand}={result}" for value, op, operand, result in _steps(expression)]
    return "\n".join(lines + [f"Answer: {evaluate(expression)}"])


def evaluate(expression: str) -> int:
    """The value of an expression of integers joined by + and - (left to right)."""
    steps = _steps(expression)
    return steps[-1][3] if steps else int(expression)


def _steps(expression: str) -> list[tuple[int, str, int, int]]:
    """(value so far, operator, operand, result) per operation, left to right."""
    tokens = re.findall(r"\d+|[+-]", expression)
    value, out = int(tokens[0]), []
    for op, operand in zip(tokens[1::2], tokens[2::2]):
        result = value + int(operand) if op == "+" else value - int(operand)
        out.append((value, op, int(operand), result))
        value = result
    return out


def verify_chain(response_text: str, ground_truth: str, *, correct: float = 1.0, wrong: float = -1.0) -> float:
    """``correct`` iff the response's last line is ``Answer: N`` with N the ground truth. The
    steps are not graded (as with DAPO's outcome reward); a response without the line (cut off
    by the length budget, or never written) is wrong."""
    lines = response_text.strip().splitlines()
    match = _ANSWER.search(lines[-1]) if lines else None
    return correct if match and match.group(1) == ground_truth.strip() else wrong
