"""Tools a model calls during a multi-turn rollout (``agent-generate``), and the call formats it writes.

- :mod:`~dapo_flow.tools.base`: the :class:`Tool` Protocol (after verl's ``BaseTool``),
  :class:`ToolResult`, :func:`error_result`, and :class:`ToolSpec`, one entry of an agent
  node's ``tools:`` list in the graph.
- :mod:`~dapo_flow.tools.schema`: checks of OpenAI function schemas and of call arguments.
- :mod:`~dapo_flow.tools.registry`: :data:`BUILTIN_TOOLS` and :func:`load_tool` /
  :func:`load_tools` (built-in name or ``package.module:Class`` / ``path/file.py:Class``).
- built-ins: :mod:`~dapo_flow.tools.calculator` (``calculator``: exact arithmetic, never
  ``eval``) and :mod:`~dapo_flow.tools.sandbox` (``python``: a subprocess with time, memory and
  output limits; not a security boundary).
- :mod:`~dapo_flow.tools.calls`: :func:`parse_calls` reads the calls in a model's turn in a
  format of :data:`CALL_FORMATS` (``hermes``, ``compact``), which also renders tool responses
  and names the stop strings that end a turn at a call.

Per request (one sampled conversation, ``instance_id``) the agent loop calls ``create`` once,
``execute`` for each call (in a worker thread: calls of different requests overlap), then
``calc_reward`` and ``release``. A tool is any class with these members; no base class::

    from pydantic import BaseModel, ConfigDict
    from dapo_flow.tools import ToolResult, error_result

    class Lookup:  # answers from a table; rewards a request that looked up its own key
        class Config(BaseModel):  # optional: validated from the graph's `config:`
            model_config = ConfigDict(frozen=True, extra="forbid")
            table: dict[str, str] = {}

        name = "lookup"
        schema = {"type": "function", "function": {
            "name": "lookup", "description": "Look a key up in the table.",
            "parameters": {"type": "object", "properties": {"key": {"type": "string"}},
                           "required": ["key"]}}}

        def __init__(self, config: Config):
            self.table, self.wanted, self.hit = config.table, {}, {}

        def create(self, instance_id, *, key="", **_):    # the row's create_kwargs
            self.wanted[instance_id], self.hit[instance_id] = key, False

        def execute(self, instance_id, arguments):       # arguments fit the schema already
            key = arguments["key"]
            if key not in self.table:
                return error_result(f"no key {key!r}")
            self.hit[instance_id] |= key == self.wanted[instance_id]
            return ToolResult(self.table[key], metrics={"error": 0.0})

        def calc_reward(self, instance_id):
            return float(self.hit[instance_id])

        def release(self, instance_id):
            del self.wanted[instance_id], self.hit[instance_id]

(tests/tools/tool_fixtures.py holds this class), and in the graph, under the agent node::

    tools:
      - {name: calculator}
      - {name: python, timeout_s: 10, config: {memory_mib: 1024}}
      - {name: lookup, impl: my_pkg.tools:Lookup, config: {table: {a: "1"}}}
"""

from dapo_flow.tools.base import TOOL_METHODS, Tool, ToolError, ToolResult, ToolSpec, error_result
from dapo_flow.tools.calls import (CALL_FORMATS, CallError, CallFormat, ParsedCall, ParsedCalls,
                                   parse_calls)
from dapo_flow.tools.registry import BUILTIN_TOOLS, load_tool, load_tools
from dapo_flow.tools.schema import argument_error, schema_problems, single_string_parameter

__all__ = [
    "BUILTIN_TOOLS", "CALL_FORMATS", "TOOL_METHODS", "CallError", "CallFormat", "ParsedCall",
    "ParsedCalls", "Tool", "ToolError", "ToolResult", "ToolSpec", "argument_error", "error_result",
    "load_tool", "load_tools", "parse_calls", "schema_problems", "single_string_parameter",
]
