"""Step metrics: merging operator metrics over calls, and batch statistics from columns."""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Mapping

import numpy as np
import pyarrow as pa

from dapo_flow.core import columns as C
from dapo_flow.reductions import Max, Total, kind_of, over_calls

#: a batch's token count per policy version is reported as ``batch/`` + this + the version (a
#: count, added over a group's workers); the driver turns them into the staleness histogram
TOKENS_AT_VERSION = "rollout_tokens_at_version_"


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
    if C.ROLLOUT_VERSION in names:
        out.update(version_stats(batch.column(C.ROLLOUT_VERSION), prefix))
    return out


def version_stats(versions: pa.ChunkedArray, prefix: str = "batch/") -> dict[str, float]:
    """The policy versions a batch's tokens were sampled under (``rollout_version``): the
    tokens of each version (:data:`TOKENS_AT_VERSION`), from which the driver derives the oldest,
    the mean and the staleness (``loop.token_staleness``), and the fraction of samples whose
    tokens span more than one (partial rollouts: weights that changed mid-generation)."""
    array = versions.combine_chunks()
    flat = array.flatten().to_numpy()
    if len(flat) == 0:
        return {}
    offsets = array.offsets.to_numpy() - array.offsets[0].as_py()  # a slice's start at 0, as flatten's
    starts = offsets[:-1][offsets[:-1] < offsets[1:]]  # rows with tokens
    spans = np.maximum.reduceat(flat, starts) > np.minimum.reduceat(flat, starts)
    seen, counts = np.unique(flat, return_counts=True)
    return {f"{prefix}partial_samples": float(spans.mean()),
            **{f"{prefix}{TOKENS_AT_VERSION}{v}": Total(c) for v, c in zip(seen.tolist(), counts.tolist())}}


def first_row(table: pa.Table) -> dict[str, float]:
    """A one-row metrics table (a sink's output) as a dict."""
    return {name: float(table.column(name)[0].as_py()) for name in table.column_names} if table.num_rows else {}


def concat(tables: Iterable[pa.Table]) -> pa.Table:
    tables = [t for t in tables if t is not None]
    return pa.concat_tables(tables, promote_options="default") if tables else None
