"""calculator: arithmetic on a whitelist of Python syntax, never ``eval``.

The expression is parsed with ``ast.parse(mode="eval")`` and only these nodes are walked:
int and float literals, ``+ - * / // % **``, unary ``+ -`` and parentheses. Anything else (names,
calls, attributes, strings, lambdas, comprehensions, comparisons) is an error result.

Numbers: integers stay exact, however large (within ``max_digits``). ``/`` of two integers is an
exact integer when the division is exact (``10**30 / 10**10`` is ``100000000000000000000``),
else a float (``7 / 2`` is ``3.5``); any float operand makes the result a float, as in Python.
``//``, ``%`` and ``**`` follow Python (``2 ** -1`` is ``0.5``). Floats print as Python's
shortest round-trip repr (``0.1``, ``1e+20``).

Limits, checked before the work they bound, so ``9**9**9**9`` answers at once: the expression's
length, ``|exponent|``, the digits of every integer along the way, and the magnitude of every
float (overflow and inf are errors). A failure is ``error: <why>`` with ``{"error": 1.0}``.
"""

from __future__ import annotations

import ast
import math
import operator
import threading
import warnings
from typing import Any, Callable

from pydantic import BaseModel, Field

from dapo_flow.core.contract import PARAMS_CONFIG
from dapo_flow.tools.base import ToolResult, error_result

Number = int | float


class Config(BaseModel):
    model_config = PARAMS_CONFIG

    max_chars: int = Field(256, ge=1, le=10_000)
    """Longest expression accepted (also bounds how deeply it nests)."""
    max_exponent: int = Field(1024, ge=1, le=100_000)
    """Largest |exponent| of `**`."""
    max_digits: int = Field(1000, ge=1, le=4000)
    """Most decimal digits of any integer along the way (Python prints at most 4300)."""
    max_magnitude: float = Field(1e300, gt=0, le=1e308)
    """Largest |value| of any float along the way."""


class CalcError(Exception):
    """The expression is not accepted or cannot be computed; the message is for the model."""


SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression exactly: numbers, + - * / // % ** and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (12 + 3) * 45 ** 2"}},
            "required": ["expression"],
        },
    },
}


class Calculator:
    """The built-in ``calculator`` tool: stateless, no reward of its own."""

    Config = Config
    name = "calculator"
    schema = SCHEMA

    def __init__(self, config: Config | None = None):
        self.config = config or Config()

    def create(self, instance_id: str, **create_kwargs: Any) -> None:
        pass

    def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            return error_result("give the expression as a string argument 'expression'")
        try:
            value = evaluate(expression, self.config)
        except CalcError as exc:
            return error_result(str(exc))
        return ToolResult(text=format_number(value), metrics={"error": 0.0})

    def calc_reward(self, instance_id: str) -> float:
        return 0.0

    def release(self, instance_id: str) -> None:
        pass


def format_number(value: Number) -> str:
    return str(value) if isinstance(value, int) else repr(value)


def evaluate(expression: str, config: Config | None = None) -> Number:
    """The value of ``expression``; raises CalcError with a message for the model."""
    cfg = config or Config()
    if len(expression) > cfg.max_chars:
        raise CalcError(f"the expression has {len(expression)} characters, at most {cfg.max_chars}")
    if not expression.strip():
        raise CalcError("the expression is empty")
    try:
        tree = _parse(expression.strip())
    except SyntaxError as exc:
        raise CalcError(f"cannot parse the expression ({exc.msg})") from None
    except (ValueError, MemoryError, RecursionError) as exc:
        raise CalcError(f"invalid expression: {exc}") from None
    try:
        return _Walk(cfg).eval(tree.body)
    except ZeroDivisionError:
        raise CalcError("division by zero") from None
    except OverflowError:
        raise CalcError("a number is too large for a float (floats reach about 1e308)") from None
    except RecursionError:
        raise CalcError("the expression is nested too deeply") from None


_PARSE_LOCK = threading.Lock()  # warnings.catch_warnings swaps process-wide state; calls run in threads


def _parse(expression: str) -> ast.Expression:
    """``ast.parse`` in eval mode, without the SyntaxWarnings it prints for model-written text
    such as ``12*34a`` ("invalid decimal literal"): the model gets the error, not the console."""
    with _PARSE_LOCK, warnings.catch_warnings():
        warnings.simplefilter("error", SyntaxWarning)  # a warning is a parse failure (SyntaxError)
        return ast.parse(expression, mode="eval")


_UNARY: dict[type, Callable[[Number], Number]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_SYMBOLS = {ast.BitXor: "'^' (write a power as **)", ast.BitAnd: "'&'", ast.BitOr: "'|'",
            ast.LShift: "'<<'", ast.RShift: "'>>'", ast.MatMult: "'@'", ast.Invert: "'~'", ast.Not: "'not'"}
_NODES = {ast.Name: "names", ast.Call: "function calls", ast.Attribute: "attributes",
          ast.Lambda: "lambdas", ast.ListComp: "comprehensions", ast.SetComp: "comprehensions",
          ast.DictComp: "comprehensions", ast.GeneratorExp: "comprehensions",
          ast.Subscript: "indexing", ast.Compare: "comparisons", ast.BoolOp: "and/or"}


class _Walk:
    """Evaluates the whitelisted nodes, checking every intermediate value against the limits."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.int_limit = 10 ** cfg.max_digits
        self.binary: dict[type, Callable[[Number, Number], Number]] = {
            ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
            ast.Div: _divide, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: self.power,
        }

    def eval(self, node: ast.AST) -> Number:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return self.check(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return self.check(_UNARY[type(node.op)](self.eval(node.operand)))
        if isinstance(node, ast.BinOp) and type(node.op) in self.binary:
            left, right = self.eval(node.left), self.eval(node.right)
            return self.check(self.binary[type(node.op)](left, right))
        raise CalcError(f"{_unsupported(node)} not allowed: only numbers, + - * / // % ** and parentheses")

    def check(self, value: Number) -> Number:
        if isinstance(value, complex):
            raise CalcError("the result is a complex number")
        if isinstance(value, int) and abs(value) >= self.int_limit:
            raise CalcError(f"an integer has more than {self.cfg.max_digits} digits")
        if isinstance(value, float) and not abs(value) <= self.cfg.max_magnitude:  # also nan
            raise CalcError(f"a number exceeds {self.cfg.max_magnitude:g} in magnitude")
        return value

    def power(self, base: Number, exponent: Number) -> Number:
        if abs(exponent) > self.cfg.max_exponent:
            raise CalcError(f"the exponent {exponent} exceeds {self.cfg.max_exponent} in magnitude")
        if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
            digits = exponent * math.log10(abs(base))  # computed only if it stays within the limit
            if digits > self.cfg.max_digits:
                raise CalcError(f"the result would have about {digits:.0f} digits, "
                                f"more than {self.cfg.max_digits}")
        return base**exponent


def _divide(a: Number, b: Number) -> Number:
    if isinstance(a, int) and isinstance(b, int) and b != 0 and a % b == 0:
        return a // b  # exact: 10**30 / 10**10 stays an integer
    return a / b


def _unsupported(node: ast.AST) -> str:
    if isinstance(node, ast.Constant):
        return f"the literal {node.value!r} is"
    op = getattr(node, "op", None)
    if op is not None and type(op) in _SYMBOLS:
        return f"the operator {_SYMBOLS[type(op)]} is"
    return f"{_NODES.get(type(node), type(node).__name__)} are"
