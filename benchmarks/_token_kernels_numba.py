"""numba kernels behind :mod:`dapo_flow.algos.kernels` (imported on first use: numba costs ~0.4 s).

Arrays in, arrays out; no torch. Every kernel is compiled once per signature and cached on disk.
Group statistics follow verl's GRPO: float32 row sums, float64 group mean and unbiased std,
a lone row uses mean 0 and std 1, plus dapo-flow's exact 0 for a constant group of >= 2.
"""

from __future__ import annotations

import math

import numba
import numpy as np

_JIT = dict(cache=True, boundscheck=False, nogil=True)


@numba.njit(inline="always")
def _mean(total, count):
    return total / count if count > 1 else 0.0  # verl: a lone sequence uses mean 0 ...


@numba.njit(inline="always")
def _denom(squares, count, norm_by_std, eps):
    if not norm_by_std:  # Dr.GRPO: centre only
        return 1.0
    std = np.sqrt(squares / (count - 1)) if count > 1 else 1.0  # ... and std 1; unbiased (torch.std)
    return std + eps


@numba.njit(inline="always")
def _write_row(mask, select, i, value, out, zeroed):
    # out[i] = value where mask[i] (`select`: bool mask), or value * mask[i] (float mask: verl's
    # adv * mask). The branches are loop-invariant: LLVM unswitches them. `zeroed`: `out` is all
    # +0.0 already (a fresh mapping), so with a bool mask only the selected tokens of a row whose
    # value is not +0.0 are stored: padding and constant groups cost no memory traffic.
    if select:
        zero = out.dtype.type(0)
        if zeroed:
            if value != 0 or math.copysign(1.0, value) < 0:  # -0.0 is stored, as torch would
                for t in range(mask.shape[1]):
                    if mask[i, t]:
                        out[i, t] = value
        else:
            for t in range(mask.shape[1]):
                out[i, t] = value if mask[i, t] else zero
    else:
        for t in range(mask.shape[1]):
            out[i, t] = value * mask[i, t]


@numba.njit(parallel=True, **_JIT)
def broadcast_rows(mask, select, values, out, zeroed):
    for i in numba.prange(mask.shape[0]):
        _write_row(mask, select, i, values[i], out, zeroed)


@numba.njit(parallel=True, fastmath={"reassoc"}, **_JIT)
def row_sums(rewards, scores):
    # scores[i] = sum_t rewards[i, t] in the rewards' dtype (verl: the float32 sum);
    # "reassoc" lets it vectorise, as torch's own reductions do.
    for i in numba.prange(rewards.shape[0]):
        acc = scores.dtype.type(0)
        for t in range(rewards.shape[1]):
            acc += rewards[i, t]
        scores[i] = acc


@numba.njit(**_JIT)
def run_starts(codes, n_groups):
    """First row of each group plus the row count (n_groups + 1 entries) when every group's rows
    are adjacent (verl's `repeat(interleave=True)` layout); an empty array when they are not."""
    n = codes.shape[0]
    starts = np.empty(n_groups + 1, np.int64)
    k = 0
    for i in range(n):
        if i == 0 or codes[i] != codes[i - 1]:
            if k == n_groups:  # more runs than groups: some group is split
                return np.empty(0, np.int64)
            starts[k] = i
            k += 1
    if k != n_groups:
        return np.empty(0, np.int64)
    starts[n_groups] = n
    return starts


@numba.njit(**_JIT)
def grpo_scattered(scores, codes, n_groups, norm_by_std, eps, adv):
    """Per-sequence GRPO advantages from scores, groups anywhere; False on a non-finite score."""
    n = codes.shape[0]
    count = np.zeros(n_groups, np.int64)
    total = np.zeros(n_groups)  # float64: exact sums of float32 scores
    first = np.full(n_groups, -1, np.int64)
    constant = np.ones(n_groups, np.bool_)
    for i in range(n):
        c = codes[i]
        count[c] += 1
        total[c] += scores[i]
        if first[c] < 0:
            first[c] = i
        elif scores[i] != scores[first[c]]:
            constant[c] = False
    if not np.isfinite(total.sum()):
        return False
    mean = np.empty(n_groups)
    for c in range(n_groups):
        mean[c] = _mean(total[c], count[c])
    squares = np.zeros(n_groups)
    for i in range(n):
        d = scores[i] - mean[codes[i]]
        squares[codes[i]] += d * d
    denom = np.empty(n_groups)
    for c in range(n_groups):
        denom[c] = _denom(squares[c], count[c], norm_by_std, eps)
    for i in range(n):
        c = codes[i]
        adv[i] = 0.0 if constant[c] and count[c] > 1 else (scores[i] - mean[c]) / denom[c]
    return True


@numba.njit(parallel=True, fastmath={"reassoc"}, **_JIT)
def grpo_runs(rewards, mask, select, starts, norm_by_std, eps, out, zeroed):
    """Token-level GRPO in ONE sweep when groups are contiguous runs (`starts` from
    :func:`run_starts`): per group, read its reward rows, form its statistics, write its output
    rows while they are hot. Row scores are parked in column 0 of `out` (the output dtype is the
    score dtype) until the row is written. "reassoc" only reorders the row sums. False on a
    non-finite score."""
    n_groups = starts.shape[0] - 1
    finite = np.ones(n_groups, np.bool_)
    for g in numba.prange(n_groups):
        lo, hi = starts[g], starts[g + 1]
        total = 0.0
        for i in range(lo, hi):
            acc = out.dtype.type(0)
            for t in range(rewards.shape[1]):
                acc += rewards[i, t]
            out[i, 0] = acc
            total += acc
        finite[g] = np.isfinite(total)
        mean = _mean(total, hi - lo)
        squares = 0.0
        constant = hi - lo > 1
        for i in range(lo, hi):
            squares += (out[i, 0] - mean) ** 2
            constant = constant and out[i, 0] == out[lo, 0]
        denom = _denom(squares, hi - lo, norm_by_std, eps)
        for i in range(lo, hi):
            value = out.dtype.type(0.0 if constant else (out[i, 0] - mean) / denom)
            if zeroed:
                out[i, 0] = 0.0  # the parked score goes: the row is zeros again
            _write_row(mask, select, i, value, out, zeroed)
    return finite.all()

