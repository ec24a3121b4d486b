"""values: a critic's value of every response token's state (PPO's V(s_t), for GAE).

The model is a value model (`head: value`: one output per token, models/heads.py). V_t is read
at the position before token t, the context token t was sampled from, as verl's critic
(``compute_values``) reads ``values[:, -R-1:-1]``. No gradient: these are the old values GAE
bootstraps from and the critic's value clip is centred on.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, Field

from dapo_flow.data.arrow_utils import padded_to_ragged, token_lists, with_columns
from dapo_flow.core import columns as C
from dapo_flow.core.contract import OpContext, PARAMS_CONFIG


class Params(BaseModel):
    model_config = PARAMS_CONFIG

    micro_batch_size: int = Field(64, ge=1, le=65536)
    """Rows per forward pass."""


class Values:
    """Adds per-token values of the responses (a critic's forward pass)."""

    Params = Params
    CARDINALITY = "map"
    NEEDS_MODEL = True
    MODEL_HEAD = "value"
    ROLE = "logprob"  # reads its model's per-token outputs with the torch model

    @classmethod
    def forward_rows(cls, params: Params) -> int:
        return params.micro_batch_size
    REQUIRES = C.typed(C.PROMPT_IDS, C.RESPONSE_IDS)
    PRODUCES = C.typed(C.VALUES)

    def __init__(self, params: Params, ctx: OpContext):
        self.params = params
        self.ctx = ctx
        self._metrics: dict[str, float] = {}

    def __call__(self, batch: pa.Table) -> pa.Table:
        values, mask = self.ctx.model.policy.response_values(
            token_lists(batch.column(C.PROMPT_IDS)), token_lists(batch.column(C.RESPONSE_IDS)),
            micro_batch_size=self.params.micro_batch_size,
        )
        valid = mask.numpy()
        flat = values.numpy()[valid]
        self._metrics = {"critic/values_mean": float(flat.mean())} if flat.size else {}
        lengths = valid.sum(axis=1)
        return with_columns(batch, {C.VALUES: padded_to_ragged(values.numpy().astype(np.float32), lengths,
                                                               C.TOKEN_FLOATS)})

    def last_metrics(self) -> dict[str, float]:
        return dict(self._metrics)
