"""Tables as they travel between stages (pure: no Ray).

A stage's output stays where the stage made it: in-process under the local executor, in
Ray's object store under Ray. What the driver holds is a *handle*: the table itself, an
opaque reference to it (an ObjectRef), or :class:`TableParts`: the pieces of one table in
row order (a group's per-worker outputs, a step's generation chunks), optionally narrowed
to some prompt groups (dynamic sampling's cut). A worker turns the handles it is given into
one table with :func:`assemble`; the driver does the same only for what it must read
(validation results, a checkpoint's carried groups).

What the driver decides on comes back beside each table as :class:`ChainInfo`: per-node
metrics, row counts and the output's prompt groups, never the rows themselves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dapo_flow.core import columns as C

Report = list[tuple[str, dict[str, float], float]]  # per node: (id, metrics, seconds)


@dataclass(frozen=True)
class TableParts:
    """One table as its parts in row order (each a table or a reference to one), keeping only
    the rows whose ``prompt_id`` is in ``keep`` when that is set."""

    parts: tuple[Any, ...]
    keep: tuple[str, ...] | None = None


@dataclass(frozen=True)
class ChainInfo:
    """What a row call tells the driver besides its table: each node's metrics and seconds,
    the rows it took and gave, the output's bytes and its prompt groups (unique prompt ids in
    order of first appearance; None without a prompt_id column)."""

    report: Report
    rows_in: int
    rows_out: int
    bytes_out: int
    groups: tuple[str, ...] | None


def parts_of(handles: Sequence[Any]) -> TableParts:
    """Handles (tables, references, TableParts without a cut) as one TableParts, flattened."""
    if any(isinstance(h, TableParts) and h.keep is not None for h in handles):
        raise ValueError("a cut TableParts cannot be flattened; cut after joining")
    return TableParts(_flat(handles))


def cut(handles: Sequence[Any], keep: Sequence[str]) -> TableParts:
    """The rows of ``handles`` (joined in order) whose prompt group is in ``keep``. A handle
    that is already cut contributes its parts whole: the cut is only correct because prompt
    ids never repeat across a run's generation batches, so the groups it dropped are not in
    ``keep`` either."""
    return TableParts(_flat(handles), tuple(keep))


def _flat(handles: Sequence[Any]) -> tuple[Any, ...]:
    parts: list[Any] = []
    for h in handles:
        if isinstance(h, TableParts):
            parts.extend(h.parts)
        elif h is not None:
            parts.append(h)
    return tuple(parts)


def assemble(handle: Any, resolve: Callable[[list], list]) -> pa.Table:
    """The table behind ``handle``; ``resolve`` turns a list of parts into tables (under Ray,
    ``ray.get``; in-process, the identity)."""
    if not isinstance(handle, TableParts):
        return resolve([handle])[0] if not isinstance(handle, pa.Table) else handle
    tables = [t for t in resolve(list(handle.parts)) if t is not None]
    if not tables:
        return pa.table({})
    table = tables[0] if len(tables) == 1 else pa.concat_tables(tables, promote_options="default")
    if handle.keep is not None:
        mask = pc.is_in(table.column(C.PROMPT_ID), value_set=pa.array(list(handle.keep), pa.string()))
        table = table.filter(mask)
    return table


def groups_of(table: pa.Table) -> tuple[str, ...] | None:
    """Unique prompt ids in order of first appearance (None without the column)."""
    if C.PROMPT_ID not in table.column_names:
        return None
    ids = table.column(C.PROMPT_ID).to_numpy(zero_copy_only=False)
    if len(ids) == 0:
        return ()
    uniq, first = np.unique(ids, return_index=True)
    return tuple(str(u) for u in uniq[np.argsort(first)])


def info_of(report: Report, rows_in: int, out: pa.Table) -> ChainInfo:
    return ChainInfo(report, rows_in, out.num_rows, out.nbytes, groups_of(out))


def merge_inputs(combine: Callable[[Any, list], pa.Table] | None, params: Any,
                 tables: Sequence[pa.Table]) -> pa.Table:
    """A node's input from its inputs' tables: the op's own keyed join when it has one
    (its contract's ``combine``, e.g. baseline's), else a row-aligned join that adds the
    columns the first table lacks."""
    if combine is not None:
        return combine(params, list(tables))
    merged = tables[0]
    for other in tables[1:]:
        for name in other.column_names:
            if name not in merged.column_names:
                merged = merged.append_column(name, other.column(name))
    return merged


def table_to_ipc(table: pa.Table) -> pa.Buffer:
    """``table`` as one Arrow IPC stream (schema and its metadata, chunks; of a slice only its
    rows): how a table crosses between processes (Ray's object store), written in one pass and
    read back in place by :func:`table_from_ipc`."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


def table_from_ipc(buffer: Any) -> pa.Table:
    """The table of an IPC stream (:func:`table_to_ipc`); its columns point into ``buffer``
    (any object with the buffer protocol: the object store's memory), not copied."""
    return pa.ipc.open_stream(pa.py_buffer(buffer)).read_all()
