"""Built-in tools by name, and :func:`load_tool`: a :class:`ToolSpec` to a ready :class:`Tool`.

``load_tool`` builds the tool (``Class(config)``), so the graph's checks can call it at compile
time: constructors should be cheap, leaving connections and sessions to ``create``/``execute``.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Iterable

from pydantic import BaseModel, ValidationError

from dapo_flow.core.imports import ImportSpecError, load_object
from dapo_flow.tools.base import TOOL_METHODS, Tool, ToolError, ToolSpec
from dapo_flow.tools.calculator import Calculator
from dapo_flow.tools.sandbox import PythonSandbox
from dapo_flow.tools.schema import schema_problems

BUILTIN_TOOLS: dict[str, type] = {
    "calculator": Calculator,
    "python": PythonSandbox,
}
#: Tools that are environments, imported when a graph names one (dapo_flow.envs imports dapo_flow.tools)
BUILTIN_ENVS: dict[str, str] = {"openenv": "dapo_flow.envs.openenv:OpenEnvTool"}  # an OpenEnv server
ENTRY_FIELDS = ("timeout_s", "name")


def load_tool(spec: ToolSpec, *, base_dir: Path | None = None) -> Tool:
    """Resolve ``spec.impl`` (a built-in, ``pkg.mod:Class`` or ``file.py:Class`` relative to
    ``base_dir``, the graph's folder), check the class, build it with its validated ``Config``
    and check the instance's name and schema. Every failure is a ToolError naming the tool."""
    where = f"tool '{spec.name}'"
    cls = _resolve(spec, base_dir, where)
    label = spec.target if ":" in spec.target else f"{cls.__module__}.{cls.__qualname__}"
    missing = [m for m in TOOL_METHODS if not callable(getattr(cls, m, None))]
    if missing:
        raise ToolError(f"{where}: {label} is not a Tool: it has no method "
                        f"{', '.join(missing)} (a tool defines {', '.join(TOOL_METHODS)}; "
                        f"see dapo_flow.tools.base.Tool)")
    tool = _construct(cls, label, spec, where)
    for attr in ("name", "schema"):
        if not hasattr(tool, attr):
            raise ToolError(f"{where}: {label} has no attribute '{attr}' (see dapo_flow.tools.base.Tool)")
    problems = schema_problems(tool.schema)
    if problems:
        raise ToolError(f"{where}: the schema of {label} is invalid: {'; '.join(problems)}")
    if tool.name != tool.schema["function"]["name"]:
        raise ToolError(f"{where}: {label} has name {tool.name!r} but its schema names the function "
                        f"{tool.schema['function']['name']!r}; make them the same")
    if tool.name != spec.name:
        raise ToolError(f"{where}: {label} is the tool {tool.name!r}; set name: {tool.name}")
    return tool


def load_tools(specs: Iterable[ToolSpec], *, base_dir: Path | None = None) -> dict[str, Tool]:
    """``{name: tool}`` for an agent node's ``tools:`` list; one ToolError lists every problem."""
    tools: dict[str, Tool] = {}
    errors: list[str] = []
    for spec in specs:
        if spec.name in tools:
            errors.append(f"tool '{spec.name}' is listed twice; give each tool one entry")
            continue
        try:
            tools[spec.name] = load_tool(spec, base_dir=base_dir)
        except ToolError as exc:
            errors.append(str(exc))
    if errors:
        raise ToolError("\n".join(errors))
    return tools


def _resolve(spec: ToolSpec, base_dir: Path | None, where: str) -> type:
    target = spec.target
    if ":" not in target:
        builtins = [*BUILTIN_TOOLS, *BUILTIN_ENVS]
        if target in BUILTIN_ENVS:
            return load_object(BUILTIN_ENVS[target])
        if target not in BUILTIN_TOOLS:
            close = difflib.get_close_matches(target, builtins, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise ToolError(f"{where}: '{target}' is not a built-in tool; {hint}(built-ins: "
                            f"{', '.join(sorted(builtins))}); name a class as impl: "
                            f"package.module:Class or path/to/file.py:Class")
        return BUILTIN_TOOLS[target]
    try:
        obj = load_object(target, base_dir=base_dir)
    except ImportSpecError as exc:
        raise ToolError(f"{where}: {exc}") from exc
    if not isinstance(obj, type):
        raise ToolError(f"{where}: '{target}' is a {type(obj).__name__}, not a class")
    return obj


def _construct(cls: type, label: str, spec: ToolSpec, where: str) -> Tool:
    config_cls = getattr(cls, "Config", None)
    if config_cls is None:
        if spec.config:
            raise ToolError(f"{where}: {label} declares no Config, so it takes no config; "
                            f"remove config: ({', '.join(sorted(spec.config))}) or give the class a Config model")
        return _call(cls, label, (), where)
    if not (isinstance(config_cls, type) and issubclass(config_cls, BaseModel)):
        raise ToolError(f"{where}: {label}.Config must be a Pydantic model class")
    data = dict(spec.config)
    for key in ENTRY_FIELDS:  # the entry's, handed to a Config that declares them (openenv's name)
        if key in data:
            raise ToolError(f"{where}: config: {key}: set {key} on the tool entry, not under config:")
        if key in config_cls.model_fields:
            data[key] = getattr(spec, key)
    try:
        config = config_cls.model_validate(data)
    except ValidationError as exc:
        details = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(config)'}: {e['msg']}" for e in exc.errors())
        raise ToolError(f"{where}: config: {details}") from None
    return _call(cls, label, (config,), where)


def _call(cls: type, label: str, args: tuple, where: str) -> Tool:
    try:
        return cls(*args)
    except ToolError as exc:  # the tool's own words: what is wrong and the fix
        raise ToolError(f"{where}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - user code: report it with the tool's name
        raise ToolError(f"{where}: building {label} failed: {type(exc).__name__}: {exc}") from exc
