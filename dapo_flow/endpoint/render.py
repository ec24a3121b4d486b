"""Requests into prompt ids, completions back into OpenAI messages.

Chat messages go through the tokenizer's chat template (``tools`` passed to it) when it has one.
Without one (the built-in char-level models) they are laid out as the agent loop lays out a
conversation: BOS, the user's text, each assistant turn as sampled (its content, its calls in the
model's call format, EOS), each tool result as the format renders it (``<result>...</result>``).
So a harness that sends back the messages it got continues the sampled tokens exactly; an
assistant turn whose calls were split out into ``tool_calls`` is put back as its sampled text
(:class:`SampledTurns`), so re-rendering a call cannot change it.
"""

from __future__ import annotations

import functools
import json
import uuid
from collections import OrderedDict
from typing import Any

from dapo_flow.endpoint.protocol import ApiError, ChatRequest, CompletionRequest, Message
from dapo_flow.tools.calls import CALL_FORMATS, parse_calls
from dapo_flow.tools.schema import schema_problems

MAX_CALLS_PER_TURN = 64


def tool_schemas(request: ChatRequest) -> dict[str, dict[str, Any]]:
    """``{name: schema}`` of the request's tools; a 400 naming every bad one."""
    problems, schemas = [], {}
    for i, tool in enumerate(request.tools or []):
        found = _schema_problems(json.dumps(tool, sort_keys=True, default=repr))
        if found:
            problems += [f"tools[{i}]: {p}" for p in found]
        else:
            schemas[tool["function"]["name"]] = tool
    if problems:
        raise ApiError(400, "; ".join(problems), param="tools", code="invalid_tool_schema")
    choice = request.tool_choice
    if choice not in (None, "auto", "none"):
        raise ApiError(400, f"tool_choice {json.dumps(choice)} is not supported: the endpoint does not "
                       "constrain decoding; use 'auto' or 'none'", param="tool_choice")
    return schemas


@functools.lru_cache(maxsize=1024)
def _schema_problems(schema_json: str) -> list[str]:
    """schema_problems of a schema by its JSON: a harness sends the same tools with every
    request, and checking a schema with jsonschema costs more than the rest of a request."""
    return schema_problems(json.loads(schema_json))


class SampledTurns:
    """The text of each assistant turn the endpoint split into content and ``tool_calls``, by call
    id: when a harness sends that turn back, it is rendered as sampled, not re-rendered from its
    parts (which may space a call differently or move text around it). Bounded: the oldest go."""

    def __init__(self, limit: int = 100_000):
        self.limit, self._text = limit, OrderedDict()

    def add(self, message: dict[str, Any], text: str) -> None:
        for call in message.get("tool_calls") or []:
            self._text[call["id"]] = text
        while len(self._text) > self.limit:
            self._text.popitem(last=False)

    def restore(self, m: Message) -> Message:
        """``m`` with its sampled text as its content, when it is a turn split here."""
        if m.role != "assistant" or not m.tool_calls or m.tool_calls[0].id not in self._text:
            return m
        return m.model_copy(update={"content": self._text[m.tool_calls[0].id], "tool_calls": None})


def chat_prompt(tokenizer: Any, request: ChatRequest, call_format: str, eos_id: int,
                turns: SampledTurns | None = None) -> list[int]:
    """The prompt ids of a chat request (module docstring)."""
    for i, m in enumerate(request.messages):
        if isinstance(m.content, list) and any(part.get("type") != "text" for part in m.content):
            raise ApiError(400, f"messages[{i}]: only text content parts are served", param=f"messages[{i}].content")
    if turns is not None:
        request = request.model_copy(update={"messages": [turns.restore(m) for m in request.messages]})
    if getattr(tokenizer, "chat_template", None):
        messages = [_template_message(m) for m in request.messages]
        text = tokenizer.apply_chat_template(messages, tools=request.tools or None, tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    fmt = CALL_FORMATS[call_format]
    ids = tokenizer.encode("", add_special_tokens=True)  # BOS, as a raw prompt gets it
    previous = ""
    for m in request.messages:
        if m.role == "assistant":
            calls = "".join(fmt.render_call(c.function.name, _arguments(c.function.arguments))
                            for c in m.tool_calls or [])
            ids += _encode(tokenizer, m.text() + calls) + [eos_id]
        elif m.role == "tool":
            ids += _encode(tokenizer, fmt.render_text(m.text()))
        else:  # system / developer / user: one per line, as a prompt's message list without a template
            ids += _encode(tokenizer, ("\n" if previous in ("system", "developer", "user") else "") + m.text())
        previous = m.role
    return ids


def completion_prompt(tokenizer: Any, request: CompletionRequest) -> list[int]:
    """A text prompt as a dataset's raw prompt is tokenized (BOS first); token ids as they are."""
    if isinstance(request.prompt, str):
        return tokenizer.encode(request.prompt, add_special_tokens=True)
    vocab = len(tokenizer)
    if any(not 0 <= t < vocab for t in request.prompt):
        raise ApiError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
    return list(request.prompt)


def assistant_message(text: str, call_format: str, schemas: dict[str, dict[str, Any]],
                      parse: bool) -> tuple[dict[str, Any], bool]:
    """(message, whether it calls tools): well-formed calls to known tools become ``tool_calls``
    and leave the content; a malformed call stays in the content for the harness to read."""
    if not parse or not schemas:
        return {"role": "assistant", "content": text}, False
    fmt = CALL_FORMATS[call_format]
    parsed = parse_calls(text, fmt, schemas, MAX_CALLS_PER_TURN)
    if not parsed.calls or parsed.errors:
        return {"role": "assistant", "content": text}, False
    calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
              "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in parsed.calls]
    content = fmt.without_calls(text)
    return {"role": "assistant", "content": content or None, "tool_calls": calls}, True


def _template_message(m: Message) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.tool_calls:
        out["tool_calls"] = [{"type": "function", "id": c.id,
                              "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
                             for c in m.tool_calls]
    if m.tool_call_id:
        out["tool_call_id"] = m.tool_call_id
    if m.name:
        out["name"] = m.name
    return out


def _arguments(arguments: str | dict[str, Any]) -> dict[str, Any]:
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments or "{}")
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"a tool call's arguments are not JSON ({exc.msg})", param="messages") from None
    if not isinstance(value, dict):
        raise ApiError(400, "a tool call's arguments must be a JSON object", param="messages")
    return value


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) if text else []
