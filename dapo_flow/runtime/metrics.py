"""Step metrics: merging operator metrics over calls, and batch statistics from columns."""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Mapping

import numpy as np
import pyarrow as pa

from dapo_flow.graph import columns as C
from dapo_flow.reductions import Max, kind_of, over_calls


class MetricAccumulator:
    """A step's metrics from its calls, each reduced as its value's kind says
    (:mod:`dapo_flow.reductions`: a plain float is averaged)."""

    def __init__(self) -> None:
        self._values: dict[str, list[float]] = defaultdict(list)
        self._kinds: dict[str, type] = {}

    def add(self, metrics: Mapping[str, float], prefix: str = "") -> None:
        for key, value in metrics.items():
            self._values[prefix + key].append(float(value))
            self._kinds.setdefault(prefix + key, kind_of(value))

    def result(self) -> dict[str, float]:
        return {key: over_calls(self._kinds[key], values) for key, values in self._values.items()}


def batch_stats(batch: pa.Table, prefix: str = "batch/") -> dict[str, float]:
    """Means of the reward/length columns a training batch carries (those present)."""
    out: dict[str, float] = {}
    if batch.num_rows == 0:
        return out
    names = set(batch.column_names)
    for col in (C.REWARD, C.SCORE, C.ACC, C.OVERLONG_PENALTY, C.ADVANTAGE):
        if col in names:
            out[f"{prefix}{col}_mean"] = float(np.mean(batch.column(col).to_numpy()))
    if C.RESPONSE_LEN in names:
        lengths = batch.column(C.RESPONSE_LEN).to_numpy()
        out[f"{prefix}response_len_mean"] = float(lengths.mean())
        out[f"{prefix}response_len_max"] = Max(lengths.max())
    if C.TRUNCATED in names:
        out[f"{prefix}overlong_frac"] = float(np.mean(batch.column(C.TRUNCATED).to_numpy(zero_copy_only=False)))
    return out


def first_row(table: pa.Table) -> dict[str, float]:
    """A one-row metrics table (a sink's output) as a dict."""
    return {name: float(table.column(name)[0].as_py()) for name in table.column_names} if table.num_rows else {}


def concat(tables: Iterable[pa.Table]) -> pa.Table:
    tables = [t for t in tables if t is not None]
    return pa.concat_tables(tables, promote_options="default") if tables else None
