"""Checks on OpenAI function schemas and on the arguments of a call, with `jsonschema`.

Both return readable strings instead of raising: a bad schema is a load-time problem list, bad
arguments are an observation the model reads (``error: argument 'expression': 12 is not of
type 'string'``).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import jsonschema
from jsonschema.exceptions import best_match

from dapo_flow.tools.base import NAME_PATTERN

_Validator = jsonschema.Draft202012Validator


def schema_problems(schema: Any) -> list[str]:
    """What is wrong with an OpenAI function schema, ``[]`` when nothing is."""
    if not isinstance(schema, Mapping) or schema.get("type") != "function":
        return ['it must be a dict {"type": "function", "function": {...}}']
    fn = schema.get("function")
    if not isinstance(fn, Mapping):
        return ['"function" must be a dict with "name", "description" and "parameters"']
    problems = []
    name = fn.get("name")
    if not isinstance(name, str) or not re.match(NAME_PATTERN, name):
        problems.append(f"function.name {name!r} must be 1-64 letters, digits, '_' or '-'")
    if not isinstance(fn.get("description", ""), str):
        problems.append("function.description must be a string")
    params = fn.get("parameters")
    if not isinstance(params, Mapping) or params.get("type") != "object":
        problems.append('function.parameters must be a JSON schema with "type": "object"')
        return problems
    try:
        _Validator.check_schema(params)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "(top)"
        problems.append(f"function.parameters is not a valid JSON schema at {where}: {exc.message}")
    return problems


def argument_error(schema: Mapping[str, Any], arguments: Any) -> str | None:
    """Why ``arguments`` do not fit the tool's parameters, or None when they do."""
    if not isinstance(arguments, Mapping):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    error = best_match(_Validator(schema["function"]["parameters"]).iter_errors(dict(arguments)))
    if error is None:
        return None
    path = "/".join(str(p) for p in error.absolute_path)
    return f"argument '{path}': {error.message}" if path else f"arguments: {error.message}"


def single_string_parameter(schema: Mapping[str, Any]) -> str | None:
    """The parameter a bare-string call fills: the only required one, when it is a string.
    None when the tool has no such parameter (then it needs JSON arguments)."""
    params = schema["function"]["parameters"]
    required = params.get("required", [])
    if len(required) != 1:
        return None
    prop = params.get("properties", {}).get(required[0], {})
    return required[0] if prop.get("type") == "string" else None
