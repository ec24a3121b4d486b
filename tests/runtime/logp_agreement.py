"""check-logp: a custom CPU operator for runtime tests, placed after `old_logp`.

It measures how far the rollout engine's sampled-token logprobs (`rollout_logp`) are from the
trainer's recomputation of the same tokens (`old_logp`). Both come from the same weights only
if the last update's weights really reached the engine (weight sync), so the gap is ~1e-6
when sync works and large after any update when it does not.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict

from dapo_flow.core import columns as C

METRIC = "check/logp_max_abs_diff"


class Params(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class CheckLogp:
    """Passes the batch through; `last_metrics()` reports max |rollout_logp - old_logp|."""

    Params = Params
    REQUIRES = C.typed(C.ROLLOUT_LOGP, C.OLD_LOGP)
    PRODUCES: dict[str, pa.DataType] = {}
    CARDINALITY = "map"
    NEEDS_MODEL = False

    def __init__(self, params: Params, ctx) -> None:
        self.params = params
        self._metrics: dict[str, float] = {}

    def __call__(self, batch: pa.Table) -> pa.Table:
        rollout = _flat(batch.column(C.ROLLOUT_LOGP))  # Shape: (total response tokens,)
        old = _flat(batch.column(C.OLD_LOGP))
        assert rollout.shape == old.shape, (rollout.shape, old.shape)
        self._metrics = {METRIC: float(np.abs(rollout - old).max()) if old.size else 0.0}
        return batch

    def last_metrics(self) -> dict[str, float]:
        return dict(self._metrics)


def _flat(col: pa.ChunkedArray) -> np.ndarray:
    return pa.concat_arrays([c.flatten() for c in col.chunks]).to_numpy(zero_copy_only=False)
