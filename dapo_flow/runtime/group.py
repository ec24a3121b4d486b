"""Rows across a training group (or rollout replicas): each member of a group takes its share
of a call's whole input, and the members' reports join into one (pure: no Ray).

Shares are CONTIGUOUS runs of rows cut only between prompt groups, balanced by tokens: a group's
samples stay on one worker (an operator may need a whole group), and the workers' outputs, taken
in rank order, are in the order of the input, for row-aligned and for expanding operators alike
(generation emits each prompt's samples together), so the next stage joins them with other
tables row by row as if one worker had run them. An update's shares are dealt out instead
(:func:`split_for_update`).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pyarrow as pa

from dapo_flow.core import columns as C
from dapo_flow.reductions import kind_of, over_workers
from dapo_flow.runtime.tables import ChainInfo, Report


def row_tokens(table: pa.Table) -> np.ndarray:
    """Work per row: prompt plus response tokens where the table has them, else 1.
    Shape: (rows,) int64."""
    weight = np.zeros(table.num_rows, dtype=np.int64)
    for col in (C.PROMPT_IDS, C.RESPONSE_IDS):
        if col in table.column_names:
            weight += pa.compute.list_value_length(table.column(col)).fill_null(0).to_numpy(
                zero_copy_only=False).astype(np.int64)
    return np.maximum(weight, 1)


def group_starts(table: pa.Table) -> np.ndarray:
    """Row indices where a run of equal ``prompt_id`` begins (every row without the column).
    Shape: (runs,) int64, starting with 0 for a non-empty table."""
    if table.num_rows == 0:
        return np.zeros(0, dtype=np.int64)
    if C.PROMPT_ID not in table.column_names:
        return np.arange(table.num_rows, dtype=np.int64)
    ids = table.column(C.PROMPT_ID).to_numpy(zero_copy_only=False)
    change = np.ones(len(ids), dtype=bool)
    change[1:] = ids[1:] != ids[:-1]
    return np.flatnonzero(change).astype(np.int64)


def share_bounds(table: pa.Table, workers: int) -> list[tuple[int, int]]:
    """``workers`` contiguous (start, stop) row ranges, cut at group starts, each as close as a
    cut allows to an equal share of the tokens (a worker may get none when there are fewer
    groups than workers)."""
    starts = group_starts(table)
    n = table.num_rows
    if n == 0 or workers == 1:
        return [(0, n)] + [(n, n)] * (workers - 1)
    cum = np.concatenate([[0], np.cumsum(row_tokens(table))])
    at_start = cum[starts]  # tokens before each group
    cuts = [0]
    for k in range(1, workers):
        target = cum[-1] * k / workers
        i = int(np.argmin(np.abs(at_start - target)))
        cuts.append(max(int(starts[i]), cuts[-1]))
    cuts.append(n)
    return [(cuts[k], cuts[k + 1]) for k in range(workers)]


def split(table: pa.Table, workers: int) -> list[pa.Table]:
    """Each worker's share of ``table`` (see :func:`share_bounds`)."""
    return [table.slice(a, b - a) for a, b in share_bounds(table, workers)]


def interleaved_rows(table: pa.Table, workers: int) -> list[np.ndarray]:
    """Each worker's rows (ascending indices) when prompt groups are dealt out in order, each to
    the worker with the fewest tokens so far: whole groups per worker, and every contiguous run
    of the batch (a mini-batch as one worker cuts it) shared about evenly among the workers."""
    starts = group_starts(table)
    bounds = np.append(starts, table.num_rows)
    tokens = np.add.reduceat(row_tokens(table), starts) if len(starts) else np.zeros(0, np.int64)
    load = np.zeros(workers, dtype=np.int64)
    owned: list[list[np.ndarray]] = [[] for _ in range(workers)]
    for g, weight in enumerate(tokens):
        w = int(np.argmin(load))
        load[w] += weight
        owned[w].append(np.arange(bounds[g], bounds[g + 1]))
    return [np.concatenate(rows) if rows else np.zeros(0, np.int64) for rows in owned]


def split_for_update(table: pa.Table, workers: int) -> list[pa.Table]:
    """Shares of a batch that ends in a sink (an update): :func:`interleaved_rows`, each with
    its rows' positions in ``table`` as column ``batch_row``. Order does not matter to a sink
    (it returns one row of metrics), and with the positions the group cuts the whole batch into
    the mini-batches one worker would, each worker training its rows of each."""
    return [_take_rows(table, rows) for rows in interleaved_rows(table, workers)]


def update_share(table: pa.Table, workers: int, rank: int) -> pa.Table:
    """Worker ``rank``'s part of :func:`split_for_update`."""
    return _take_rows(table, interleaved_rows(table, workers)[rank])


def share(table: pa.Table, workers: int, rank: int) -> pa.Table:
    """Worker ``rank``'s part of :func:`split`."""
    start, stop = share_bounds(table, workers)[rank]
    return table.slice(start, stop - start)


def _take_rows(table: pa.Table, rows: np.ndarray) -> pa.Table:
    positions = pa.array(rows, pa.int64())
    return table.take(positions).append_column(C.BATCH_ROW, positions)


def join_infos(infos: Sequence[ChainInfo], sink: bool) -> ChainInfo:
    """The group's ChainInfo from its workers', in rank order: reports joined node by node
    (weighted by the rows each worker took), rows and bytes added (a sink's output is rank
    0's), prompt groups in rank order (whole groups per worker)."""
    groups = None
    if not sink and all(i.groups is not None for i in infos):
        groups = tuple(g for i in infos for g in i.groups)
    first = infos[0]
    return ChainInfo(
        join_reports([i.report for i in infos], [i.rows_in for i in infos]),
        rows_in=sum(i.rows_in for i in infos),
        rows_out=first.rows_out if sink else sum(i.rows_out for i in infos),
        bytes_out=first.bytes_out if sink else sum(i.bytes_out for i in infos),
        groups=first.groups if sink else groups,
    )


def join_reports(reports: Sequence[Report], rows: Sequence[int]) -> Report:
    """The workers' per-node reports as one, node by node (every worker ran the same chain),
    each metric as its value's kind says (:func:`dapo_flow.reductions.over_workers`: wall times
    the slowest worker's, counts and throughputs added, a plain float the mean weighted by the
    rows each worker had); a metric only some workers report (e.g. batch/* of a worker that had
    rows) is combined over those that did."""
    out: Report = []
    for entries in zip(*reports):
        nid = entries[0][0]
        keys = dict.fromkeys(k for _, metrics, _ in entries for k in metrics)
        metrics = {}
        for key in keys:
            have = [(m[key], w) for (_, m, _), w in zip(entries, rows) if key in m]
            metrics[key] = over_workers(kind_of(have[0][0]), [v for v, _ in have], [w for _, w in have])
        out.append((nid, metrics, max(seconds for _, _, seconds in entries)))
    return out
