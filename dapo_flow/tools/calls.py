"""Tool calls in a model's response: parsing, rendering, and where a turn stops.

Formats (:data:`CALL_FORMATS`):

- ``hermes``: Qwen / Hermes chat templates, ``<tool_call>{"name": N, "arguments": {...}}</tool_call>``,
  any number per turn; ``arguments`` may also be a JSON-encoded string, as some models write it.
- ``compact``: for the tiny built-in models, ``<call>NAME: ARGUMENT</call>``; the argument text
  (stripped) fills the tool's single required string parameter: ``<call>calculator: 12*34</call>``
  is ``calculator(expression="12*34")``.

A call left open at the very end of the text is read as if closed: an engine may drop the stop
string (``</call>``) from its output. :func:`parse_calls` never raises: a malformed call, an
unknown tool, arguments that break the schema and calls over the per-turn limit come back as
:class:`CallError`, whose ``observation`` the model is shown instead of a result.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Protocol

from dapo_flow.tools.schema import argument_error, single_string_parameter

ErrorKind = Literal["malformed", "unknown_tool", "bad_arguments", "too_many_calls"]


@dataclass(frozen=True)
class ParsedCall:
    """A well-formed call to a known tool with valid arguments; ``index``: its place in the turn."""

    name: str
    arguments: dict[str, Any]
    index: int


@dataclass(frozen=True)
class CallError:
    """A call that is not run. ``name`` is the tool it named, when it got that far."""

    kind: ErrorKind
    message: str
    index: int
    name: str = ""

    @property
    def observation(self) -> str:
        return f"error: {self.message}"


@dataclass(frozen=True)
class ParsedCalls:
    """What one turn asked for: the calls to run and the errors to report, each in turn order."""

    calls: tuple[ParsedCall, ...]
    errors: tuple[CallError, ...]

    @property
    def asked_for_tools(self) -> bool:
        """Whether the turn tried to call a tool (else it is a final answer)."""
        return bool(self.calls or self.errors)


@dataclass(frozen=True)
class RawCall:
    """A call as written, before its tool and arguments are checked; a string argument is the
    compact format's bare argument."""

    name: str
    arguments: dict[str, Any] | str
    index: int


class CallFormat(Protocol):
    stop_strings: tuple[str, ...]
    """Generation stops after any of these: the turn ends at a call, then the tools run."""

    def extract(self, text: str) -> list[RawCall | CallError]:
        """The calls in ``text`` in order, syntax only (tool names and arguments unchecked)."""

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        """How the model writes this call (warm-start demonstrations, tests)."""

    def render_text(self, text: str) -> str:
        """A tool's response as text appended to the conversation (no chat template)."""

    def message(self, text: str) -> dict[str, str]:
        """A tool's response as a chat message, for the tokenizer's chat template."""

    def tool_problems(self, schemas: Mapping[str, Mapping[str, Any]]) -> list[str]:
        """Why some of these tools cannot be called in this format (checked when compiling)."""

    def without_calls(self, text: str) -> str:
        """``text`` with its calls cut out (an OpenAI message's ``content`` beside its ``tool_calls``)."""


class Hermes:
    stop_strings = ("</tool_call>",)
    _CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)

    def extract(self, text: str) -> list[RawCall | CallError]:
        return [self._decode(m.group(1), i) for i, m in enumerate(self._CALL.finditer(text))]

    def _decode(self, body: str, index: int) -> RawCall | CallError:
        shape = 'write <tool_call>{"name": "TOOL", "arguments": {...}}</tool_call>'
        try:
            call = json.loads(body)
            arguments = call.get("arguments", {}) if isinstance(call, dict) else None
            if isinstance(arguments, str):
                arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            return CallError("malformed", f"the tool call is not valid JSON ({exc.msg}); {shape}", index)
        except RecursionError:  # [[[[...: the decoder recurses once per level (model-written text)
            return CallError("malformed", f"the tool call's JSON is nested too deeply; {shape}", index)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return CallError("malformed", f"the tool call has no \"name\"; {shape}", index)
        if not isinstance(arguments, dict):
            return CallError("malformed", f"\"arguments\" must be a JSON object; {shape}", index, call["name"])
        return RawCall(call["name"], arguments, index)

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"

    def render_text(self, text: str) -> str:
        return f"<tool_response>\n{text}\n</tool_response>"  # what Qwen's template puts in the turn

    def message(self, text: str) -> dict[str, str]:
        return {"role": "tool", "content": text}

    def tool_problems(self, schemas: Mapping[str, Mapping[str, Any]]) -> list[str]:
        return []

    def without_calls(self, text: str) -> str:
        return self._CALL.sub("", text)


