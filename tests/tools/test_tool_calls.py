"""Tool calls in model text: both formats, several calls per turn, and every kind of bad call
coming back as an error observation instead of an exception."""

from __future__ import annotations

import json

import pytest

from dapo_flow.tools import CALL_FORMATS, ParsedCall, parse_calls
from dapo_flow.tools.calculator import SCHEMA as CALC
from dapo_flow.tools.sandbox import SCHEMA as PYTHON

TWO_ARGS = {"type": "function", "function": {"name": "search", "description": "web search",
            "parameters": {"type": "object", "required": ["query", "k"],
                           "properties": {"query": {"type": "string"}, "k": {"type": "integer"}}}}}
SCHEMAS = {"calculator": CALC, "python": PYTHON, "search": TWO_ARGS}


def hermes(name, arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_compact_calls_fill_the_single_string_parameter():
    text = "Let me compute. <call>calculator: 12*34</call> and <call>python:\nprint(1)\n</call>"
    parsed = parse_calls(text, "compact", SCHEMAS, max_calls=4)
    assert parsed.calls == (ParsedCall("calculator", {"expression": "12*34"}, 0),
                            ParsedCall("python", {"code": "print(1)"}, 1))
    assert parsed.errors == () and parsed.asked_for_tools


def test_hermes_calls_several_per_turn_in_order():
    text = "I'll use tools.\n" + hermes("search", {"query": "dapo", "k": 3}) + "\n" + hermes("calculator", {"expression": "1+1"})
    parsed = parse_calls(text, "hermes", SCHEMAS, max_calls=4)
    assert parsed.calls == (ParsedCall("search", {"query": "dapo", "k": 3}, 0),
                            ParsedCall("calculator", {"expression": "1+1"}, 1))


def test_hermes_accepts_arguments_encoded_as_a_json_string():
    text = '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2*3\\"}"}</tool_call>'
    assert parse_calls(text, "hermes", SCHEMAS, 1).calls == (ParsedCall("calculator", {"expression": "2*3"}, 0),)


@pytest.mark.parametrize("fmt, text", [
    ("compact", "<call>calculator: 2+2"), ("hermes", '<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}'),
])
def test_a_call_left_open_at_the_end_is_read_as_closed(fmt, text):
    # an engine may leave the stop string out of its output
    assert parse_calls(text, fmt, SCHEMAS, 1).calls == (ParsedCall("calculator", {"expression": "2+2"}, 0),)


def test_no_call_is_a_final_answer():
    for fmt in CALL_FORMATS:
        parsed = parse_calls("The answer is 408.", fmt, SCHEMAS, 2)
        assert not parsed.asked_for_tools and parsed.calls == () and parsed.errors == ()


@pytest.mark.parametrize("fmt, text, kind, message", [
    ("hermes", "<tool_call>{'name': 'calculator'}</tool_call>", "malformed", "not valid JSON"),
    ("hermes", '<tool_call>{"name": "calculator", "arguments": {"expression": "1"}</tool_call>', "malformed", "not valid JSON"),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', "malformed", 'no "name"'),
    ("hermes", '<tool_call>["calculator"]</tool_call>', "malformed", 'no "name"'),
    ("hermes", '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>', "malformed", '"arguments" must be a JSON object'),
    # model-written JSON nested deeper than the decoder recurses: an error observation, not a crash
    pytest.param("hermes", '<tool_call>{"name": "python", "arguments": ' + "[" * 100_000 + "]" * 100_000 + "}</tool_call>",
                 "malformed", "nested too deeply", id="hermes-nested-100k-deep"),
    pytest.param("hermes", '<tool_call>{"name": "python", "arguments": "' + "[" * 100_000 + '"}</tool_call>',
                 "malformed", "nested too deeply", id="hermes-string-arguments-nested-100k-deep"),
    ("compact", "<call>calculator 12*34</call>", "malformed", "<call>TOOL: ARGUMENT</call>"),
    ("compact", "<call>: 12*34</call>", "malformed", "<call>TOOL: ARGUMENT</call>"),
    ("compact", "<call>calculater: 1+1</call>", "unknown_tool", "unknown tool 'calculater'; did you mean 'calculator'?"),
    ("hermes", hermes("browser", {}), "unknown_tool", "unknown tool 'browser'; tools: calculator, python, search"),
    ("hermes", hermes("calculator", {"expression": 12}), "bad_arguments", "argument 'expression': 12 is not of type 'string'"),
    ("hermes", hermes("calculator", {}), "bad_arguments", "'expression' is a required property"),
    ("hermes", hermes("search", {"query": "x", "k": "3"}), "bad_arguments", "argument 'k': '3' is not of type 'integer'"),
    ("compact", "<call>search: dapo</call>", "bad_arguments", "tool 'search' takes JSON arguments, not one string"),
])
def test_bad_calls_are_error_observations(fmt, text, kind, message):
    parsed = parse_calls(text, fmt, SCHEMAS, max_calls=2)
    assert parsed.calls == () and parsed.asked_for_tools
    (error,) = parsed.errors
    assert error.kind == kind and message in error.message
    assert error.observation == f"error: {error.message}"


def test_good_and_bad_calls_in_one_turn_keep_their_places():
    text = "<call>calculator: 1+1</call><call>nope: x</call><call>python: print(2)</call>"
    parsed = parse_calls(text, "compact", SCHEMAS, max_calls=3)
    assert [c.index for c in parsed.calls] == [0, 2]
    assert [(e.kind, e.index, e.name) for e in parsed.errors] == [("unknown_tool", 1, "nope")]


def test_calls_over_the_limit_are_one_error_and_not_run():
    text = "".join(f"<call>calculator: {i}+1</call>" for i in range(5))
    parsed = parse_calls(text, "compact", SCHEMAS, max_calls=2)
    assert [c.arguments["expression"] for c in parsed.calls] == ["0+1", "1+1"]
    (error,) = parsed.errors
    assert (error.kind, error.index) == ("too_many_calls", 2)
    assert error.message == "5 tool calls in one turn; only the first 2 were run"


def test_rendering_round_trips_and_stop_strings_end_a_turn_at_a_call():
    compact, herm = CALL_FORMATS["compact"], CALL_FORMATS["hermes"]
    assert compact.render_call("calculator", {"expression": "12*34"}) == "<call>calculator: 12*34</call>"
    assert compact.render_text("408") == "<result>408</result>"
    assert herm.render_text("408") == "<tool_response>\n408\n</tool_response>"
    for form in (compact, herm):
        assert form.message("408") == {"role": "tool", "content": "408"}
        call = form.render_call("calculator", {"expression": "12*34"})
        assert call.endswith(form.stop_strings)
        assert parse_calls(call, form, SCHEMAS, 1).calls == (ParsedCall("calculator", {"expression": "12*34"}, 0),)


def test_formats_report_tools_they_cannot_call():
    assert CALL_FORMATS["hermes"].tool_problems(SCHEMAS) == []
    (problem,) = CALL_FORMATS["compact"].tool_problems(SCHEMAS)
    assert problem.startswith("tool 'search' cannot be called in the compact format")
