"""Built-in addition task splits and the rule-based verifiers (table-driven)."""

from __future__ import annotations

import sys

import pytest

from dapo_flow.errors import DapoFlowError, DataError
from dapo_flow.data.tasks import (
    AdditionTask,
    extract_math_answer,
    last_boxed,
    normalize_math_answer,
    verify_addition,
    verify_math,
)


def test_addition_splits_are_disjoint_deterministic_and_correct():
    task = AdditionTask(seed=3)
    train, val = task.problems("train"), task.problems("val")
    assert len(val) == 500 and len(train) == 10_000 - 500
    assert not {p.prompt for p in train} & {p.prompt for p in val}
    assert task.problems("val") == val  # same seed, same order
    assert AdditionTask(seed=4).problems("val") != val
    for p in train[:50] + val[:50]:
        a, b = p.prompt.rstrip("=").split("+")
        assert p.answer == str(int(a) + int(b))
    assert [p.index for p in val] == list(range(500))


def test_addition_train_size_and_range():
    task = AdditionTask(low=3, high=7, train_size=10, val_size=5)
    train, val = task.problems("train"), task.problems("val")
    assert (len(train), len(val)) == (10, 5)
    assert all(3 <= int(x) <= 7 for p in train + val for x in p.prompt.rstrip("=").split("+"))
    # growing train never moves val pairs into train
    bigger = AdditionTask(low=3, high=7, train_size=20, val_size=5)
    assert bigger.problems("val") == val
    assert not {p.prompt for p in bigger.problems("train")} & {p.prompt for p in val}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"low": 5, "high": 2}, "low <= high"),
        ({"low": 0, "high": 2, "val_size": 5, "train_size": 5}, "exceeds the 9 distinct pairs"),
        ({"val_size": -1}, ">= 0"),
    ],
)
def test_addition_task_errors(kwargs, match):
    with pytest.raises(DataError, match=match):
        AdditionTask(**kwargs)


def test_addition_unknown_split():
    with pytest.raises(DataError, match="unknown split 'test'"):
        AdditionTask().problems("test")


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("46", "46", 1.0),
        (" 46 ", "46", 1.0),
        ("46\n", "46", 1.0),
        ("47", "46", -1.0),
        ("4", "46", -1.0),
        ("466", "46", -1.0),  # truncated run-on: no EOS after the answer
        ("", "46", -1.0),
        ("046", "46", -1.0),
    ],
)
def test_verify_addition(response, truth, expected):
    assert verify_addition(response, truth) == expected


def test_verify_addition_custom_rewards():
    assert verify_addition("1", "1", correct=2.0, wrong=0.0) == 2.0
    assert verify_addition("2", "1", correct=2.0, wrong=0.0) == 0.0


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so \boxed{42}", "42"),
        (r"\boxed{1} then \boxed{2}", "2"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{a_{1}+{b}}.", "a_{1}+{b}"),
        (r"\boxed 7 is it", "7"),
        (r"\fbox{3}", "3"),
        (r"\boxed{unbalanced", None),
        ("no box", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"thus \boxed{12}. Answer: 13", "12"),  # boxed wins
        ("work...\nAnswer: 17\nmore\nAnswer: 18", "18"),
        ("answer : x = 3", "x = 3"),
        ("the total is 1,234 apples and 5 pears", "5"),
        ("it is -2.5", "-2.5"),
        ("nothing numeric", None),
    ],
)
def test_extract_math_answer(text, expected):
    assert extract_math_answer(text) == expected


@pytest.mark.parametrize(
    "raw, expected",
    [
        (" 42 ", "42"),
        ("$42$", "42"),
        ("2.0", "2"),
        ("2.50", "2.5"),
        ("1,000", "1000"),
        (r"\dfrac{1}{2}", r"\frac{1}{2}"),
        (r"\tfrac12", r"\frac{1}{2}"),
        (r"\left( 1, 2 \right)", "(1,2)"),
        (r"90^\circ", "90"),
        (r"50\%", "50"),
        (r"\text{5 cm}", "5cm"),
        ("x = 5", "5"),
        ("7.", "7"),
        (r"\sqrt2", r"\sqrt{2}"),
    ],
)
def test_normalize_math_answer(raw, expected):
    assert normalize_math_answer(raw) == expected


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        (r"The answer is \boxed{\dfrac{1}{2}}", r"\frac{1}{2}", 1.0),
        (r"\boxed{2.0}", "2", 1.0),
        ("Answer: $1,000$", "1000", 1.0),
        ("so we get 12", "12", 1.0),
        (r"\boxed{13}", "12", -1.0),
        ("I don't know", "12", -1.0),
        (r"\boxed{12}", r"\boxed{12}", 1.0),  # ground truth given boxed
    ],
)
def test_verify_math(response, truth, expected):
    assert verify_math(response, truth) == expected


@pytest.mark.parametrize(
    "response, truth, expected",
    [  # equal as mathematics, not as strings: math-verify decides
        (r"The answer is \boxed{0.5}", r"\frac{1}{2}", 1.0),
        (r"so $\boxed{(x+1)^2}$", "x^2+2x+1", 1.0),
        (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", 1.0),
        (r"\boxed{\{1, 2\}}", r"\{2, 1\}", 1.0),
        (r"\boxed{0.51}", r"\frac{1}{2}", -1.0),
        (r"\boxed{x^2+1}", "(x+1)^2", -1.0),
        (r"\boxed{\frac{", r"\frac{1}{2}", -1.0),  # unparsable: wrong, not an error
    ],
)
def test_verify_math_takes_equivalent_forms(response, truth, expected):
    import math_verify  # noqa: F401  a dependency: a broken install fails here, it is not skipped

    assert verify_math(response, truth) == expected


def test_verify_math_without_math_verify_is_an_error(monkeypatch):
    # a broken install used to score by the rule match alone, every equivalent form wrong
    monkeypatch.setitem(sys.modules, "math_verify", None)  # what `import math_verify` fails on
    with pytest.raises(DapoFlowError, match=r"builtin:math needs math-verify.*reinstall dapo-flow"):
        verify_math(r"The answer is \boxed{0.5}", r"\frac{1}{2}")


def test_verify_math_custom_rewards():
    assert verify_math("no", "1", correct=1.0, wrong=0.0) == 0.0


@pytest.mark.timeout(20)
@pytest.mark.parametrize("options, match", [
    ({"high": 100_000}, r"\[0, 100000\] gives 10,000,200,001 pairs, over the 1,000,000 .* \(high - low <= 999\)"),
    ({"high": "99"}, r"option high must be a whole number, got str '99'"),
    ({"low": 1.5}, r"option low must be a whole number, got float 1.5"),
    ({"val_size": None}, r"option val_size must be a whole number, got NoneType None"),
])
def test_addition_options_are_bounded_and_typed(options, match):
    # a wide range allocated a permutation of every pair (80 GB for high: 100000); a string or
    # None ended in a TypeError traceback
    with pytest.raises(DataError, match=match):
        AdditionTask(**options)
