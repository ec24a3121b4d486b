"""Group ids -> dense integer codes, segment reductions over groups, and dynamic sampling's
keep mask (:func:`keep_groups`). Shapes: per sequence (batch,), per group (n_groups,)."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import NamedTuple, TypeAlias

import numpy as np
import polars as pl
from torch import Tensor

from dapo_flow.algos.errors import AlgoError

# --------------------------------------------------------------------------------------------
# Group ids -> dense codes
# --------------------------------------------------------------------------------------------


class Groups(NamedTuple):
    """Dense group codes: ``codes[i]`` in ``[0, n_groups)``; equal ids <=> equal codes.

    Returned by :func:`factorize`; every function taking ``group_ids`` also accepts a ``Groups``
    (no re-factorizing), so an operator can factorize a batch once and reuse it.
    """

    codes: np.ndarray  # int64, Shape: (batch,)
    n_groups: int


GroupIds: TypeAlias = Groups | Sequence[Hashable] | np.ndarray | pl.Series | Tensor


def factorize(group_ids: GroupIds) -> Groups:
    """Map group ids (str or int; list, numpy, polars, torch or Arrow array) to dense codes.

    Codes are assigned by value, not position; their order is unspecified. Strings go through a
    polars Categorical cast (one hash pass, no string sort), integers through a dense remap or
    ``np.unique``.
    Shape: (batch,) -> codes (batch,).
    """
    if isinstance(group_ids, Groups):
        return group_ids
    if isinstance(group_ids, Tensor):
        group_ids = group_ids.detach().cpu().numpy()
    if isinstance(group_ids, np.ndarray):
        if group_ids.ndim != 1:
            raise AlgoError(f"group ids must be 1-D, got shape {group_ids.shape}")
        kind = group_ids.dtype.kind
        if kind in "biu":
            return _factorize_ints(group_ids)
        if kind == "f":
            return _factorize_floats(group_ids)
        if kind in "US":
            return _factorize_series(pl.Series(group_ids.astype(str), dtype=pl.String))
        if kind == "O":
            try:  # the common case: Python str objects (Arrow `to_numpy`, verl's uid array)
                return _factorize_series(pl.Series(group_ids, dtype=pl.String))
            except (TypeError, pl.exceptions.PolarsError):
                group_ids = group_ids.tolist()  # ints as objects; polars infers the type
        else:
            raise AlgoError(f"unsupported group id dtype {group_ids.dtype}")
    if isinstance(group_ids, pl.Series):
        return _factorize_series(group_ids)
    try:  # lists, tuples, pyarrow (Chunked)Arrays, ...
        series = pl.Series(group_ids)
    except (TypeError, ValueError, pl.exceptions.PolarsError) as e:
        raise AlgoError(f"group ids must be all str or all int: {e}") from e
    return _factorize_series(series)


def _factorize_series(s: pl.Series) -> Groups:
    if s.len() == 0:
        return Groups(np.zeros(0, np.int64), 0)
    if s.null_count():
        raise AlgoError(f"group ids contain {s.null_count()} null(s)")
    dtype = s.dtype
    if dtype == pl.Boolean or dtype.is_integer():
        return _factorize_ints(s.to_numpy())
    if dtype.is_float():
        return _factorize_floats(s.to_numpy())
    if dtype == pl.Categorical or isinstance(dtype, pl.Enum):
        s, dtype = s.cast(pl.String), pl.String
    if dtype != pl.String:
        raise AlgoError(f"group ids must be str or int, got polars dtype {dtype}")
    if hasattr(pl, "Categories"):  # polars >= 1.32
        # A fresh (unnamed, garbage-collected) category set numbers strings 0, 1, ... by first
        # appearance: dense codes by value from one hash pass, and no global string cache growth.
        codes = s.cast(pl.Categorical(pl.Categories.random())).to_physical().to_numpy().astype(np.int64)
        return Groups(codes, int(codes.max()) + 1)
    categories = s.unique()  # Enum physical codes index `categories`
    codes = s.cast(pl.Enum(categories)).to_physical().to_numpy().astype(np.int64)
    return Groups(codes, len(categories))


def _factorize_ints(ids: np.ndarray) -> Groups:
    ids = ids.astype(np.int64, copy=False)
    if ids.size == 0:
        return Groups(np.zeros(0, np.int64), 0)
    lo, hi = int(ids.min()), int(ids.max())
    span = hi - lo + 1
    if span <= 4 * ids.size + 1024:  # compact range (e.g. already-dense codes): O(n + span)
        shifted = ids - lo
        present = np.zeros(span, np.int64)
        present[shifted] = 1
        remap = np.cumsum(present) - 1
        return Groups(remap[shifted], int(remap[-1]) + 1)
    uniq, codes = np.unique(ids, return_inverse=True)
    return Groups(codes.astype(np.int64, copy=False), len(uniq))


def _factorize_floats(ids: np.ndarray) -> Groups:
    if np.isnan(ids).any():
        raise AlgoError("group ids contain NaN")
    uniq, codes = np.unique(ids, return_inverse=True)
    return Groups(codes.astype(np.int64, copy=False), len(uniq))


def _groups_for(group_ids: GroupIds, n: int) -> Groups:
    groups = factorize(group_ids)
    if groups.codes.shape != (n,):
        raise AlgoError(f"got {groups.codes.shape[0]} group ids for {n} sequences")
    return groups


# --------------------------------------------------------------------------------------------
# Segment reductions shared by every group statistic
# --------------------------------------------------------------------------------------------


class Segments(NamedTuple):
    """Groups plus their sizes, computed once per call. Reductions are np.bincount (float64)."""

    codes: np.ndarray  # int64, Shape: (batch,)
    n_groups: int
    counts: np.ndarray  # float64, Shape: (n_groups,)

    @classmethod
    def of(cls, g: Groups) -> Segments:
        return cls(g.codes, g.n_groups, np.bincount(g.codes, minlength=g.n_groups).astype(np.float64))

    def sum(self, weights: np.ndarray) -> np.ndarray:
        """Per-group sum. Shape: (batch,) -> (n_groups,)."""
        return np.bincount(self.codes, weights=weights, minlength=self.n_groups)

    def mean(self, values: np.ndarray, lone: float | None = None) -> np.ndarray:
        """Per-group mean; `lone` replaces it for singleton groups. Shape: (batch,) -> (n_groups,)."""
        mean = self.sum(values) / np.maximum(self.counts, 1)
        return mean if lone is None else np.where(self.counts == 1, lone, mean)


def _constant_groups(seg: Segments, values: np.ndarray) -> np.ndarray:
    """True for groups whose values are all exactly equal (singletons included).

    Exact for any dtype: compares every member with one representative member, no arithmetic.
    Shape: values (batch,) -> (n_groups,).
    """
    representative = np.zeros(seg.n_groups, np.int64)
    representative[seg.codes] = np.arange(seg.codes.size)  # whichever write wins is a member
    differs = values != values[representative][seg.codes]
    return seg.sum(differs) == 0




def keep_groups(group_ids: GroupIds, values: np.ndarray | Sequence[float] | Tensor) -> np.ndarray:
    """Dynamic-sampling keep mask: keep a group unless all its values are exactly equal;
    singleton groups are kept (DAPO; verl's ``np.std > 0`` for exactly equal values).

    Shape: group_ids (batch,), values (batch,) -> (batch,) bool, constant within a group.
    """
    v = _as_numpy(values, "values")
    g = _groups_for(group_ids, v.shape[0])
    if v.dtype.kind == "f" and np.isnan(v).any():
        raise AlgoError("values contain NaN (verl would silently drop such a group)")
    seg = Segments.of(g)
    keep = ~_constant_groups(seg, v) | (seg.counts == 1)
    return keep[seg.codes]


def fill_from_group(group_ids: GroupIds, values: np.ndarray, missing: np.ndarray, empty: float) -> np.ndarray:
    """``values`` with each missing entry replaced by the mean of its group's present ones
    (``empty`` in a group with none): the group's mean is unchanged, so under a group-relative
    baseline a filled entry gets no advantage (a reward the server could not give is masked).
    Shape: values (batch,), missing (batch,) bool -> (batch,) float64.
    """
    v = np.asarray(values, np.float64)
    seg = Segments.of(_groups_for(group_ids, v.shape[0]))
    present = ~np.asarray(missing, bool)
    counts = seg.sum(present.astype(np.float64))
    mean = np.where(counts > 0, seg.sum(np.where(present, v, 0.0)) / np.maximum(counts, 1), empty)
    return np.where(present, v, mean[seg.codes])


def _as_numpy(x: object, what: str) -> np.ndarray:
    if isinstance(x, Tensor):
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.ndim != 1:
        raise AlgoError(f"{what} must be 1-D, got shape {arr.shape}")
    return arr
