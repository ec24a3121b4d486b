"""advantage: outcome advantages (GRPO, Dr.GRPO, RLOO, REINFORCE++-baseline, GRPO pass@k, OPO
per sequence; REINFORCE++ per token; GAE per token over a critic's values, with its returns; ReMax
per token against a baseline reward; on-policy distillation per token, alone or added).

GRPO: (r - group mean) / (unbiased group std + 1e-6), or r - mean with
`norm_by_std: false` (Dr.GRPO). Groups are prompt ids by value. A per-sequence value
(`advantage`) is broadcast over the response tokens by `update`, exactly as verl's token-level
form; a token-level estimator (`reinforce_pp`) emits `token_advantage` instead, which `update`
trains on as it is. The choices are algos.ESTIMATORS (one table: adding an estimator there adds
it here). The reward read is `reward` (after overlong shaping) when an upstream node makes it,
else the raw `score`, so dropping the shaping node is a one-flag ablation.

On-policy distillation (Thinking Machines 2025; algos.distill): `distill_coef` > 0 adds
coef x (teacher_logp - old_logp) to each sampled token's advantage, the negative per-token
reverse KL to a frozen teacher (a `logprob` node with role teacher), so the advantage becomes
per token. `estimator: distill` is that term alone: no reward read, so training needs no
`score` or `group-filter` node (validation still grades with the graph's `score`).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import pyarrow as pa
import torch
from pydantic import BaseModel, Field, field_validator, model_validator

from dapo_flow import algos
from dapo_flow.data.arrow_utils import (float_column, group_codes, padded_to_ragged, ragged_to_padded,
                                       response_mask, with_columns)
from dapo_flow.core import columns as C
from dapo_flow.core.contract import PARAMS_CONFIG, OpContext, registered
from dapo_flow.reductions import Max, Min

class Params(BaseModel):
    model_config = PARAMS_CONFIG

    estimator: str = Field("grpo", description="Advantage estimator, a key of algos.ESTIMATORS: " + "; ".join(
        f"`{name}`: {e.doc}" for name, e in algos.ESTIMATORS.items()) + ".")
    norm_by_std: bool = True
    """grpo / grpo_passk: divide by the group std (false = Dr.GRPO)."""
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """reinforce_pp, gae: discount per valid token (verl algorithm.gamma)."""
    lam: float = Field(1.0, ge=0.0, le=1.0)
    """gae: the GAE lambda (verl algorithm.lam; 1: advantages are returns minus values)."""
    reward_column: Literal["auto", "reward", "score"] = "auto"
    """Sequence reward to use: `reward` (after overlong shaping), the raw `score`, or `auto`:
    `reward` when an upstream node produces it, else `score` (resolved when the graph compiles)."""
    distill_coef: float = Field(0.0, ge=0.0, le=1000.0)
    """On-policy distillation: > 0 adds distill_coef x (teacher_logp - old_logp) per sampled token
    (reads both; teacher_logp from a `logprob` node with role teacher). Required > 0 by estimator
    distill (distillation alone); with another estimator it is RL + distillation."""
    distill_clip: float | None = Field(None, gt=0.0, le=1000.0)
    """Clamp each token's distillation advantage to [-distill_clip, distill_clip] (None: as is);
    a sharp teacher's near-zero probabilities otherwise give advantages of -20 nats and more."""

    @field_validator("estimator")
    @classmethod
    def _known_estimator(cls, value: str) -> str:
        return registered(value, algos.ESTIMATORS)  # the table, read at validation: plugins may add

    @model_validator(mode="after")
    def _distill_has_a_weight(self) -> "Params":
        if not algos.ESTIMATORS[self.estimator].needs_reward and self.distill_coef == 0:
            raise ValueError(f"estimator {self.estimator} has no outcome advantage: its signal is the teacher, "
                             "weighted by distill_coef, which is 0; set distill_coef: 1.0")
        return self


