"""How a metric adds up, said where it is named: a metric's value is a float, or one of the
float subclasses below when it does not average.

A step's metrics come from several calls of a node (one per generation batch, chunk or
sample group) and, in a training group, from each worker's share of a call. A plain float is
averaged over the calls and, over a group's workers, weighted by the rows each worker took.
The others::

    Total    counts (tokens, groups, timeouts): summed over calls and over workers
    Seconds  wall time: summed over calls; over workers the slowest (they run at once)
    Rate     a throughput (tokens/s): averaged over calls, summed over workers
    Max/Min  an extreme: the largest (smallest) over calls and over workers

They are floats in every other respect (arithmetic gives a plain float; MLflow, JSON and Arrow
read them as floats) and survive pickling, so the kind travels with the value from an actor to
the driver. Imports nothing of dapo_flow: the math (dapo_flow.algos) names its metrics with them too.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


class Total(float):
    """A count: summed over a step's calls and over a group's workers."""


class Seconds(float):
    """Wall time: summed over calls; over a group's workers, the slowest."""


class Rate(float):
    """A throughput: averaged over calls; summed over a group's workers."""


class Max(float):
    """A largest value: the largest over calls and over workers."""


class Min(float):
    """A smallest value: the smallest over calls and over workers."""


KINDS: tuple[type, ...] = (float, Total, Seconds, Rate, Max, Min)


def kind_of(value: float) -> type:
    """The reduction ``value`` declares (``float``: averaged)."""
    kind = type(value)
    return kind if kind in KINDS else float


def over_calls(kind: type, values: Sequence[float]) -> float:
    """One step's value of a metric from its calls' ``values`` (at least one), as ``kind``."""
    if kind in (Total, Seconds):
        out = float(np.sum(values))
    elif kind is Max:
        out = max(values)
    elif kind is Min:
        out = min(values)
    else:
        out = float(np.mean(values))
    return kind(out)


def over_workers(kind: type, values: Sequence[float], rows: Sequence[int]) -> float:
    """One call's value of a metric from the group workers' ``values``, each worker having
    taken ``rows`` rows, as ``kind`` (an operator that reduces over the group itself reports the
    same value on every worker, which the weighted mean keeps)."""
    if kind in (Total, Rate):
        out = float(sum(values))
    elif kind in (Seconds, Max):
        out = max(values)
    elif kind is Min:
        out = min(values)
    elif all(v == values[0] for v in values):  # a value the group reduced itself: kept to the bit
        out = values[0]
    else:
        total = sum(rows)
        out = sum(v * w for v, w in zip(values, rows)) / total if total else float(np.mean(values))
    return kind(out)
