"""Masked statistics with verl_F semantics, NaN-safe: masked positions never reach a value or
a gradient."""

from __future__ import annotations

import torch
from torch import Tensor

from dapo_flow.algos.errors import AlgoError

_MEAN_EPS = 1e-8  # verl_F.masked_mean denominator epsilon
_WHITEN_EPS = 1e-8  # verl_F.masked_whiten: rsqrt(var + 1e-8)


def _check_pair(x: Tensor, mask: Tensor, x_name: str = "x", mask_name: str = "mask") -> None:
    if x.shape != mask.shape:
        raise AlgoError(f"{x_name} shape {tuple(x.shape)} != {mask_name} shape {tuple(mask.shape)}")
    if x.dim() != 2:
        raise AlgoError(f"{x_name} must be 2-D (batch, resp_len), got shape {tuple(x.shape)}")


def _as_bool(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def _masked(x: Tensor, mask: Tensor) -> Tensor:
    """x at valid positions, 0 elsewhere; NaN/inf at masked positions cannot leak (verl_F.masked_sum
    keeps float-mask weights too)."""
    kept = torch.where(_as_bool(mask), x, x.new_zeros(()))
    return kept * mask if mask.is_floating_point() else kept


def _row_counts(mask: Tensor) -> Tensor:
    """Valid tokens per row. Shape: (batch, T) -> (batch,) int32 (bool sums to int64 are slow)."""
    if mask.dtype == torch.bool:
        return mask.view(torch.uint8).sum(dim=-1, dtype=torch.int32)
    return (mask != 0).view(torch.uint8).sum(dim=-1, dtype=torch.int32)


def _mask_count(mask: Tensor, dim: int | None = None) -> Tensor:
    """verl's ``mask.sum(axis)`` (float masks keep their weights)."""
    if mask.is_floating_point():
        return mask.sum() if dim is None else mask.sum(dim=dim)
    return torch.count_nonzero(mask) if dim is None else torch.count_nonzero(mask, dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """verl_F.masked_mean: sum(x * mask) / (mask.sum() + 1e-8), NaN-safe at masked positions.
    Shape: x, mask (...) -> scalar, or x reduced over `dim`."""
    if x.shape != mask.shape:
        raise AlgoError(f"x shape {tuple(x.shape)} != mask shape {tuple(mask.shape)}")
    total = _masked(x, mask).sum() if dim is None else _masked(x, mask).sum(dim=dim)
    return total / (_mask_count(mask, dim) + _MEAN_EPS)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """verl_F.masked_whiten: (x - mean) * rsqrt(var_unbiased + 1e-8) over valid positions.

    var is the masked variance times n / (n - 1) (Bessel). Values at masked positions are
    computed but meaningless; callers mask them. Raises for fewer than 2 valid positions.
    Shape: (...) -> (...).
    """
    n = float(_mask_count(mask))
    if n < 2:
        raise AlgoError(f"masked_whiten needs at least 2 valid positions, got {n:g}")
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask) * (n / (n - 1))
    whitened = (x - mean) * torch.rsqrt(var + _WHITEN_EPS)
    return whitened + mean if not shift_mean else whitened


