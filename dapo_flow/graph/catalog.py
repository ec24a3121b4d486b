"""`dapo-flow ops`: every registered operator, as its class declares it.

For each operator: the first paragraph of its module docstring, cardinality and whether it runs
a model, the columns it needs and adds (Arrow types, for default params), and each param with
its type, default, bounds and docstring (pydantic's ``use_attribute_docstrings``: see
:data:`dapo_flow.core.contract.PARAMS_CONFIG`).
"""

from __future__ import annotations

import inspect
import sys
import textwrap
import typing

from rich.console import Console

from dapo_flow.core.contract import contract_of, produces, requires
from dapo_flow.graph.problems import type_name

_BOUNDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<", "min_length": "min length",
           "max_length": "max length"}


def print_catalog(operators: typing.Mapping[str, type], custom_op: str, out: Console) -> None:
    for name, cls in operators.items():
        _print_op(name, cls, out)
    out.print(f"[bold cyan]{custom_op}[/]  your own class: `op: custom` with `impl: module:Class` "
              "or `impl: file.py:Class` (see dapo_flow/core/contract.py)")


def _print_op(name: str, cls: type, out: Console) -> None:
    doc = inspect.getdoc(sys.modules[cls.__module__]) or inspect.getdoc(cls) or ""
    if not contract_of(cls).needs_model:
        model = "CPU, in the driver"
    elif contract_of(cls).model_param:  # e.g. score: a reward model only when its params name one
        model = "CPU in the driver, or runs the model its params name"
    else:
        model = "runs a model (needs `model:`)"
    out.print(f"[bold cyan]{name}[/]  [dim]{contract_of(cls).cardinality}, {model}[/]")
    out.print(textwrap.indent(doc.split("\n\n")[0], "  "), markup=False)
    defaults = cls.Params()
    for label, cols in (("in ", requires(cls, defaults)), ("out", produces(cls, defaults))):
        text = ", ".join(f"{c}: {type_name(t)}" for c, t in cols.items()) or "-"
        out.print(f"  [bold]{label}[/] {text}", markup=True)
    contract = contract_of(cls)
    for setting, cols in contract.produces_with_train.items():  # a setting of the node's model adds them
        text = ", ".join(f"{c}: {type_name(t)}" for c, t in cols.items())
        out.print(f"  [bold]out[/] {text}  [dim](when its model has train.{setting})[/]", markup=True)
    dynamic = [w for w, fn in (("requires", contract.requires_fn), ("produces", contract.produces_fn)) if fn]
    if dynamic:
        out.print(f"  [dim](columns shown for default params; {' and '.join(dynamic)} depend on params)[/]")
    fields = cls.Params.model_fields
    out.print("  [bold]params[/]" + ("" if fields else " (none)"))
    for field, info in fields.items():
        default = "required" if info.is_required() else f"= {info.get_default(call_default_factory=True)!r}"
        bounds = ", ".join(f"{sym} {getattr(m, key)}" for m in info.metadata
                           for key, sym in _BOUNDS.items() if hasattr(m, key))
        out.print(f"    {field}: {type_str(info.annotation)} {default}" + (f"  [{bounds}]" if bounds else ""),
                  markup=False)
        if info.description:
            out.print(textwrap.indent(info.description, "        "), markup=False, style="dim")
    out.print()


def type_str(ann) -> str:
    """A param's annotation as a reader writes it: 'a' | 'b', float | None, int."""
    origin = typing.get_origin(ann)
    if origin is typing.Literal:
        return " | ".join(repr(v) for v in typing.get_args(ann))
    if origin is not None and origin.__name__ in ("Union", "UnionType"):
        return " | ".join(type_str(a) for a in typing.get_args(ann))
    if ann is type(None):
        return "None"
    return ann.__name__ if isinstance(ann, type) and origin is None else str(ann).replace("typing.", "")
