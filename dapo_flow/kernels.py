"""Fused CPU kernels for the token-level passes torch cannot do in one sweep (numba, in
:mod:`dapo_flow._kernels_numba`, imported on first use).

``torch.where(mask, adv[:, None], 0)`` with a bool mask runs a broadcasting, type-mixing
TensorIterator loop that costs ~1.6x a plain tensor copy on CPU; the kernels read the mask once
and write the output once, vectorised, on the threads torch has. When a batch's groups are
contiguous (verl's layout) token-level GRPO is a single sweep: each group's reward rows are
read, its statistics formed and its output rows written while they are in cache.

Each entry point returns None when it cannot take the input (numba missing, CUDA or
non-contiguous tensors, unusual dtypes); callers then use the plain torch/numpy path.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from types import ModuleType

import numpy as np
import torch
from torch import Tensor

_OUT_DTYPES = (torch.float32, torch.float64)
#: Smallest output (elements) the kernels take. Below it torch's slower loop still costs less
#: than numba's per-call overhead (~0.1-0.2 ms) and first-use import (~0.5 s), so training-sized
#: batches never load numba.
MIN_ELEMENTS = 1 << 18


@functools.cache
def _kernels() -> ModuleType | None:
    try:
        from dapo_flow import _kernels_numba
    except ImportError:  # pragma: no cover - numba is a dependency; keep the torch path anyway
        return None
    return _kernels_numba


def masked_broadcast(values: Tensor, mask: Tensor, out: Tensor) -> Tensor | None:
    """``out[i, t] = values[i]`` where ``mask[i, t]`` (bool), or ``values[i] * mask[i, t]``
    (float mask of ``out``'s dtype), in one pass; None if this input needs the torch path.

    Shape: values (batch,), mask (batch, T), out (batch, T) -> out.
    """
    k = _kernels() if _takes(mask, out) else None
    if k is None:
        return None
    v = values.detach().to(device="cpu", dtype=out.dtype).contiguous().numpy()
    with _torch_thread_budget():
        k.broadcast_rows(mask.detach().numpy(), mask.dtype == torch.bool, v, out.detach().numpy())
    return out


def grpo_token_advantages(
    rewards: Tensor, mask: Tensor, codes: np.ndarray, n_groups: int, norm_by_std: bool, eps: float, out: Tensor
) -> bool | None:
    """GRPO (or Dr.GRPO) token advantages: the row sums of ``rewards`` (in its dtype, as verl),
    per-group mean and unbiased std (float64; lone rows: mean 0, std 1; constant groups: exactly
    0), then ``out`` rows masked like :func:`masked_broadcast`. One sweep when groups are
    contiguous, else two (row sums, then the write). Returns whether every score was finite
    (False: ``out`` holds garbage), or None if this input needs the torch path.

    Shape: rewards, mask, out (batch, T); codes (batch,) int64 dense in [0, n_groups).
    """
    ok = _takes(mask, out) and rewards.dtype == out.dtype and rewards.device.type == "cpu"
    k = _kernels() if ok else None
    if k is None:
        return None
    r, m, o = rewards.detach().contiguous().numpy(), mask.detach().numpy(), out.detach().numpy()
    select = mask.dtype == torch.bool
    with _torch_thread_budget():
        starts = k.run_starts(codes, n_groups)
        if starts.size:
            return bool(k.grpo_runs(r, m, select, starts, norm_by_std, eps, o))
        scores = np.empty(r.shape[0], r.dtype)
        adv = np.empty_like(scores)
        k.row_sums(r, scores)
        if not k.grpo_scattered(scores, codes, n_groups, norm_by_std, eps, adv):
            return False
        k.broadcast_rows(m, select, adv, o)
    return True


def _takes(mask: Tensor, out: Tensor) -> bool:
    return (
        out.device.type == "cpu"
        and mask.device.type == "cpu"
        and out.dtype in _OUT_DTYPES
        and mask.dtype in (torch.bool, out.dtype)
        and out.is_contiguous()
        and mask.is_contiguous()
        and not out.requires_grad
        and out.numel() >= max(MIN_ELEMENTS, 1)
    )


@contextlib.contextmanager
def _torch_thread_budget() -> Iterator[None]:
    """Run kernels on as many threads as torch has (the runtime's CPU budget for this process).

    numba's OpenMP layer shares libgomp with torch and resets its thread count when it launches
    a parallel region (a process at 1 torch thread came back at 2), so torch's is restored after.
    """
    import numba

    threads = torch.get_num_threads()
    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))
    try:
        yield
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
