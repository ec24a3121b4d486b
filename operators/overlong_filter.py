"""overlong-filter: DAPO's overlong filtering (Yu et al. 2025, sec. 3.4), as a graph node.

Truncated responses (max tokens reached without EOS) get `loss_mask` false: they still count
in group statistics and advantages, but contribute no loss. `update` reads `loss_mask` when an
upstream node produces it. Same effect as `update`'s `mask_truncated: true` (and TRL's
`mask_truncated_completions`); the node form makes it an `--insert`/`--drop` ablation.
"""

from __future__ import annotations

import pyarrow as pa
from pydantic import BaseModel

from dapo_flow.graph import columns as C
from dapo_flow.data.arrow_utils import with_columns
from dapo_flow.graph.contract import OpContext, PARAMS_CONFIG


class Params(BaseModel):
    model_config = PARAMS_CONFIG


class OverlongFilter:
    """Adds loss_mask = not truncated (and-ed with an upstream loss_mask, if any)."""

    Params = Params
    REQUIRES = C.typed(C.TRUNCATED)
    PRODUCES = C.typed(C.LOSS_MASK)
    CARDINALITY = "map"
    NEEDS_MODEL = False
    ROLE = "transform"

    def __init__(self, params: Params, ctx: OpContext):
        self.params = params
        self._metrics: dict[str, float] = {}

    def __call__(self, batch: pa.Table) -> pa.Table:
        keep = ~batch.column(C.TRUNCATED).to_numpy(zero_copy_only=False).astype(bool)
        if C.LOSS_MASK in batch.column_names:  # another filter upstream: both must pass
            keep &= batch.column(C.LOSS_MASK).to_numpy(zero_copy_only=False).astype(bool)
        self._metrics = {"overlong_filter/masked_frac": float((~keep).mean()) if len(keep) else 0.0}
        return with_columns(batch, {C.LOSS_MASK: keep})

    def last_metrics(self) -> dict[str, float]:
        return dict(self._metrics)
