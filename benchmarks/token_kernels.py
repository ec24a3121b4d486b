"""Fused CPU kernels for the token-level passes torch cannot do in one sweep (numba, in
:mod:`_token_kernels_numba`, imported on first use).

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
import mmap
from collections.abc import Iterator
from types import ModuleType

import numpy as np
import torch
from torch import Tensor

from dapo_flow import threads

_OUT_DTYPES = (torch.float32, torch.float64)
#: Smallest output (elements) the kernels take. Below it torch's slower loop still costs less
#: than numba's per-call overhead (~0.1-0.2 ms) and first-use import (~0.5 s), so training-sized
#: batches never load numba.
MIN_ELEMENTS = 1 << 18


#: Outputs from this size (bytes) get their own huge-page mapping (:func:`new_output`): glibc
#: maps blocks this large afresh on every allocation (its mmap threshold tops out at 32 MiB),
#: smaller ones it recycles, already faulted in, and those stay on torch's allocator.
FRESH_MAP_MIN_BYTES = 32 << 20


def new_output(like: Tensor) -> tuple[Tensor, bool]:
    """``(torch.empty_like(like) (contiguous), zeroed)``; large CPU outputs on Linux come from
    their own anonymous mapping, advised to use transparent huge pages (THP "madvise" mode, the
    default), and are then all +0.0 (``zeroed``), which the kernels use to skip storing zeros.

    A fresh large tensor's first write pays a page fault per 4 KiB page: for a 67 MB float32
    output ~8 ms on top of the ~4.5 ms the write itself takes; with 2 MiB pages ~3 ms. The
    mapping lives as long as the tensor. Advice only: where THP is off the tensor is the same,
    just slower to fill. Shape: like's.
    """
    nbytes = like.numel() * like.element_size()
    if like.device.type != "cpu" or nbytes < FRESH_MAP_MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty_like(like, memory_format=torch.contiguous_format), False
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buf, dtype=like.dtype).view(like.shape), True  # holds `buf` alive


@functools.cache
def _kernels() -> ModuleType | None:
    threads.prefer_numba_layer()  # before numba's first launch fixes its layer
    try:
        import _token_kernels_numba as _kernels_numba
    except ImportError:  # pragma: no cover - numba is a dependency; keep the torch path anyway
        return None
    return _kernels_numba


def masked_broadcast(values: Tensor, mask: Tensor, out: Tensor, zeroed: bool = False) -> Tensor | None:
    """``out[i, t] = values[i]`` where ``mask[i, t]`` (bool), or ``values[i] * mask[i, t]``
    (float mask of ``out``'s dtype), in one pass; None if this input needs the torch path.
    ``zeroed``: ``out`` is all +0.0 already (:func:`new_output`), zeros are not stored again.

    Shape: values (batch,), mask (batch, T), out (batch, T) -> out.
    """
    k = _kernels() if _takes(mask, out) else None
    if k is None:
        return None
    v = values.detach().to(device="cpu", dtype=out.dtype).contiguous().numpy()
    with _torch_thread_budget():
        k.broadcast_rows(mask.detach().numpy(), mask.dtype == torch.bool, v, out.detach().numpy(), zeroed)
    return out


def grpo_token_advantages(
    rewards: Tensor, mask: Tensor, codes: np.ndarray, n_groups: int, norm_by_std: bool, eps: float, out: Tensor,
    zeroed: bool = False,
) -> bool | None:
    """GRPO (or Dr.GRPO) token advantages: the row sums of ``rewards`` (in its dtype, as verl),
    per-group mean and unbiased std (float64; lone rows: mean 0, std 1; constant groups: exactly
    0), then ``out`` rows masked like :func:`masked_broadcast`. One sweep when groups are
    contiguous, else two (row sums, then the write). Returns whether every score was finite
    (False: ``out`` holds garbage), or None if this input needs the torch path. ``zeroed`` as
    in :func:`masked_broadcast`.

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
            return bool(k.grpo_runs(r, m, select, starts, norm_by_std, eps, o, zeroed))
        scores = np.empty(r.shape[0], r.dtype)
        adv = np.empty_like(scores)
        k.row_sums(r, scores)
        if not k.grpo_scattered(scores, codes, n_groups, norm_by_std, eps, adv):
            return False
        k.broadcast_rows(m, select, adv, o, zeroed)
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
    """Run kernels on as many threads as torch has (the process's budget, :mod:`dapo_flow.threads`).

    numba's workqueue layer (:func:`threads.prefer_numba_layer`) leaves libgomp alone. If another
    library launched numba's OpenMP layer first, that layer shares libgomp with torch: it resets
    the thread count (a process at 1 torch thread came back at 2) and turns nesting on, so both
    are put back after.
    """
    import numba

    count = torch.get_num_threads()
    numba.set_num_threads(max(1, min(count, numba.config.NUMBA_NUM_THREADS)))
    try:
        yield
    finally:
        if torch.get_num_threads() != count:
            threads.set_torch_threads(count)
        if threads.numba_on_openmp():
            threads.openmp_nesting_off()