class Advantage:
    """Adds one advantage per sequence."""

    Params = Params
    CARDINALITY = "map"
    NEEDS_MODEL = False
    ROLE = "advantage"

    @classmethod
    def scope(cls, params: Params) -> str:
        """`group` for a per-sequence estimator that reads only each prompt group's rewards (grpo,
        rloo, ...: computed on any share of whole groups alike), else `batch`."""
        estimator = algos.ESTIMATORS[params.estimator]
        per_sequence = estimator.sequence is not None and params.distill_coef == 0
        return estimator.scope if per_sequence else "batch"

    @classmethod
    def resolve(cls, params: Params, available: dict[str, pa.DataType]) -> Params:
        return params.model_copy(update={"reward_column": C.reward_source(params.reward_column, available)})

    @classmethod
    def requires(cls, params: Params) -> dict[str, pa.DataType]:
        estimator = algos.ESTIMATORS[params.estimator]
        cols = [C.PROMPT_ID, C.RESPONSE_LEN]
        cols += [C.reward_source(params.reward_column)] if estimator.needs_reward else []
        cols += [estimator.reads] if estimator.reads else []
        cols += [C.OLD_LOGP, C.TEACHER_LOGP] if params.distill_coef > 0 else []
        return C.typed(*cols)

    @classmethod
    def produces(cls, params: Params) -> dict[str, pa.DataType]:
        estimator = algos.ESTIMATORS[params.estimator]
        if estimator.with_input is not None:  # a critic's: its targets too
            return C.typed(C.TOKEN_ADVANTAGE, C.RETURNS)
        per_sequence = estimator.sequence is not None and params.distill_coef == 0
        return C.typed(C.ADVANTAGE if per_sequence else C.TOKEN_ADVANTAGE)

    def __init__(self, params: Params, ctx: OpContext):
        self.params = params
        self._metrics: dict[str, float] = {}

    def __call__(self, batch: pa.Table) -> pa.Table:
        p = self.params
        estimator = algos.ESTIMATORS[p.estimator]
        lengths = batch.column(C.RESPONSE_LEN).to_numpy()
        rewards = (float_column(batch, C.reward_source(p.reward_column)) if estimator.needs_reward
                   else np.zeros(len(lengths), dtype=np.float32))
        if estimator.sequence is None or p.distill_coef > 0:
            return self._token_level(batch, rewards, lengths)
        adv = algos.sequence_advantages(
            rewards, group_codes(batch.column(C.PROMPT_ID)), p.estimator, norm_by_std=p.norm_by_std,
            lengths=lengths,
        )
        self._record(adv)
        return with_columns(batch, {C.ADVANTAGE: adv})

    def _token_level(self, batch: pa.Table, rewards: np.ndarray, lengths: np.ndarray) -> pa.Table:
        """A token-level estimator (REINFORCE++: returns-to-go whitened over every valid token of
        the batch; GAE over the critic's values, which also gives the critic's returns) on token
        rewards = each sequence's reward on its last response token.
        Shape: rewards, lengths (batch,) -> (batch, ragged)."""
        width = int(lengths.max()) if len(lengths) else 0
        # a loss_mask's 0 tokens (a tool's, in a multi-turn response) are skipped, carried through
        valid = torch.from_numpy(response_mask(batch, lengths, width))
        token_rewards = torch.zeros(len(lengths), width, dtype=torch.float32)
        rows = np.flatnonzero(lengths > 0)
        token_rewards[rows, lengths[rows] - 1] = torch.from_numpy(rewards[rows].astype(np.float32))
        p = self.params
        estimator = algos.ESTIMATORS[p.estimator]
        out = {}
        if estimator.sequence is not None:  # broadcast over the valid tokens, as `update` would
            seq = algos.sequence_advantages(rewards, group_codes(batch.column(C.PROMPT_ID)), p.estimator,
                                            norm_by_std=p.norm_by_std, lengths=lengths)
            adv = torch.where(valid, torch.from_numpy(seq)[:, None], 0.0)
        elif estimator.with_input is not None:
            column = batch.column(estimator.reads)
            if pa.types.is_list(column.type):  # per token (a critic's values)
                extra = torch.from_numpy(ragged_to_padded(column, dtype=np.float32)[0][:, :width])
            else:  # per sequence (a baseline reward)
                extra = torch.from_numpy(float_column(batch, estimator.reads).astype(np.float32))
            adv, returns = estimator.with_input(token_rewards, extra, valid, p.gamma, p.lam)
            out[C.RETURNS] = padded_to_ragged(returns.numpy(), lengths, C.TOKEN_FLOATS)
        else:
            adv, _ = estimator.token(token_rewards, valid, p.gamma)
        distill = {}
        if p.distill_coef > 0:
            student, teacher = (torch.from_numpy(ragged_to_padded(batch.column(c), dtype=np.float32)[0][:, :width])
                                for c in (C.OLD_LOGP, C.TEACHER_LOGP))
            adv = adv + p.distill_coef * algos.distill_advantages(student, teacher, valid, p.distill_clip)
            distill = {"distill/reverse_kl": algos.reverse_kl_per_token(student, teacher, valid)}
        self._record(adv[valid].numpy())
        self._metrics.update(distill)
        return with_columns(batch, {C.TOKEN_ADVANTAGE: padded_to_ragged(adv.numpy(), lengths, C.TOKEN_FLOATS), **out})

    def _record(self, adv: np.ndarray) -> None:
        if len(adv):
            self._metrics = {
                "adv/mean": float(adv.mean()),
                "adv/abs_mean": float(abs(adv).mean()),
                "adv/max": Max(adv.max()),  # the extremes over a training group's shares too
                "adv/min": Min(adv.min()),
            }

    def last_metrics(self) -> dict[str, float]:
        return dict(self._metrics)

