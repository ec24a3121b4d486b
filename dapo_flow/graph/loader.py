"""Read a graph YAML file, keeping the line of every key so errors can point at it.

``load(path)`` returns a :class:`GraphDoc`: the file name, the document as plain Python
(dicts, lists, scalars) and ``line_of(("nodes", 3, "params", "clip_high"))`` for the
1-based line where that key (or the nearest enclosing one that exists) is written.

What a graph file may be is bounded, so no file can hang a command or exhaust memory: at most
``MAX_GRAPH_BYTES`` (1 MiB) on disk, ``MAX_GRAPH_DEPTH`` (100) levels of nesting, and at most
``MAX_GRAPH_VALUES`` (100,000) values once YAML aliases are expanded: ``*name`` repeats what
``&name`` holds, and nested aliases multiply, so a few KB could otherwise expand to billions.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ruamel.yaml import YAML
from ruamel.yaml.error import MarkedYAMLError, YAMLError

from dapo_flow.errors import GraphError, Problem

PathKey = tuple[str | int, ...]

MAX_GRAPH_BYTES = 1 << 20  # graphs are a few KB; sweeps write theirs out too
MAX_GRAPH_VALUES = 100_000  # mappings, lists and scalars after alias expansion (a graph: ~300)
MAX_GRAPH_DEPTH = 100  # levels of nesting (a graph: ~5); deeper ones end in the parser's recursion
# ruamel's round-trip scanner joins a block of comment lines by repeated string concatenation
# (quadratic: 200k comment lines took minutes). Past this many, comment lines are blanked first.
MANY_COMMENT_LINES = 1_000
_TOO_DEEP = f"the document nests more than {MAX_GRAPH_DEPTH} levels deep (lists or mappings inside each other)"
_TOO_DEEP_FIX = "a graph nests a few levels; check for unbalanced [ or {"
_COMMENT_LINE = re.compile(r"^[ \t]*#.*$", re.MULTILINE)


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
    """Parse ``path`` (round-trip, so positions are kept); raise GraphError on bad YAML,
    a file over ``MAX_GRAPH_BYTES`` or aliases expanding past ``MAX_GRAPH_VALUES`` values."""
    file = str(path)
    p = Path(path)
    try:
        is_file, is_dir = p.is_file(), p.is_dir()
        size = p.stat().st_size if is_file else 0
    except OSError as exc:  # a name too long for the file system, a folder it may not enter
        raise _unreadable(file, exc) from None
    if not is_file:
        why = "is a directory, not a graph file" if is_dir else "no such file"
        raise GraphError([Problem(file, 0, "", "", why, "give the path of a graph .yaml file")])
    if size > MAX_GRAPH_BYTES:
        raise GraphError([Problem(file, 0, "", "", f"the file is {size:,} bytes, over the "
                                  f"{MAX_GRAPH_BYTES:,}-byte limit for a graph file",
                                  "is this the graph? a graph is a few KB of YAML")])
    try:
        text = p.read_text(encoding="utf-8")
        too_deep = _line_too_deep(text)
        if too_deep:  # refused before the parser, whose scanner is quadratic in the nesting
            raise GraphError([Problem(file, too_deep, "", "", _TOO_DEEP, _TOO_DEEP_FIX)])
        data, blanked = _parse_rt(text)
        raw, lines = _plain_document(file, data)
        if blanked and not _same_as_written(raw, text):
            # a '#' line was text inside a block or quoted string: parse the file as written
            raw, lines = _plain_document(file, YAML(typ="rt").load(text))
    except MarkedYAMLError as exc:
        raise GraphError([_syntax_problem(file, exc)]) from None
    except (YAMLError, UnicodeDecodeError) as exc:
        raise GraphError([Problem(file, 0, "", "", f"cannot read YAML: {exc}")]) from None
    except OSError as exc:  # unreadable (permissions, an I/O error)
        raise _unreadable(file, exc) from None
    except RecursionError:  # ruamel's parser recurses once per level of nesting
        raise GraphError([Problem(file, 0, "", "", _TOO_DEEP, _TOO_DEEP_FIX)]) from None
    return GraphDoc(file=file, raw=raw, lines=lines)


def _line_too_deep(text: str) -> int:
    """The line where flow brackets (``[``, ``{``; quotes and comments skipped) first nest more
    than MAX_GRAPH_DEPTH deep, or 0. ruamel's scanner takes time quadratic in the nesting (5000
    levels: ~6 s before its RecursionError; a 1 MiB file of brackets would take hours), so such
    a document is refused from this count first. Block nesting is bounded by indentation."""
    if text.count("[") + text.count("{") <= MAX_GRAPH_DEPTH:
        return 0
    depth, line, quote, previous = 0, 1, "", "\n"
    for ch in text:
        if ch == "\n":
            line += 1
        if quote:
            if ch == quote or (ch == "\n" and quote == "#"):
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and previous in " \t\n":
            quote = "#"  # a comment: skipped to the end of its line
        elif ch in "[{":
            depth += 1
            if depth > MAX_GRAPH_DEPTH:
                return line
        elif ch in "]}":
            depth = max(depth - 1, 0)
        previous = ch
    return 0


def _unreadable(file: str, exc: OSError) -> GraphError:
    """A graph path the file system refuses (a name too long, no permission, an I/O error)."""
    return GraphError([Problem(file, 0, "", "", f"cannot read it: {exc.strerror or exc}",
                               "give the path of a graph .yaml file you can read")])


def _parse_rt(text: str) -> tuple[Any, bool]:
    """The round-trip document of ``text``, and whether comment lines were blanked for speed:
    past MANY_COMMENT_LINES they are (line numbers kept). Blanking could change a value whose
    text holds a line starting with '#' (block and quoted strings); the caller checks for that,
    and a blanked text that no longer parses (a quote closed on such a line) is parsed as written."""
    if len(_COMMENT_LINE.findall(text)) > MANY_COMMENT_LINES:
        try:
            return YAML(typ="rt").load(_COMMENT_LINE.sub("", text)), True
        except YAMLError:
            pass  # errors are reported from the file as written
    return YAML(typ="rt").load(text), False


def _same_as_written(raw: dict[str, Any], text: str) -> bool:
    """Whether ``raw`` (parsed with comment lines blanked) is what ``text`` holds, by a plain
    parse (linear in comments); anything that parser refuses (a tag it does not know) counts
    as a difference, so the caller parses the text as written."""
    try:
        return raw == YAML(typ="safe", pure=True).load(text)
    except YAMLError:
        return False


def _plain_document(file: str, data: Any) -> tuple[dict[str, Any], dict[PathKey, int]]:
    """The document as plain Python and the line of every key; GraphError for a document that
    is not a mapping or that expands past MAX_GRAPH_VALUES values."""
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
    walker = _Walker(lines)
    try:
        raw = walker.walk(data, ())
    except _TooLarge as exc:
        # the top-level entry it is under (a node, a section key): lines deeper inside expanded
        # aliases are those of the anchor's own values, which would point away from the culprit
        raise GraphError([Problem(file, walker.line_near(exc.path[:2]), "", "", exc.message, exc.hint)]) from None
    return raw, lines


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


class _TooLarge(Exception):
    def __init__(self, path: PathKey, message: str, hint: str):
        super().__init__(message)
        self.path, self.message, self.hint = path, message, hint


class _Walker:
    """Plain Python copy of a ruamel round-trip document, recording 1-based lines and counting
    the values it makes: aliases are shared objects in ruamel, expanded here, so the count is
    what the document expands to; past MAX_GRAPH_VALUES the walk stops (in well under a second)."""

    def __init__(self, lines: dict[PathKey, int]):
        self.lines = lines
        self.values = 0
        # ids of the containers being copied: an alias to one is a cycle (ruamel gives None for
        # a self-alias today; should it build the cycle, the walk must not recurse forever)
        self.open: set[int] = set()

    def line_near(self, path: PathKey) -> int:
        while path and path not in self.lines:
            path = path[:-1]
        return self.lines.get(path, 1)

    def walk(self, node: Any, path: PathKey) -> Any:
        self.values += 1
        if self.values > MAX_GRAPH_VALUES:
            raise _TooLarge(path, f"the document expands to more than {MAX_GRAPH_VALUES:,} values "
                            "(YAML aliases *name repeat what &name holds, and nested ones multiply)",
                            "write the values out, or use fewer nested aliases; a graph has a few hundred")
        if not isinstance(node, (dict, list)):
            return _plain(node)
        if len(path) >= MAX_GRAPH_DEPTH:
            raise _TooLarge(path, _TOO_DEEP, _TOO_DEEP_FIX)
        if id(node) in self.open:
            raise _TooLarge(path, "a YAML alias refers to a mapping or list that contains it "
                            "(an endless document)", "remove the alias from inside its own anchor")
        self.open.add(id(node))
        try:
            return self._walk_dict(node, path) if isinstance(node, dict) else self._walk_list(node, path)
        finally:
            self.open.discard(id(node))

    def _walk_dict(self, node: dict, path: PathKey) -> dict:
        out: dict[Any, Any] = {}
        lc = getattr(node, "lc", None)
        for key, value in node.items():
            key = _plain(key)
            if lc is not None:
                try:
                    self.lines[path + (key,)] = lc.key(key)[0] + 1
                except (KeyError, TypeError):
                    pass
            out[key] = self.walk(value, path + (key,))
        return out

    def _walk_list(self, node: list, path: PathKey) -> list:
        lc = getattr(node, "lc", None)
        items = []
        for i, value in enumerate(node):
            if lc is not None:
                try:
                    self.lines[path + (i,)] = lc.item(i)[0] + 1
                except (KeyError, TypeError, IndexError):
                    pass
            items.append(self.walk(value, path + (i,)))
        return items


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
