"""Step metrics: merging operator metrics over calls, and batch statistics from columns."""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Mapping

import numpy as np
import pyarrow as pa

from dapo_flow.graph import columns as C

# counters and times add up over a step's calls (generation batches, chunks); the rest is averaged
_SUMMED_SUFFIXES = ("_groups", "/tokens", "/seconds", "/samples", "/skipped_minibatches", "/timeouts")
_SUMMED_PREFIXES = ("time/",)


class MetricAccumulator:
    def __init__(self) -> None:
        self._values: dict[str, list[float]] = defaultdict(list)

    def add(self, metrics: Mapping[str, float], prefix: str = "") -> None:
        for key, value in metrics.items():
            self._values[prefix + key].append(float(value))

    def result(self) -> dict[str, float]:
        out = {}
        for key, values in self._values.items():
            summed = key.endswith(_SUMMED_SUFFIXES) or key.startswith(_SUMMED_PREFIXES)
            out[key] = float(np.sum(values)) if summed else float(np.mean(values))
        return out


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
        out[f"{prefix}response_len_max"] = float(lengths.max())
    if C.TRUNCATED in names:
        out[f"{prefix}overlong_frac"] = float(np.mean(batch.column(C.TRUNCATED).to_numpy(zero_copy_only=False)))
    return out


def first_row(table: pa.Table) -> dict[str, float]:
    """A one-row metrics table (a sink's output) as a dict."""
    return {name: float(table.column(name)[0].as_py()) for name in table.column_names} if table.num_rows else {}


def concat(tables: Iterable[pa.Table]) -> pa.Table:
    tables = [t for t in tables if t is not None]
    return pa.concat_tables(tables, promote_options="default") if tables else None