class Compact:
    stop_strings = ("</call>",)
    _CALL = re.compile(r"<call>(.*?)(?:</call>|\Z)", re.S)

    def extract(self, text: str) -> list[RawCall | CallError]:
        found: list[RawCall | CallError] = []
        for i, m in enumerate(self._CALL.finditer(text)):
            name, sep, argument = m.group(1).partition(":")
            if not sep or not name.strip():
                found.append(CallError("malformed", "write a call as <call>TOOL: ARGUMENT</call>", i))
            else:
                found.append(RawCall(name.strip(), argument.strip(), i))
        return found

    def render_call(self, name: str, arguments: dict[str, Any]) -> str:
        (argument,) = arguments.values()  # compact calls carry exactly one argument
        return f"<call>{name}: {argument}</call>"

    def render_text(self, text: str) -> str:
        return f"<result>{text}</result>"

    def message(self, text: str) -> dict[str, str]:
        return {"role": "tool", "content": text}

    def tool_problems(self, schemas: Mapping[str, Mapping[str, Any]]) -> list[str]:
        return [f"tool '{name}' cannot be called in the compact format: it needs exactly one "
                f"required parameter, a string (use format: hermes)"
                for name, schema in schemas.items() if single_string_parameter(schema) is None]

    def without_calls(self, text: str) -> str:
        return self._CALL.sub("", text)


CALL_FORMATS: dict[str, CallFormat] = {"hermes": Hermes(), "compact": Compact()}


def parse_calls(text: str, fmt: str | CallFormat, schemas: Mapping[str, Mapping[str, Any]],
                max_calls: int) -> ParsedCalls:
    """The calls in a model's turn, checked against ``schemas`` (tool name -> OpenAI function
    schema). The first ``max_calls`` are considered; the rest are one ``too_many_calls`` error."""
    form = CALL_FORMATS[fmt] if isinstance(fmt, str) else fmt
    found = form.extract(text)
    calls: list[ParsedCall] = []
    errors: list[CallError] = []
    for raw in found[:max_calls]:
        checked = raw if isinstance(raw, CallError) else _check(raw, schemas)
        (errors if isinstance(checked, CallError) else calls).append(checked)
    if len(found) > max_calls:
        errors.append(CallError("too_many_calls", f"{len(found)} tool calls in one turn; only the "
                                f"first {max_calls} were run", max_calls))
    return ParsedCalls(tuple(calls), tuple(errors))


def _check(raw: RawCall, schemas: Mapping[str, Mapping[str, Any]]) -> ParsedCall | CallError:
    schema = schemas.get(raw.name)
    if schema is None:
        close = difflib.get_close_matches(raw.name, list(schemas), n=1)
        hint = f"did you mean '{close[0]}'? " if close else ""
        return CallError("unknown_tool", f"unknown tool '{raw.name}'; {hint}tools: {', '.join(schemas)}",
                         raw.index, raw.name)
    arguments = raw.arguments
    if isinstance(arguments, str):
        param = single_string_parameter(schema)
        if param is None:
            return CallError("bad_arguments", f"tool '{raw.name}' takes JSON arguments, not one string",
                             raw.index, raw.name)
        arguments = {param: arguments}
    problem = argument_error(schema, arguments)
    if problem:
        return CallError("bad_arguments", f"tool '{raw.name}': {problem}", raw.index, raw.name)
    return ParsedCall(raw.name, dict(arguments), raw.index)
