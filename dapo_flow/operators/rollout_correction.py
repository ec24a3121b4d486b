"""rollout-correction: correct the update for the policy that sampled differing from the one
trained (the rollout engine's numerics, or weights a few versions old under asynchronous
rollout), as verl's ``algorithm.rollout_correction`` does.

Per response token ``log_ratio = old_logp - rollout_logp``: the trainer's recomputed logprob
(a `logprob` node, `source: recompute`) against the engine's own for the token it sampled.

- ``rollout_is`` (`token` | `sequence`): adds ``rollout_is_weight``, which `update` multiplies
  each token's policy loss by: truncated IS (TIS, ``rollout_is_threshold: 2.0``) or IcePop
  (``"0.5_2.0"``: weights outside the bounds are 0), optionally normalized to mean 1.
- ``rollout_rs`` (comma separated ``token_k1``, ``seq_mean_k3``, ...): a hard trust region:
  tokens or whole sequences whose divergence estimate leaves ``rollout_rs_threshold`` get
  ``loss_mask`` 0 (kept with an upstream loss_mask's zeros).

The math is :func:`dapo_flow.algos.rollout_correction_weights` and
:func:`dapo_flow.algos.rollout_rejection_mask` (verl's semantics and metric names, logged under
``rollout_corr/``), with the mismatch itself: ``rollout_corr/log_ratio_mean`` and the k1 and k3
estimates of KL(rollout || trainer). The third mode of verl's, bypass (the rollout logprobs as
the old policy), is `logprob`'s ``source: rollout``; with it this node would see ratios of 1.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import pyarrow as pa
import torch
from pydantic import BaseModel, model_validator

from dapo_flow import algos
from dapo_flow.data.arrow_utils import padded_to_ragged, ragged_to_padded, response_mask, with_columns
from dapo_flow.core import columns as C
from dapo_flow.core.contract import PARAMS_CONFIG, OpContext


class Params(BaseModel):
    model_config = PARAMS_CONFIG

    rollout_is: Literal["token", "sequence"] | None = "token"
    """IS weights per `token` (each its own ratio: biased, low variance) or per `sequence` (the
    product over the response: unbiased, high variance); null: no weights."""
    rollout_is_threshold: float | str = 2.0
    """A number: truncate the weights there (TIS). "lower_upper" (e.g. "0.5_2.0"): IcePop, a
    weight outside the bounds is 0."""
    rollout_is_batch_normalize: bool = False
    """Scale the weights to mean 1 over the step's batch."""
    rollout_rs: str | None = None
    """Rejection: comma separated options token_k1/k2/k3, seq_sum_k1/k2/k3, seq_mean_k1/k2/k3,
    seq_max_k2/k3; all must pass. null: none."""
    rollout_rs_threshold: float | str | None = None
    """One bound per rollout_rs option, comma separated, or one for all: a k1 option takes ratio
    bounds "lower_upper" (an upper alone means [1/upper, upper]), the others an upper bound on
    their divergence."""

    @model_validator(mode="after")
    def _settings_parse(self) -> "Params":
        if self.rollout_is is None and self.rollout_rs is None:
            raise ValueError("set rollout_is (token or sequence) or rollout_rs, or drop the node")
        try:
            algos.rollout_correction.parse_is_threshold(self.rollout_is_threshold)
            if self.rollout_rs is not None:
                options = algos.rollout_correction.parse_rs_options(self.rollout_rs)
                algos.rollout_correction.parse_rs_thresholds(options, self.rollout_rs_threshold)
        except algos.AlgoError as exc:
            raise ValueError(str(exc)) from None
        return self


class RolloutCorrection:
    """Adds rollout_is_weight and/or a loss_mask with the rejected tokens 0."""

    Params = Params
    REQUIRES = C.typed(C.OLD_LOGP, C.ROLLOUT_LOGP, C.RESPONSE_LEN)
    CARDINALITY = "map"
    NEEDS_MODEL = False
    ROLE = "transform"

    @classmethod
    def produces(cls, params: Params) -> dict[str, pa.DataType]:
        return {**(C.typed(C.ROLLOUT_IS_WEIGHT) if params.rollout_is else {}),
                **(C.typed(C.LOSS_MASK) if params.rollout_rs else {})}

    def __init__(self, params: Params, ctx: OpContext):
        self.params = params
        self._metrics: dict[str, float] = {}

    def last_metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def __call__(self, batch: pa.Table) -> pa.Table:
        p = self.params
        if batch.num_rows == 0:
            return batch
        old, lengths = ragged_to_padded(batch.column(C.OLD_LOGP), dtype=np.float32)
        rollout, _ = ragged_to_padded(batch.column(C.ROLLOUT_LOGP), dtype=np.float32)
        width = old.shape[1]
        flags = response_mask(batch, lengths, width)  # an upstream loss_mask's zeros stay
        mask = torch.from_numpy(flags.astype(np.float32))
        log_ratio = torch.from_numpy(old) - torch.from_numpy(rollout[:, :width])
        metrics = mismatch_metrics(log_ratio, mask)
        added = {}
        if mask.sum() == 0:  # nothing trains this step (every token masked upstream): nothing to weigh
            self._metrics = metrics
            return batch
        if p.rollout_is:
            weights, m = algos.rollout_correction_weights(log_ratio, mask, p.rollout_is, p.rollout_is_threshold,
                                                          p.rollout_is_batch_normalize)
            metrics.update(m)
            added[C.ROLLOUT_IS_WEIGHT] = padded_to_ragged(weights.numpy().astype(np.float32), lengths, C.TOKEN_FLOATS)
        if p.rollout_rs:
            kept, m = algos.rollout_rejection_mask(log_ratio, mask, p.rollout_rs, p.rollout_rs_threshold)
            metrics.update(m)
            added[C.LOSS_MASK] = padded_to_ragged(kept.numpy().astype(np.int8), lengths, C.TOKEN_FLAGS)
        self._metrics = {f"rollout_corr/{k}": v for k, v in metrics.items()}
        return with_columns(batch, added)


def mismatch_metrics(log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the trainer's policy is from the one that sampled, over the valid tokens: the mean
    log ratio and the k1 (mean of -log ratio) and k3 (ratio - 1 - log ratio) estimates of
    KL(rollout || trainer). Shape: (B, T) each."""
    if mask.sum() == 0:
        return {}
    safe = log_ratio.clamp(-algos.rollout_correction.SAFETY_BOUND, algos.rollout_correction.SAFETY_BOUND)
    return {"log_ratio_mean": algos.masked_mean(log_ratio, mask).item(),
            "kl_k1": algos.masked_mean(-log_ratio, mask).item(),
            "kl_k3": algos.masked_mean(torch.exp(safe) - 1.0 - safe, mask).item()}
