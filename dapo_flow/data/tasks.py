"""Built-in tasks and rule-based verifiers.

- ``builtin:addition``: prompts ``"a+b="`` with disjoint, seeded train / val splits.
- ``verify_addition``: exact match of the decoded answer (special tokens removed).
- ``verify_math``: DAPO-style rule verifier (Yu et al. 2025, §2.4): extract the final answer
  (last ``\\boxed{}``, else ``Answer: X``, else the last number), normalize both sides,
  compare; when the strings differ, ``math-verify`` decides whether the two are the same
  mathematical object (``0.5`` = ``\\frac{1}{2}``, ``(x+1)^2`` = ``x^2+2x+1``, sets, intervals);
  +1 / -1.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from dapo_flow.errors import DataError, broken_dependency

ADDITION = "builtin:addition"
SPLITS = ("train", "val")
# every split is cut from one permutation of all pairs (8 bytes each): bounded so a wide range
# (high: 100000 is 10^10 pairs, 80 GB) is refused instead of exhausting memory; a million
# pairs are ~0.2 GB of prompts, each tokenized at start
MAX_ADDITION_PAIRS = 1_000_000


@dataclass(frozen=True)
class Problem:
    """One prompt with its ground truth; ``index`` is stable within its split."""

    prompt: str
    answer: str
    index: int


@dataclass(frozen=True)
class AdditionTask:
    """``a+b=`` for a, b in [low, high]; val pairs are drawn first so they never reach train."""

    low: int = 0
    high: int = 99
    train_size: int | None = None  # None: every pair not in val
    val_size: int = 500
    seed: int = 0

    def __post_init__(self) -> None:
        check_pair_options(ADDITION, self)

    @property
    def num_pairs(self) -> int:
        return (self.high - self.low + 1) ** 2

    def problems(self, split: str) -> list[Problem]:
        """The split's problems in a fixed, seeded order."""
        return [Problem(prompt=f"{a}+{b}=", answer=str(a + b), index=i)
                for i, (a, b) in enumerate(pair_split(ADDITION, self, split))]


class PairOptions(Protocol):
    """The options of a task over pairs (a, b) in [low, high]^2 (``AdditionTask``, ``ToolArithTask``)."""

    low: int
    high: int
    train_size: int | None
    val_size: int
    seed: int


def check_pair_options(source: str, task: PairOptions) -> None:
    """DataError (naming ``source``) unless the options give valid, disjoint splits."""
    for name in ("low", "high", "val_size", "train_size", "seed"):
        value = getattr(task, name)
        if not (isinstance(value, int) and not isinstance(value, bool)) and not (
            name == "train_size" and value is None
        ):
            raise DataError(f"{source}: option {name} must be a whole number, got "
                            f"{type(value).__name__} {value!r}")
    if not 0 <= task.low <= task.high:
        raise DataError(f"{source}: need 0 <= low <= high, got low={task.low} high={task.high}")
    total, train = (task.high - task.low + 1) ** 2, task.train_size
    if total > MAX_ADDITION_PAIRS:
        raise DataError(
            f"{source}: [{task.low}, {task.high}] gives {total:,} pairs, over the "
            f"{MAX_ADDITION_PAIRS:,} the task can draw splits from; narrow the range "
            f"(high - low <= {int(MAX_ADDITION_PAIRS ** 0.5) - 1})"
        )
    if task.val_size < 0 or (train is not None and train < 0):
        raise DataError(f"{source}: train_size and val_size must be >= 0")
    if task.val_size + (train or 0) > total:
        raise DataError(
            f"{source}: train_size + val_size = {task.val_size + (train or 0)} exceeds the "
            f"{total} distinct pairs in [{task.low}, {task.high}]; lower them or widen the range"
        )


