"""Reward shaping per sequence: DAPO's soft overlong punishment."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from torch import Tensor

from dapo_flow.algos.errors import AlgoError
from dapo_flow.algos.groups import _as_numpy


def overlong_penalty(
    lengths: np.ndarray | Sequence[int] | Tensor, *, max_len: int, buffer_len: int, factor: float
) -> np.ndarray:
    """Soft overlong punishment (DAPO eq. 13, verl DAPORewardManager).

    penalty = min(-(L - (max_len - buffer_len)) / buffer_len * factor, 0), no lower clamp;
    L = valid response tokens (EOS included). Computed in float32 like verl's tensor math.
    Shape: (batch,) -> (batch,) float32.
    """
    lens = _as_numpy(lengths, "lengths")
    if buffer_len <= 0:
        raise AlgoError(f"buffer_len must be > 0, got {buffer_len}")
    if max_len < buffer_len:
        raise AlgoError(f"max_len ({max_len}) must be >= buffer_len ({buffer_len})")
    if factor < 0:
        raise AlgoError(f"factor must be >= 0, got {factor}")
    if lens.size and lens.min() < 0:
        raise AlgoError("lengths must be >= 0")
    exceed = lens.astype(np.int64) - (max_len - buffer_len)
    # verl: int tensor / int -> float32, * python float -> float32
    penalty = (-exceed).astype(np.float32) / np.float32(buffer_len) * np.float32(factor)
    return np.minimum(penalty, np.float32(0.0))


