"""kl: KL penalty in the reward (verl's `use_kl_in_reward`, PPO-style), against a frozen reference.

reward = reward_in - coef * sum over valid tokens of kl(old_logp, ref_logp). verl subtracts the
penalty per token; the outcome estimators sum a row's token rewards, so the per-sequence number
is the same. With `target_kl` set, coef adapts after every step as verl's AdaptiveKLController
(checkpointed with the run). For a KL *loss* term instead, set `update`'s `kl_coef`.
With GRPO, a group whose scores are all equal is no longer constant after the penalty: the std
normalisation turns its small KL differences into full-size advantages (verl does the same).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import pyarrow as pa
import torch
from pydantic import BaseModel, Field

from dapo_flow import algos
from dapo_flow.core import columns as C
from dapo_flow.data.arrow_utils import float_column, ragged_to_padded, response_mask, with_columns
from dapo_flow.core.contract import OpContext, PARAMS_CONFIG

KLType = Literal[algos.KL_BASE_KINDS]  # type: ignore[valid-type]


class Params(BaseModel):
    model_config = PARAMS_CONFIG

    kind: KLType = "kl"
    """Per-token KL estimator (verl's `kl_penalty`; its in-reward default is `kl` = logp - ref)."""
    coef: float = Field(0.001, ge=0.0, le=10.0)
    """Penalty coefficient (verl `kl_ctrl.kl_coef`); the starting value when `target_kl` is set."""
    target_kl: float | None = Field(None, gt=0.0)
    """Adaptive controller target (verl `kl_ctrl.type: adaptive`); null keeps `coef` fixed."""
    horizon: int = Field(10000, ge=1)
    """Adaptive controller horizon in samples: how fast coef moves (verl `kl_ctrl.horizon`)."""
    reward_column: Literal["auto", "reward", "score"] = "auto"
    """Reward to penalize: `reward` (after shaping), `score`, or `auto` (`reward` when an
    upstream node produces it, else `score`). The result is always written to `reward`."""


class KL:
    """Subtracts coef x the sequence's summed KL to the reference from its reward."""

    Params = Params
    PRODUCES = C.typed(C.REWARD, C.KL)
    CARDINALITY = "map"
    NEEDS_MODEL = False
    ROLE = "transform"

    @classmethod
    def resolve(cls, params: Params, available: dict[str, pa.DataType]) -> Params:
        return params.model_copy(update={"reward_column": C.reward_source(params.reward_column, available)})

    @classmethod
    def requires(cls, params: Params) -> dict[str, pa.DataType]:
        return C.typed(C.OLD_LOGP, C.REF_LOGP, C.reward_source(params.reward_column))

    def __init__(self, params: Params, ctx: OpContext):
        self.params = params
        self.coef = params.coef
        self._metrics: dict[str, float] = {}

    def state_dict(self) -> dict:
        return {"coef": self.coef}

    def load_state_dict(self, state: dict) -> None:
        self.coef = float(state["coef"])

    def __call__(self, batch: pa.Table) -> pa.Table:
        p = self.params
        source = C.reward_source(p.reward_column)
        logp, lengths = ragged_to_padded(batch.column(C.OLD_LOGP), dtype=np.float32)
        ref, ref_lengths = ragged_to_padded(batch.column(C.REF_LOGP), dtype=np.float32)
        if not np.array_equal(lengths, ref_lengths):
            raise algos.AlgoError("old_logp and ref_logp disagree on response lengths")
        mask = torch.from_numpy(response_mask(batch, lengths, logp.shape[1]))  # not a tool's tokens
        reward, kl, current = algos.kl_in_reward(
            float_column(batch, source), torch.from_numpy(logp), torch.from_numpy(ref), mask, p.kind, self.coef
        )
        self._metrics = {"kl/reward_penalty": current, "kl/coef": self.coef}
        if p.target_kl is not None and batch.num_rows:
            self.coef = algos.adaptive_kl_coef(
                self.coef, current, target_kl=p.target_kl, horizon=p.horizon, n_steps=batch.num_rows
            )
        return with_columns(batch, {C.REWARD: reward, C.KL: kl})

    def last_metrics(self) -> dict[str, float]:
        return dict(self._metrics)