def pair_split(source: str, task: PairOptions, split: str) -> list[tuple[int, int]]:
    """The split's pairs (a, b) in a fixed, seeded order: one permutation of all pairs, val
    cut first, so val pairs never reach train, whatever ``train_size``."""
    if split not in SPLITS:
        raise DataError(f"{source}: unknown split '{split}'; use one of {SPLITS}")
    width = task.high - task.low + 1
    order = np.random.default_rng(task.seed).permutation(width ** 2)
    if split == "val":
        picked = order[: task.val_size]
    else:
        end = None if task.train_size is None else task.val_size + task.train_size
        picked = order[task.val_size : end]
    return [(task.low + k // width, task.low + k % width) for k in picked.tolist()]


# --- verifiers -----------------------------------------------------------------------------


def verify_addition(
    response_text: str, ground_truth: str, *, correct: float = 1.0, wrong: float = -1.0
) -> float:
    """``correct`` iff the response (decoded without special tokens) is exactly the answer."""
    return correct if response_text.strip() == ground_truth.strip() else wrong


_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")
_ANSWER_LINE = re.compile(r"(?i)answer\s*[:：]\s*([^\n]+)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
# (pattern, replacement) applied in order by normalize_math_answer
_SUBSTITUTIONS: tuple[tuple[str, str], ...] = (
    (r"\\left|\\right", ""),
    (r"\\[dt]frac", r"\\frac"),
    (r"\\text\{(.*?)\}|\\textbf\{(.*?)\}|\\mathrm\{(.*?)\}", r"\1\2\3"),
    (r"\^\{?\\circ\}?|\\%|%|\$|\\[,;:!]", ""),
    (r"\s+", ""),
    (r"\\frac(\d)(\d)", r"\\frac{\1}{\2}"),  # \frac12 -> \frac{1}{2}
    (r"\\sqrt(\d+)", r"\\sqrt{\1}"),
    (r"\.$", ""),
    (r"^[a-zA-Z]\w*=(?!=)", ""),  # "x=5" -> "5"
)


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (nested braces kept) or ``\\boxed X``; None if none."""
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    start = matches[-1].end()
    if start >= len(text) or text[start] != "{":  # "\boxed 5": up to the next space or "$"
        return re.split(r"[\s$]", text[start:], maxsplit=1)[0] or None
    depth = 0
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + 1 : i]
    return None  # unbalanced: treat as no answer


def extract_math_answer(text: str) -> str | None:
    """The final answer: last ``\\boxed{}``, else the last ``Answer: X`` line, else the last number."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    lines = _ANSWER_LINE.findall(text)
    if lines:
        return lines[-1]
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def normalize_math_answer(answer: str) -> str:
    """Canonical form for string comparison (spaces, ``$``, ``\\left``, ``\\dfrac``, ``2.0``...)."""
    s = answer.strip()
    for pattern, repl in _SUBSTITUTIONS:
        s = re.sub(pattern, repl, s)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    if re.fullmatch(r"-?\d+\.\d+", s):
        s = s.rstrip("0").rstrip(".")
    return s


def verify_math(
    response_text: str, ground_truth: str, *, correct: float = 1.0, wrong: float = -1.0
) -> float:
    """``correct`` iff the extracted, normalized answer equals the normalized ground truth, or
    math-verify finds the response's final answer equivalent to it (:func:`math_equivalent`)."""
    truth = last_boxed(ground_truth) or ground_truth
    predicted = extract_math_answer(response_text)
    if predicted is not None and normalize_math_answer(predicted) == normalize_math_answer(truth):
        return correct  # the rule match: no parsing needed
    return correct if math_equivalent(response_text, truth) else wrong


def math_equivalent(response_text: str, truth: str) -> bool:
    """Whether math-verify (Hugging Face's LaTeX / expression verifier, as in verl's
    ``math_verify`` reward) parses an answer from ``response_text`` that equals ``truth``
    symbolically. ~5 ms a sample; its own signal-based timeouts are off (they only work in a
    main thread): the score operator's ``timeout_s`` bounds a sample instead. False when it
    parses nothing or fails. math-verify is a dependency: when it does not import, an error
    (scoring by the rule match alone would grade equivalent answers wrong, silently)."""
    try:
        from math_verify import parse, verify
    except ImportError as exc:
        raise broken_dependency("math-verify", exc, needed_by="builtin:math") from exc
    _quiet_math_verify()
    try:
        gold = parse(truth if "$" in truth or "\\boxed" in truth else f"${truth}$", parsing_timeout=None)
        answer = parse(response_text, parsing_timeout=None)
        return bool(gold and answer and verify(gold, answer, timeout_seconds=None))
    except Exception:  # a parser or sympy failure on odd text is a wrong answer, not a crash
        return False


def _quiet_math_verify() -> None:
    """math-verify warns on every call that its timeouts are off: we bound time ourselves."""
    import logging

    logging.getLogger("math_verify").setLevel(logging.ERROR)
