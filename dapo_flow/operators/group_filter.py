"""group-filter: DAPO dynamic sampling — drop prompt groups whose metric has zero spread.

A group is kept unless all its values are exactly equal (singletons are kept); kept rows
keep their order. The runtime repeats the rollout segment upstream of this node until
`run.prompts_per_step` groups are kept, at most `max_gen_batches` times, then follows
`on_cap`; `max_skipped_steps` steps in a row that train nothing stop the run.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, Field

from dapo_flow import algos
from dapo_flow.core import columns as C
from dapo_flow.data.arrow_utils import group_codes
from dapo_flow.core.contract import GroupSettings, OpContext, PARAMS_CONFIG
from dapo_flow.reductions import Total

# verl's metric names map onto our columns
METRIC_COLUMNS = {
    "acc": C.ACC,
    "score": C.SCORE,
    "seq_reward": C.SCORE,
    "reward": C.REWARD,
    "seq_final_reward": C.REWARD,
}


class Params(BaseModel):
    model_config = PARAMS_CONFIG

    metric: Literal["acc", "score", "seq_reward", "reward", "seq_final_reward"] = "acc"
    """Per-sequence value whose spread decides (verl recipe default: acc)."""
    max_gen_batches: int = Field(10, ge=0, le=10_000)
    """Generation batches allowed per step before `on_cap` applies (0 = unlimited)."""
    on_cap: Literal["error", "train-on-what-we-have", "skip-step"] = "error"
    """What to do when the cap is reached with too few kept groups."""
    max_skipped_steps: int = Field(5, ge=0, le=1_000_000)
    """Stop the run after this many steps in a row that train nothing (skipped under `on_cap`, or
    no group kept at all); with max_gen_batches 0, after this many generation batches in a row
    that keep no group. 0 never stops."""


class GroupFilter:
    """Keeps whole prompt groups whose metric values differ."""

    Params = Params
    CARDINALITY = "group-filter"
    NEEDS_MODEL = False
    ROLE = "transform"

    @classmethod
    def group_settings(cls, params: Params) -> GroupSettings:
        return GroupSettings(params.metric, params.max_gen_batches, params.on_cap, params.max_skipped_steps)
    PRODUCES: dict[str, pa.DataType] = {}

    @classmethod
    def requires(cls, params: Params) -> dict[str, pa.DataType]:
        return C.typed(C.PROMPT_ID, METRIC_COLUMNS[params.metric])

    def __init__(self, params: Params, ctx: OpContext):
        self.params = params
        self.column = METRIC_COLUMNS[params.metric]
        self._metrics: dict[str, float] = {}

    def __call__(self, batch: pa.Table) -> pa.Table:
        # factorize the string ids once; keep_groups and the counts reuse the codes
        groups = group_codes(batch.column(C.PROMPT_ID))
        keep = algos.keep_groups(groups, batch.column(self.column).to_numpy())
        kept = int(np.count_nonzero(np.bincount(groups.codes[keep], minlength=groups.n_groups)))
        self._metrics = {"filter/kept_groups": Total(kept), "filter/dropped_groups": Total(groups.n_groups - kept)}
        return batch.filter(pa.array(keep))

    def last_metrics(self) -> dict[str, float]:
        return dict(self._metrics)
