"""What a tool is: the :class:`Tool` Protocol (after verl's ``BaseTool``), its :class:`ToolResult`,
and the :class:`ToolSpec` a graph names it with.

A tool keeps per-request state keyed by ``instance_id`` (one id per sampled conversation): the
agent loop calls ``create`` once when the request starts (with the row's ``create_kwargs``, e.g.
the ground truth), ``execute`` for every call the model makes, then ``calc_reward`` and
``release`` when the request ends, whatever the ending (answer, turn limit, length, error).

The methods are plain blocking functions. The agent loop runs ``execute`` in worker threads so
that calls of different requests overlap: calls for different ids may run at the same time, so
keep state in a dict keyed by id (no shared mutable state without a lock).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, runtime_checkable

from pydantic import BaseModel, Field

from dapo_flow.errors import DapoFlowError
from dapo_flow.core.contract import PARAMS_CONFIG

#: What OpenAI accepts as a function name; the name is also how calls and graphs refer to a tool.
NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"


class ToolError(DapoFlowError):
    """A tool cannot be loaded: unknown, not importable, incomplete, or with an invalid schema."""


@dataclass(frozen=True)
class ToolResult:
    """What one tool call returns. ``text`` is the observation the model sees next; ``reward``
    is a per-call reward (summed by the agent loop); ``metrics`` are numbers it averages and logs
    (a tool that fails reports ``{"error": 1.0}``); ``done``: the call ended the episode (an
    environment's ``done``): the request completes after this round, its ``text`` unshown."""

    text: str
    reward: float = 0.0
    metrics: Mapping[str, float] = field(default_factory=dict)
    done: bool = False


def error_result(message: str, *, done: bool = False, **metrics: float) -> ToolResult:
    """A failed call: the model sees ``error: <message>``; ``metrics`` gets ``error = 1``."""
    return ToolResult(text=f"error: {message}", metrics={"error": 1.0, **metrics}, done=done)


@runtime_checkable
class Tool(Protocol):
    """A tool the model can call. No base class to inherit: any class with these members is one.

    Built with ``Class(config)`` where ``config`` is an instance of the class's ``Config`` (a
    frozen Pydantic model validated from the graph's ``config:``), or ``Class()`` when the class
    declares no ``Config``; see :func:`dapo_flow.tools.registry.load_tool`.
    """

    name: str
    """The name the model calls it by; equal to ``schema["function"]["name"]``."""
    schema: dict[str, Any]
    """OpenAI function schema: ``{"type": "function", "function": {"name", "description",
    "parameters": <JSON schema of an object>}}``."""

    def create(self, instance_id: str, **create_kwargs: Any) -> None:
        """Start the state of one request (e.g. remember its ground truth)."""

    def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        """Run one call. ``arguments`` already satisfy the schema. A failure should come back as
        :func:`error_result`; the agent loop turns an exception into one as well."""

    def calc_reward(self, instance_id: str) -> float:
        """The request's tool reward when it ends (0.0 for tools that do not grade)."""

    def release(self, instance_id: str) -> None:
        """Drop the request's state; called exactly once per ``create``."""


#: The methods :func:`load_tool` checks a class for (the attributes are checked on the instance).
TOOL_METHODS: tuple[str, ...] = ("create", "execute", "calc_reward", "release")


class ToolSpec(BaseModel):
    """One entry of an agent node's ``tools:`` list in the graph YAML."""

    model_config = PARAMS_CONFIG

    name: str = Field(pattern=NAME_PATTERN)
    """The name the model calls the tool by; must equal the name in the tool's schema."""
    impl: str | None = None
    """A built-in tool (`calculator`, `python`) or `package.module:Class` / `path/to/file.py:Class`
    (relative to the working directory, as a reward file). Default: `name`, a built-in."""
    timeout_s: float = Field(5.0, gt=0, le=600)
    """Wall-clock limit of one call. A tool whose Config has a `timeout_s` field (the `python`
    sandbox) receives it and enforces it itself; the agent loop bounds every call by it too."""
    config: dict[str, Any] = Field(default_factory=dict)
    """Validated into the tool class's `Config` and passed to its constructor."""

    @property
    def target(self) -> str:
        """What :attr:`impl` names, its default filled in."""
        return self.impl or self.name
