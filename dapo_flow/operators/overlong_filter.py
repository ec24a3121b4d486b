"""overlong-filter: DAPO's overlong filtering (Yu et al. 2025, sec. 3.4), as a graph node.

Truncated responses (max tokens reached without EOS) get `loss_mask` 0 on every token: they
still count in group statistics and sequence-level advantages (GRPO and its family), but
contribute no loss (token-level estimators, GAE and REINFORCE++, skip their tokens as they skip
a tool's). `update` reads `loss_mask` when an
upstream node produces it. Same effect as `update`'s `mask_truncated: true` (and TRL's
`mask_truncated_completions`); the node form makes it an `--insert`/`--drop` ablation.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from pydantic import BaseModel

from dapo_flow.core import columns as C
from dapo_flow.data.arrow_utils import padded_to_ragged, response_mask, with_columns
from dapo_flow.core.contract import OpContext, PARAMS_CONFIG


class Params(BaseModel):
    model_config = PARAMS_CONFIG


class OverlongFilter:
    """Adds loss_mask: 0 on every token of a truncated row, else an upstream loss_mask's flags (all 1
    without one)."""

    Params = Params
    REQUIRES = C.typed(C.TRUNCATED, C.RESPONSE_LEN)
    PRODUCES = C.typed(C.LOSS_MASK)
    CARDINALITY = "map"
    NEEDS_MODEL = False
    ROLE = "transform"

    def __init__(self, params: Params, ctx: OpContext):
        self.params = params
        self._metrics: dict[str, float] = {}

    def __call__(self, batch: pa.Table) -> pa.Table:
        keep = ~batch.column(C.TRUNCATED).to_numpy(zero_copy_only=False).astype(bool)
        lengths = batch.column(C.RESPONSE_LEN).to_numpy()
        width = int(lengths.max()) if len(lengths) else 0
        # token flags: an upstream loss_mask's (another filter, or a multi-turn response's tool
        # tokens), all 0 on a truncated row
        flags = response_mask(batch, lengths, width) & keep[:, None]
        self._metrics = {"overlong_filter/masked_frac": float((~keep).mean()) if len(keep) else 0.0}
        return with_columns(batch, {C.LOSS_MASK: padded_to_ragged(flags.astype(np.int8), lengths, C.TOKEN_FLAGS)})

    def last_metrics(self) -> dict[str, float]:
        return dict(self._metrics)
