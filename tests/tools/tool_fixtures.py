"""Tool classes the registry tests load by import path: the package docstring's example, and
classes each broken in one way."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from dapo_flow.tools import ToolResult, error_result

_SCHEMA = {"type": "function", "function": {
    "name": "lookup", "description": "Look a key up in the table.",
    "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}}}


class Lookup:  # answers from a table; rewards a request that looked up its own key
    class Config(BaseModel):
        model_config = ConfigDict(frozen=True, extra="forbid")
        table: dict[str, str] = {}

    name = "lookup"
    schema = _SCHEMA

    def __init__(self, config: Config):
        self.table, self.wanted, self.hit = config.table, {}, {}

    def create(self, instance_id, *, key="", **_):
        self.wanted[instance_id], self.hit[instance_id] = key, False

    def execute(self, instance_id, arguments):
        key = arguments["key"]
        if key not in self.table:
            return error_result(f"no key {key!r}")
        self.hit[instance_id] |= key == self.wanted[instance_id]
        return ToolResult(self.table[key], metrics={"error": 0.0})

    def calc_reward(self, instance_id):
        return float(self.hit[instance_id])

    def release(self, instance_id):
        del self.wanted[instance_id], self.hit[instance_id]


class NoRelease:
    name, schema = "lookup", _SCHEMA

    def create(self, instance_id, **kw): ...
    def execute(self, instance_id, arguments): ...
    def calc_reward(self, instance_id): ...


class NoConfig:
    """A tool without a Config: built with no arguments."""

    name, schema = "lookup", _SCHEMA

    def create(self, instance_id, **kw): ...
    def execute(self, instance_id, arguments): return ToolResult("ok")
    def calc_reward(self, instance_id): return 0.0
    def release(self, instance_id): ...


class BadSchema(NoConfig):
    schema = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object",
              "properties": {"key": {"type": "strin"}}}}}


class Misnamed(NoConfig):
    name = "search"


class Exploding(NoConfig):
    def __init__(self):
        raise RuntimeError("no index on disk")


def not_a_class():
    return NoConfig()
