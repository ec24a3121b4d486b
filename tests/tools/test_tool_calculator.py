"""The calculator: exact results, every limit answered at once, and nothing but arithmetic."""

from __future__ import annotations

import pytest

from dapo_flow.tools import calculator
from dapo_flow.tools.calculator import CalcError, Calculator, Config, evaluate


def run(expression: str, **config) -> tuple[str, float]:
    result = Calculator(Config(**config)).execute("r0", {"expression": expression})
    return result.text, result.metrics["error"]


@pytest.mark.parametrize("expression, expected", [
    ("12*34", "408"), ("1 + 2 * 3", "7"), ("(1 + 2) * 3", "9"), ("-3 + +4", "1"), ("-(-3)", "3"),
    ("2**10", "1024"), ("2**3**2", "512"), ("7 // 2", "3"), ("-7 // 2", "-4"), ("7 % 3", "1"),
    ("7 / 2", "3.5"), ("1 / 3", repr(1 / 3)), ("0.1 + 0.2", repr(0.1 + 0.2)), ("2 ** -1", "0.5"),
    ("6.0 / 2", "3.0"), ("1e3 * 2", "2000.0"), (" 2*3 ", "6"), ("1_000 + 1", "1001"),
])
def test_results(expression, expected):
    assert run(expression) == (expected, 0.0)


def test_integers_stay_exact():
    assert run("123456789123456789 * 987654321987654321")[0] == str(123456789123456789 * 987654321987654321)
    assert run("2**200 + 1")[0] == str(2**200 + 1)
    assert run("10**30 / 10**10")[0] == "1" + "0" * 20  # an exact division stays an integer
    assert run("(2**100 + 2) / 3")[0] == str((2**100 + 2) // 3)  # beyond a float's 53 bits
    assert run("(2**100 + 1) / 3")[0] == repr((2**100 + 1) / 3)  # inexact: a float


@pytest.mark.parametrize("expression, message", [
    ("1" * 300, "300 characters, at most 256"),
    ("2 ** 5000", "exponent 5000 exceeds 1024"),
    ("2 ** -5000", "exponent -5000 exceeds 1024"),
    ("2.0 ** 2000.5", "exponent 2000.5 exceeds 1024"),
    ("10 ** 1001", "about 1001 digits, more than 1000"),
    ("10**999 * 10**999", "more than 1000 digits"),
    ("10 ** 1000", "more than 1000 digits"),
    ("1e300 * 10", "exceeds 1e+300 in magnitude"),
    ("10.0 ** 400", "too large for a float"),
    ("10**999 * 1.5", "too large for a float"),
    ("1 / 0", "division by zero"), ("1 // 0", "division by zero"), ("1 % 0", "division by zero"),
    ("0 ** -1", "division by zero"), ("(-8) ** 0.5", "complex"),
    ("", "empty"), ("1 +", "cannot parse"), ("(1", "cannot parse"),
])
def test_limits_and_failures_are_error_results(expression, message):
    text, error = run(expression)
    assert error == 1.0 and text.startswith("error: ") and message in text


def test_tower_of_powers_answers_at_once(monkeypatch):
    # at once: the limits are checked before the work they bound, so no value bigger than 9**9 is
    # ever computed (9**(9**9) alone has 370 million digits); every value passes through check()
    seen = []
    check = calculator._Walk.check
    monkeypatch.setattr(calculator._Walk, "check", lambda self, value: check(self, seen.append(value) or value))
    text, error = run("9**9**9**9")
    assert (text, error) == ("error: the exponent 387420489 exceeds 1024 in magnitude", 1.0)
    assert seen == [9, 9, 9, 9, 9**9]


def test_limits_are_configurable():
    assert run("2 ** 20", max_exponent=10)[1] == 1.0
    assert run("10 ** 5", max_digits=5)[0] == "error: an integer has more than 5 digits"
    assert run("1.5 * 1e10", max_magnitude=1e9)[1] == 1.0
    assert run("1+1+1", max_chars=4)[1] == 1.0


@pytest.mark.parametrize("expression, what", [
    ("x + 1", "names"), ("__import__('os')", "function calls"), ("abs(-1)", "function calls"),
    ("(1).real", "attributes"), ("lambda: 1", "lambdas"), ("[i for i in (1, 2)]", "comprehensions"),
    ("{i: i for i in (1,)}", "comprehensions"), ("sum(i for i in (1,))", "function calls"),
    ("(i for i in (1,))", "comprehensions"), ("'a' * 3", "the literal 'a'"), ("True + 1", "the literal True"),
    ("1j", "the literal 1j"), ("1 < 2", "comparisons"), ("1 and 2", "and/or"), ("(1, 2)", "Tuple"),
    ("[1][0]", "indexing"), ("2 ^ 3", "write a power as **"), ("~1", "'~'"), ("1 if 1 else 2", "IfExp"),
    ("(y := 2)", "NamedExpr"), ("print(1); 2", "cannot parse"), ("import os", "cannot parse"),
])
def test_only_arithmetic_is_accepted(expression, what):
    text, error = run(expression)
    assert error == 1.0 and what in text, text


def test_bad_arguments_are_error_results_not_exceptions():
    tool = Calculator()
    assert tool.execute("r0", {}).metrics["error"] == 1.0
    assert tool.execute("r0", {"expression": 12}).text.startswith("error: ")


def test_lifecycle_methods_are_no_ops():
    tool = Calculator()
    tool.create("r0", ground_truth="42")
    assert tool.calc_reward("r0") == 0.0
    tool.release("r0")


def test_evaluate_returns_numbers():
    assert evaluate("2**64") == 2**64 and isinstance(evaluate("2**64"), int)
    assert evaluate("3/4") == 0.75


def test_text_python_warns_about_is_an_error_for_the_model_not_console_noise():
    """``12*34a`` makes ast.parse print a SyntaxWarning ("invalid decimal literal") to stderr;
    in a run that is noise on the console, once per malformed sample: it is a parse error here."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning escaping evaluate fails the test
        with pytest.raises(CalcError, match="cannot parse the expression"):
            evaluate("12*34a")
