"""Problems found while compiling a graph: collected (``Found``), located in the YAML
(file, line, node id, field) and phrased with a fix (``did_you_mean``, Pydantic errors mapped
back to their node and field)."""

from __future__ import annotations

import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Iterable

import pyarrow as pa
from pydantic import BaseModel, ValidationError

from dapo_flow.errors import GraphError, Problem, did_you_mean
from dapo_flow.graph.loader import GraphDoc, PathKey


# --- problems -------------------------------------------------------------------------

#: Problem codes of the column checks (a Problem's ``code``; Pydantic's error types for the rest)
MISSING_COLUMN = "missing-column"
COLUMN_TYPE = "column-type"


@dataclass
class Found:
    """Problems collected so far, each with the GraphError subclass it belongs to."""

    doc: GraphDoc
    items: list[tuple[type[GraphError], Problem]] = field(default_factory=list)

    def add(self, path: PathKey, message: str, hint: str = "", kind: type[GraphError] = GraphError,
            field_name: str | None = None, code: str = "", column: str = "") -> None:
        node, fld = _locate(self.doc, path)
        line = self.doc.line_of(path)
        self.items.append((kind, Problem(self.doc.file, line, node, field_name or fld, message, hint, code, column)))

    def raise_if_any(self) -> None:
        if not self.items:
            return
        kinds = {k for k, _ in self.items}
        kind = kinds.pop() if len(kinds) == 1 else GraphError
        raise kind(sorted({p for _, p in self.items}))


def _locate(doc: GraphDoc, path: PathKey) -> tuple[str, str]:
    """(node id, dotted field relative to the node) for a path into the document."""
    if len(path) >= 2 and path[0] == "nodes" and isinstance(path[1], int):
        node_id = doc.get(("nodes", path[1], "id"))
        if isinstance(node_id, str):
            return node_id, _dotted(path[2:])
    return "", _dotted(path)


def _dotted(path: Iterable[Any]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _short(value: Any, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def type_name(t: pa.DataType) -> str:
    """``list<float>`` rather than pyarrow's ``list<item: float>``."""
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return f"list<{type_name(t.value_type)}>"
    return str(t)


def pydantic_problems(found: Found, err: ValidationError, base: PathKey,
                       model: type[BaseModel]) -> None:
    for e in err.errors():
        loc = tuple(e["loc"])
        path = base + loc
        kind = e["type"]
        if kind == "extra_forbidden":
            allowed = _fields_at(model, loc[:-1])
            found.add(path, f"unknown key '{loc[-1]}'", did_you_mean(str(loc[-1]), allowed), code=kind)
        elif kind == "missing":
            found.add(path, "required field is missing", code=kind)
        elif kind == "literal_error" and isinstance(e.get("input"), str):
            options = re.findall(r"'([^']*)'", str(e.get("ctx", {}).get("expected", "")))
            found.add(path, f"{e['msg']} (got {_short(e['input'])})",
                      did_you_mean(e["input"], options) if options else "", code=kind)
        else:
            msg = e["msg"].removeprefix("Value error, ")
            got = f" (got {_short(e['input'])})" if loc else ""
            found.add(path, msg + got, code=kind)


def _fields_at(model: type[BaseModel], loc: PathKey) -> list[str]:
    """Field names of the Pydantic model found by walking ``loc`` from ``model``."""
    tp: Any = model
    for part in loc:
        tp = _unwrap(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            if part not in tp.model_fields:
                return []
            tp = tp.model_fields[part].annotation
        elif typing.get_origin(tp) in (list, tuple, dict):
            tp = typing.get_args(tp)[-1]
        else:
            return []
    tp = _unwrap(tp)
    return list(tp.model_fields) if isinstance(tp, type) and issubclass(tp, BaseModel) else []


def _unwrap(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else tp
    return tp


