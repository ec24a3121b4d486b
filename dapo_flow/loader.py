"""Read a graph YAML file, keeping the line of every key so errors can point at it.

``load(path)`` returns a :class:`GraphDoc`: the file name, the document as plain Python
(dicts, lists, scalars) and ``line_of(("nodes", 3, "params", "clip_high"))`` for the
1-based line where that key (or the nearest enclosing one that exists) is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ruamel.yaml import YAML
from ruamel.yaml.error import MarkedYAMLError, YAMLError

from dapo_flow.errors import GraphError, Problem

PathKey = tuple[str | int, ...]


@dataclass(frozen=True)
class GraphDoc:
    """A loaded graph file: plain data plus the line of every key and list item."""

    file: str
    raw: Mapping[str, Any]
    lines: Mapping[PathKey, int]  # a plain dict (picklable, so plans can travel to Ray)

    def line_of(self, path: PathKey) -> int:
        """Line of ``path``; for a path that is not in the file (a missing field),
        the line of its nearest enclosing key."""
        path = tuple(path)
        while path and path not in self.lines:
            path = path[:-1]
        return self.lines.get(path, 1)

    def get(self, path: PathKey, default: Any = None) -> Any:
        """The raw value at ``path``, or ``default`` when any step is missing."""
        value: Any = self.raw
        for key in path:
            try:
                value = value[key]
            except (KeyError, IndexError, TypeError):
                return default
        return value


def load(path: str | Path) -> GraphDoc:
    """Parse ``path`` (round-trip, so positions are kept); raise GraphError on bad YAML."""
    file = str(path)
    p = Path(path)
    if not p.is_file():
        why = "is a directory, not a graph file" if p.is_dir() else "no such file"
        raise GraphError([Problem(file, 0, "", "", why, "give the path of a graph .yaml file")])
    try:
        data = YAML(typ="rt").load(p.read_text(encoding="utf-8"))
    except MarkedYAMLError as exc:
        raise GraphError([_syntax_problem(file, exc)]) from None
    except (YAMLError, UnicodeDecodeError) as exc:
        raise GraphError([Problem(file, 0, "", "", f"cannot read YAML: {exc}")]) from None
    if not isinstance(data, dict):
        kind = "empty" if data is None else "a list" if isinstance(data, list) else "a scalar"
        raise GraphError(
            [
                Problem(
                    file,
                    1,
                    "",
                    "",
                    f"the top level must be a mapping (name:, models:, data:, nodes: ...), "
                    f"but the file is {kind}",
                    "see graphs/dapo.yaml for a complete graph",
                )
            ]
        )
    lines: dict[PathKey, int] = {(): 1}
    raw = _walk(data, (), lines)
    return GraphDoc(file=file, raw=raw, lines=lines)


def _syntax_problem(file: str, exc: MarkedYAMLError) -> Problem:
    mark = exc.problem_mark or exc.context_mark
    line, col = (mark.line + 1, mark.column + 1) if mark is not None else (0, 0)
    message = f"invalid YAML at column {col}: {exc.problem or exc.context}"
    ctx = exc.context_mark
    if exc.problem and exc.context:
        where = f" (line {ctx.line + 1}, column {ctx.column + 1})" if ctx is not None else ""
        message += f" ({exc.context}{where})"
    hint = "indent with spaces, never tabs" if "\\t" in repr(exc.problem) else ""
    return Problem(file, line, "", "", message, hint)


def _walk(node: Any, path: PathKey, lines: dict[PathKey, int]) -> Any:
    """Plain Python copy of a ruamel round-trip node, recording 1-based lines."""
    if isinstance(node, dict):
        out: dict[Any, Any] = {}
        lc = getattr(node, "lc", None)
        for key, value in node.items():
            key = _plain(key)
            if lc is not None:
                try:
                    lines[path + (key,)] = lc.key(key)[0] + 1
                except (KeyError, TypeError):
                    pass
            out[key] = _walk(value, path + (key,), lines)
        return out
    if isinstance(node, list):
        lc = getattr(node, "lc", None)
        items = []
        for i, value in enumerate(node):
            if lc is not None:
                try:
                    lines[path + (i,)] = lc.item(i)[0] + 1
                except (KeyError, TypeError, IndexError):
                    pass
            items.append(_walk(value, path + (i,), lines))
        return items
    return _plain(node)


def _plain(value: Any) -> Any:
    """ruamel's scalar subclasses (ScalarFloat, ScalarInt, ...) as builtin types."""
    if isinstance(value, bool) or value is None:
        return value
    if type(value).__name__ == "ScalarBoolean":  # an anchored bool: an int subclass
        return bool(value)
    for kind in (int, float, str):
        if isinstance(value, kind):
            return kind(value)
    return value
