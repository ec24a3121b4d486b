"""Function-schema checks and argument checks read as sentences about what to fix."""

from __future__ import annotations

import copy

import pytest

from dapo_flow.tools import argument_error, schema_problems, single_string_parameter
from dapo_flow.tools.calculator import SCHEMA


def edited(path: tuple[str, ...], value):
    schema = copy.deepcopy(SCHEMA)
    *parents, last = path
    node = schema
    for key in parents:
        node = node[key]
    node[last] = value
    return schema


@pytest.mark.parametrize("schema, problem", [
    ("calculator", '{"type": "function"'),
    (edited(("type",), "tool"), '{"type": "function"'),
    (edited(("function",), None), '"function" must be a dict'),
    (edited(("function", "name"), "two words"), "function.name 'two words'"),
    (edited(("function", "description"), 3), "description must be a string"),
    (edited(("function", "parameters"), {"type": "string"}), '"type": "object"'),
    (edited(("function", "parameters", "required"), "expression"), "not a valid JSON schema at required"),
])
def test_schema_problems(schema, problem):
    problems = schema_problems(schema)
    assert len(problems) == 1 and problem in problems[0], problems


def test_argument_errors():
    assert argument_error(SCHEMA, {"expression": "1"}) is None
    assert argument_error(SCHEMA, ["1"]) == "arguments must be a JSON object, got list"
    assert argument_error(SCHEMA, {}) == "arguments: 'expression' is a required property"


def test_single_string_parameter():
    assert single_string_parameter(SCHEMA) == "expression"
    assert single_string_parameter(edited(("function", "parameters", "required"), [])) is None
