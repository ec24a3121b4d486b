"""baseline: each sample gets the reward of its prompt's baseline response, as `baseline`.

ReMax (Li et al. 2023; verl's `adv_estimator: remax`) baselines every sampled response with the
reward of one greedy response to the same prompt. In a graph that is a second `generate` (n: 1,
temperature 0) and its `score`; this node joins that scored row onto every sample of its prompt,
by `prompt_id` (not row by row, so it is the one node whose inputs may carry different rows):

    inputs: [verify, greedy_verify]     # the samples first, then one scored row per prompt

The estimator `remax` then trains on reward-to-go minus `baseline`. A prompt with no baseline row,
or with several, is a run error naming it.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import pyarrow as pa
from pydantic import BaseModel

from dapo_flow.data.arrow_utils import float_column, with_columns
from dapo_flow.errors import RunError
from dapo_flow.core import columns as C
from dapo_flow.core.contract import PARAMS_CONFIG, OpContext


class Params(BaseModel):
    model_config = PARAMS_CONFIG

    column: Literal["score", "reward"] = "score"
    """The baseline row's column that becomes `baseline`: the verifier's `score`, or `reward`
    when the baseline rows are shaped too (set it to what the advantage reads)."""


class Baseline:
    """Joins the second input's per-prompt reward onto the first input's samples."""

    Params = Params
    CARDINALITY = "map"
    NEEDS_MODEL = False
    ROLE = "transform"
    REQUIRES = C.typed(C.PROMPT_ID)
    PRODUCES = C.typed(C.BASELINE)
    INPUTS = "the samples, then one scored row per prompt (a generate with n: 1 and its score)"

    @classmethod
    def input_requires(cls, params: Params) -> tuple[dict[str, pa.DataType], ...]:
        """Columns each input must bring, in input order (the compiler checks each)."""
        return C.typed(C.PROMPT_ID), C.typed(C.PROMPT_ID, params.column)

    @classmethod
    def combine(cls, params: Params, tables: list[pa.Table]) -> pa.Table:
        """The samples (``tables[0]``) with `baseline` from ``tables[1]`` matched by prompt id;
        what this node's call receives instead of a row-by-row merge of its inputs."""
        samples, base = tables
        keys = base.column(C.PROMPT_ID).to_pylist()
        index = {k: i for i, k in enumerate(keys)}
        if len(index) != len(keys):
            twice = next(k for k in keys if keys.count(k) > 1)
            raise RunError(f"baseline: prompt {twice!r} has {keys.count(twice)} baseline rows; it needs one "
                           "per prompt: generate the baseline with n: 1")
        wanted = samples.column(C.PROMPT_ID).to_pylist()
        missing = [k for k in wanted if k not in index]
        if missing:
            raise RunError(f"baseline: prompt {missing[0]!r} has no baseline row: feed the baseline's "
                           "generate from `prompts`, as the samples' generate is")
        values = float_column(base, params.column)[np.fromiter((index[k] for k in wanted), np.int64, len(wanted))]
        return with_columns(samples, {C.BASELINE: pa.array(values, pa.float32())})

    def __init__(self, params: Params, ctx: OpContext):
        self.params = params
        self._metrics: dict[str, float] = {}

    def __call__(self, batch: pa.Table) -> pa.Table:
        values = float_column(batch, C.BASELINE)
        self._metrics = {"baseline/mean": float(values.mean())} if len(values) else {}
        return batch

    def last_metrics(self) -> dict[str, float]:
        return dict(self._metrics)
