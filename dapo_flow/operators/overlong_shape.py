"""overlong-shape: DAPO soft overlong punishment (Yu et al. 2025, eq. 13).

penalty = min(-(L - (max_len - buffer_len)) / buffer_len * factor, 0) with L the valid
response length (EOS included); reward = score + penalty, correct or not. The reward is
one value per sequence; `update` places it on the last valid token as verl does.
"""

from __future__ import annotations

import pyarrow as pa
from pydantic import BaseModel, Field, model_validator

from dapo_flow import algos
from dapo_flow.core import columns as C
from dapo_flow.data.arrow_utils import float_column, with_columns
from dapo_flow.core.contract import OpContext, PARAMS_CONFIG


class Params(BaseModel):
    model_config = PARAMS_CONFIG

    max_len: int = Field(16, ge=1)
    """Maximum response length (set it to generate's max_tokens)."""
    buffer_len: int = Field(4, ge=1)
    """Length of the punishment interval before max_len (DAPO: 4096)."""
    factor: float = Field(1.0, ge=0.0, le=100.0)
    """Penalty at max_len (DAPO: 1.0)."""

    @model_validator(mode="after")
    def _buffer_fits(self) -> "Params":
        if self.buffer_len > self.max_len:
            raise ValueError(f"buffer_len ({self.buffer_len}) must be <= max_len ({self.max_len})")
        return self


class OverlongShape:
    """Adds overlong_penalty and reward = score + penalty."""

    Params = Params
    REQUIRES = C.typed(C.SCORE, C.RESPONSE_LEN)
    PRODUCES = C.typed(C.OVERLONG_PENALTY, C.REWARD)
    CARDINALITY = "map"
    NEEDS_MODEL = False
    ROLE = "transform"
    SCOPE = "row"

    @classmethod
    def upstream_problems(cls, params: Params, generator_id: str, generator_params) -> list:
        """The penalty interval must end where the generator cuts responses."""
        limit = generator_params.max_tokens
        if params.max_len == limit:
            return []
        return [("max_len", f"max_len {params.max_len} differs from max_tokens {limit} of generate "
                 f"'{generator_id}'", f"set max_len: {limit} so the penalty interval ends at the response limit")]

    def __init__(self, params: Params, ctx: OpContext):
        self.params = params
        self._metrics: dict[str, float] = {}

    def __call__(self, batch: pa.Table) -> pa.Table:
        p = self.params
        lengths = batch.column(C.RESPONSE_LEN).to_numpy()
        penalty = algos.overlong_penalty(
            lengths, max_len=p.max_len, buffer_len=p.buffer_len, factor=p.factor
        )
        reward = float_column(batch, C.SCORE) + penalty
        self._metrics = {
            "overlong/penalty_mean": float(penalty.mean()) if len(penalty) else 0.0,
            "overlong/penalized_frac": float((penalty < 0).mean()) if len(penalty) else 0.0,
        }
        return with_columns(batch, {C.OVERLONG_PENALTY: penalty, C.REWARD: reward})

    def last_metrics(self) -> dict[str, float]:
        return dict(self._metrics)
