"""advantage: outcome advantages per sequence (GRPO, Dr.GRPO, RLOO, REINFORCE++-baseline,
GRPO pass@k, OPO).

GRPO: (r - group mean) / (unbiased group std + 1e-6), or r - mean with
`norm_by_std: false` (Dr.GRPO). Groups are prompt ids by value. The per-sequence value
is broadcast over the response tokens by `update`, exactly as verl's token-level form.
The reward read is `reward` (after overlong shaping) when an upstream node makes it, else the
raw `score`, so dropping the shaping node is a one-flag ablation.
"""

from __future__ import annotations

from typing import Literal

import pyarrow as pa
from pydantic import BaseModel

from dapo_flow import algos
from dapo_flow.graph import columns as C
from dapo_flow.data.arrow_utils import float_column, group_codes, with_columns
from dapo_flow.graph.contract import OpContext, PARAMS_CONFIG


class Params(BaseModel):
    model_config = PARAMS_CONFIG

    estimator: Literal["grpo", "rloo", "reinforce_pp_baseline", "grpo_passk", "opo"] = "grpo"
    """Outcome advantage estimator (`grpo_passk`: only each group's best gets the gap to the
    runner-up, needs n >= 2; `opo`: length-weighted group baseline)."""
    norm_by_std: bool = True
    """grpo / grpo_passk: divide by the group std (false = Dr.GRPO)."""
    reward_column: Literal["auto", "reward", "score"] = "auto"
    """Sequence reward to use: `reward` (after overlong shaping), the raw `score`, or `auto`:
    `reward` when an upstream node produces it, else `score` (resolved when the graph compiles)."""


class Advantage:
    """Adds one advantage per sequence."""

    Params = Params
    PRODUCES = C.typed(C.ADVANTAGE)
    CARDINALITY = "map"
    NEEDS_MODEL = False
    ROLE = "advantage"

    @classmethod
    def resolve(cls, params: Params, available: dict[str, pa.DataType]) -> Params:
        return params.model_copy(update={"reward_column": C.reward_source(params.reward_column, available)})

    @classmethod
    def requires(cls, params: Params) -> dict[str, pa.DataType]:
        return C.typed(C.PROMPT_ID, C.RESPONSE_LEN, C.reward_source(params.reward_column))

    def __init__(self, params: Params, ctx: OpContext):
        self.params = params
        self._metrics: dict[str, float] = {}

    def __call__(self, batch: pa.Table) -> pa.Table:
        p = self.params
        adv = algos.sequence_advantages(
            float_column(batch, C.reward_source(p.reward_column)),
            group_codes(batch.column(C.PROMPT_ID)),
            p.estimator,
            norm_by_std=p.norm_by_std,
            lengths=batch.column(C.RESPONSE_LEN).to_numpy(),
        )
        if len(adv):
            self._metrics = {
                "adv/mean": float(adv.mean()),
                "adv/abs_mean": float(abs(adv).mean()),
                "adv/max": float(adv.max()),
                "adv/min": float(adv.min()),
            }
        return with_columns(batch, {C.ADVANTAGE: adv})

    def last_metrics(self) -> dict[str, float]:
        return dict(self._metrics)

