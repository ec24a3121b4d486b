"""load_tool: built-ins, user tools by module or file path, and an error naming the tool and
what to fix for each way it can fail."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from dapo_flow.tools import (BUILTIN_TOOLS, Tool, ToolError, ToolSpec, load_tool, load_tools,
                             schema_problems)
from dapo_flow.tools.calculator import Calculator
from dapo_flow.tools.sandbox import PythonSandbox

HERE = Path(__file__).parent


def spec(**fields) -> ToolSpec:
    return ToolSpec(**fields)


def test_builtins_load_by_name_and_satisfy_the_protocol():
    calc = load_tool(spec(name="calculator", config={"max_digits": 50}))
    assert isinstance(calc, Calculator) and calc.config.max_digits == 50 and isinstance(calc, Tool)
    python = load_tool(spec(name="python", timeout_s=2.5, config={"memory_mib": 256}))
    assert isinstance(python, PythonSandbox)
    assert (python.config.timeout_s, python.config.memory_mib) == (2.5, 256)
    for cls in BUILTIN_TOOLS.values():
        assert schema_problems(cls.schema) == []


def test_a_user_tool_from_a_module_path_runs_its_lifecycle(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    tool = load_tool(spec(name="lookup", impl="tool_fixtures:Lookup", config={"table": {"a": "1"}}))
    tool.create("r0", key="a")
    tool.create("r1", key="b")
    assert tool.execute("r0", {"key": "a"}).text == "1"
    assert tool.execute("r1", {"key": "zz"}).text == "error: no key 'zz'"
    assert (tool.calc_reward("r0"), tool.calc_reward("r1")) == (1.0, 0.0)
    tool.release("r0"), tool.release("r1")


def test_a_user_tool_from_a_file_path_resolves_against_base_dir():
    tool = load_tool(spec(name="lookup", impl="tool_fixtures.py:NoConfig"), base_dir=HERE)
    assert tool.execute("r0", {"key": "a"}).text == "ok"


@pytest.mark.parametrize("fields, message", [
    ({"name": "calculatr"}, "tool 'calculatr': 'calculatr' is not a built-in tool; "
                            "did you mean 'calculator'? (built-ins: calculator, openenv, python)"),
    ({"name": "x", "impl": "no_such_pkg.tools:X"}, "tool 'x': 'no_such_pkg.tools:X': cannot import module "
                                                   "'no_such_pkg.tools': ModuleNotFoundError"),
    ({"name": "x", "impl": "tool_fixtures.py:Nope"}, "module 'tool_fixtures.py' has no attribute 'Nope'"),
    ({"name": "x", "impl": "missing.py:X"}, f"file {HERE / 'missing.py'} does not exist"),
    ({"name": "lookup", "impl": "tool_fixtures.py:not_a_class"}, "is a function, not a class"),
    ({"name": "lookup", "impl": "tool_fixtures.py:NoRelease"},
     "tool_fixtures.py:NoRelease is not a Tool: it has no method release"),
    ({"name": "lookup", "impl": "tool_fixtures.py:BadSchema"}, "schema of tool_fixtures.py:BadSchema is invalid: "
                                                               "function.parameters is not a valid JSON schema at properties/key/type"),
    ({"name": "lookup", "impl": "tool_fixtures.py:Misnamed"}, "has name 'search' but its schema names the function 'lookup'"),
    ({"name": "calc", "impl": "calculator"},
     "tool 'calc': dapo_flow.tools.calculator.Calculator is the tool 'calculator'; set name: calculator"),
    ({"name": "lookup", "impl": "tool_fixtures.py:Exploding"},
     "building tool_fixtures.py:Exploding failed: RuntimeError: no index on disk"),
    ({"name": "lookup", "impl": "tool_fixtures.py:NoConfig", "config": {"a": 1}},
     "declares no Config, so it takes no config"),
    ({"name": "python", "config": {"timeout_s": 3}}, "set timeout_s on the tool entry, not under config:"),
    ({"name": "env", "impl": "openenv", "config": {"url": "http://127.0.0.1:1", "name": "env"}},
     "tool 'env': config: name: set name on the tool entry, not under config:"),
    ({"name": "python", "config": {"memory_mb": 3}}, "config: memory_mb: Extra inputs are not permitted"),
    ({"name": "calculator", "config": {"max_digits": 0}},
     "config: max_digits: Input should be greater than or equal to 1"),
])
def test_errors_name_the_tool_and_what_is_wrong(fields, message):
    with pytest.raises(ToolError) as info:
        load_tool(spec(**fields), base_dir=HERE)
    assert message in str(info.value)


def test_load_tools_reports_every_problem_at_once():
    with pytest.raises(ToolError) as info:
        load_tools([spec(name="calculator"), spec(name="calculator"), spec(name="nope"),
                    spec(name="python", config={"bad": 1})])
    lines = str(info.value).splitlines()
    assert len(lines) == 3 and "listed twice" in lines[0] and "'nope'" in lines[1] and "bad" in lines[2]
    assert set(load_tools([spec(name="calculator"), spec(name="python")])) == {"calculator", "python"}


def test_tool_spec_is_frozen_and_strict():
    s = spec(name="python")
    assert (s.target, s.timeout_s) == ("python", 5.0)
    with pytest.raises(ValidationError):
        s.timeout_s = 1.0
    with pytest.raises(ValidationError, match="Extra inputs"):
        ToolSpec(name="python", timeout=3)
    with pytest.raises(ValidationError, match="pattern"):
        ToolSpec(name="has space")
    with pytest.raises(ValidationError, match="greater than 0"):
        ToolSpec(name="python", timeout_s=0)
