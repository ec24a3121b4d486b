"""An example custom operator: Kimi k1.5's length reward (Kimi Team 2025, section 2.3.3).

Within each prompt's group of responses, with lengths from min_len to max_len:

    lam = 0.5 - (len - min_len) / (max_len - min_len)        (0 when all lengths are equal)
    length_reward = lam if the response is correct else min(0, lam)

and the training reward becomes reward + weight * length_reward: among correct answers the
shorter ones gain, and a long wrong answer loses a bit more, never a short wrong one.

Use it in a graph (the path is relative to the graph file):

    - {id: lenpen, op: custom, impl: ops/length_penalty.py:KimiLengthPenalty,
       inputs: [overlong], params: {weight: 0.1}}

or as an ablation: `dapo-flow sweep graphs/ablations/length-penalty.yaml`. A custom operator is
a class with a frozen pydantic `Params`, the Arrow columns it reads (`REQUIRES`) and writes
(`PRODUCES`), `CARDINALITY` ("map": one row out per row in), `NEEDS_MODEL`, and a call from
an Arrow table to an Arrow table; `last_metrics()` (optional) goes to MLflow every step.
"""

from __future__ import annotations

import polars as pl
import pyarrow as pa
from pydantic import BaseModel, Field

from dapo_flow.core import columns as C
from dapo_flow.core.contract import PARAMS_CONFIG


class Params(BaseModel):
    model_config = PARAMS_CONFIG

    weight: float = Field(0.1, ge=0.0, le=10.0)
    """Scale of the length reward added to `reward` (Kimi k1.5 adds it with weight 1 to a 0/1
    reward; with DAPO's +-1 rewards, 0.1 keeps it a tie-breaker)."""


class KimiLengthPenalty:
    """reward += weight * Kimi's group-relative length reward; also writes length_reward."""

    Params = Params
    REQUIRES = C.typed(C.PROMPT_ID, C.RESPONSE_LEN, C.ACC, C.REWARD)
    PRODUCES = {"length_reward": pa.float32(), C.REWARD: C.SCHEMA[C.REWARD]}
    CARDINALITY = "map"
    NEEDS_MODEL = False

    def __init__(self, params: Params, ctx) -> None:
        self.params = params
        self._metrics: dict[str, float] = {}

    def __call__(self, batch: pa.Table) -> pa.Table:
        df = pl.from_arrow(batch.select([C.PROMPT_ID, C.RESPONSE_LEN, C.ACC, C.REWARD]))
        span = pl.col(C.RESPONSE_LEN).cast(pl.Float64)
        lo, hi = span.min().over(C.PROMPT_ID), span.max().over(C.PROMPT_ID)
        lam = pl.when(hi > lo).then(0.5 - (span - lo) / (hi - lo)).otherwise(0.0)
        out = df.select(
            length_reward=pl.when(pl.col(C.ACC) > 0).then(lam).otherwise(pl.min_horizontal(lam, 0.0)))
        length_reward = out["length_reward"].cast(pl.Float32).to_numpy()
        reward = (df[C.REWARD].to_numpy() + self.params.weight * length_reward).astype("float32")
        self._metrics = {"lenpen/mean": float(length_reward.mean()) if len(length_reward) else 0.0}
        batch = batch.set_column(batch.schema.get_field_index(C.REWARD), C.REWARD,
                                 pa.array(reward, C.SCHEMA[C.REWARD]))
        return batch.append_column("length_reward", pa.array(length_reward, pa.float32()))

    def last_metrics(self) -> dict[str, float]:
        return dict(self._metrics)
