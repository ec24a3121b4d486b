"""Fused CPU kernels (numba) for the few token-level passes torch cannot do in one sweep.

``torch.where(mask, adv[:, None], 0)`` with a bool mask runs a broadcasting, type-mixing
TensorIterator loop that costs ~1.6x a plain tensor copy on CPU; the loop here reads the mask
once and writes the output once, vectorised, on the same number of threads torch uses.

numba is imported on first use (it costs ~0.4 s), kernels are compiled once per signature and
cached on disk next to this module. :func:`masked_broadcast` returns None when it cannot take
the input (numba missing, CUDA or non-contiguous tensors, unusual dtypes): callers then use the
plain torch expression.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import torch
from torch import Tensor

_OUT_DTYPES = (torch.float32, torch.float64)


@functools.cache
def _compiled() -> SimpleNamespace | None:
    try:
        import numba
    except ImportError:  # pragma: no cover - numba is a dependency; keep a torch fallback anyway
        return None

    @numba.njit(parallel=True, cache=True, boundscheck=False, nogil=True)
    def select_rows(mask, values, out):
        # out[i, t] = values[i] if mask[i, t] else 0, rows split across threads.
        zero = out.dtype.type(0)
        for i in numba.prange(mask.shape[0]):
            v = values[i]
            for t in range(mask.shape[1]):
                out[i, t] = v if mask[i, t] else zero

    @numba.njit(parallel=True, cache=True, boundscheck=False, nogil=True)
    def scale_rows(mask, values, out):
        # out[i, t] = values[i] * mask[i, t] (verl's `adv * mask` for a float mask).
        for i in numba.prange(mask.shape[0]):
            v = values[i]
            for t in range(mask.shape[1]):
                out[i, t] = v * mask[i, t]

    @numba.njit(parallel=True, cache=True, boundscheck=False, nogil=True, fastmath={"reassoc"})
    def row_sums(rewards, scores):
        # scores[i] = sum_t rewards[i, t] in the rewards' dtype (verl: the float32 sum);
        # "reassoc" lets it vectorise, as torch's own reductions do.
        for i in numba.prange(rewards.shape[0]):
            acc = scores.dtype.type(0)
            for t in range(rewards.shape[1]):
                acc += rewards[i, t]
            scores[i] = acc

    @numba.njit(cache=True, boundscheck=False, nogil=True)
    def grpo_scores(scores, codes, n_groups, norm_by_std, eps, adv):
        # Per-group mean and unbiased std in float64 (exact sums of float32 scores); verl: a lone
        # sequence uses mean 0 and std 1. Returns False on a non-finite score.
        n = codes.shape[0]
        count = np.zeros(n_groups, np.int64)
        total = np.zeros(n_groups)
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
        mean = np.zeros(n_groups)
        for c in range(n_groups):
            if count[c] > 1:
                mean[c] = total[c] / count[c]
        squares = np.zeros(n_groups)
        for i in range(n):
            d = scores[i] - mean[codes[i]]
            squares[codes[i]] += d * d
        denom = np.ones(n_groups)
        if norm_by_std:
            for c in range(n_groups):
                if count[c] > 1:
                    denom[c] = np.sqrt(squares[c] / (count[c] - 1))  # unbiased, as torch.std
                denom[c] += eps
        for i in range(n):
            c = codes[i]
            # dapo-flow: a constant group of >= 2 gets exactly 0, whatever rounding the mean had
            adv[i] = 0.0 if constant[c] and count[c] > 1 else (scores[i] - mean[c]) / denom[c]
        return True

    return SimpleNamespace(
        numba=numba, select_rows=select_rows, scale_rows=scale_rows, row_sums=row_sums, grpo_scores=grpo_scores
    )


def masked_broadcast(values: Tensor, mask: Tensor, out: Tensor) -> Tensor | None:
    """``out[i, t] = values[i]`` where ``mask[i, t]`` (bool), or ``values[i] * mask[i, t]``
    (float mask of ``out``'s dtype), in one pass; None if this input needs the torch path.

    Shape: values (batch,), mask (batch, T), out (batch, T) -> out.
    """
    if not _takes(mask, out):
        return None
    kernels = _compiled()
    if kernels is None:
        return None
    v = values.detach().to(device="cpu", dtype=out.dtype).contiguous().numpy()
    kernel = kernels.select_rows if mask.dtype == torch.bool else kernels.scale_rows
    with _torch_thread_budget(kernels.numba):
        kernel(mask.detach().numpy(), v, out.detach().numpy())
    return out


def _takes(mask: Tensor, out: Tensor) -> bool:
    return (
        out.device.type == "cpu"
        and mask.device.type == "cpu"
        and out.dtype in _OUT_DTYPES
        and mask.dtype in (torch.bool, out.dtype)
        and out.is_contiguous()
        and mask.is_contiguous()
        and not out.requires_grad
        and out.numel() > 0
    )


@contextlib.contextmanager
def _torch_thread_budget(numba) -> Iterator[None]:  # noqa: ANN001 - the numba module
    """Run kernels on as many threads as torch has (the runtime's CPU budget for this process).

    numba's OpenMP layer shares libgomp with torch and resets its thread count when it launches
    a parallel region (an actor at 1 torch thread came back at 2), so torch's is restored after.
    """
    threads = torch.get_num_threads()
    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
    try:
        yield
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def grpo_token_advantages(
    rewards: Tensor, mask: Tensor, codes: np.ndarray, n_groups: int, norm_by_std: bool, eps: float, out: Tensor
) -> bool | None:
    """GRPO (or Dr.GRPO) token advantages in one kernel: the row sums of ``rewards`` (in its
    dtype, as verl), per-group mean and unbiased std (float64; lone rows: mean 0, std 1; constant
    groups: exactly 0), then ``out`` rows masked like :func:`masked_broadcast`. Returns whether every
    score was finite (False: ``out`` holds garbage), or None if this input needs the torch path.

    Shape: rewards, mask, out (batch, T); codes (batch,) int64 dense in [0, n_groups).
    """
    if not (_takes(mask, out) and rewards.dtype == out.dtype and rewards.device.type == "cpu"):
        return None
    kernels = _compiled()
    if kernels is None:
        return None
    scores = np.empty(rewards.shape[0], np.float32 if out.dtype == torch.float32 else np.float64)
    adv = np.empty_like(scores)
    write = kernels.select_rows if mask.dtype == torch.bool else kernels.scale_rows
    with _torch_thread_budget(kernels.numba):
        kernels.row_sums(rewards.detach().contiguous().numpy(), scores)
        if not kernels.grpo_scores(scores, codes, n_groups, norm_by_std, eps, adv):
            return False
        write(mask.detach().numpy(), adv, out.detach().numpy())
    return True
