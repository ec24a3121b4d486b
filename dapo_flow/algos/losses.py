"""Policy-gradient loss (clip-higher, dual clip) and verl's loss aggregation modes."""

from __future__ import annotations

import torch
from torch import Tensor

from dapo_flow.algos.errors import AlgoError, bad_choice
from dapo_flow.algos.masked import (
    _MEAN_EPS,
    _as_bool,
    _check_pair,
    _mask_count,
    _masked,
    masked_mean,
)

LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
_LOG_RATIO_CLAMP = 20.0  # policy-loss log-ratio and k3 clamp


def agg_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str,
    *,
    num_tokens: int | Tensor | None = None,
    num_seqs: int | None = None,
    norm_len: int | None = None,
) -> Tensor:
    """Aggregate a token loss matrix to a scalar (verl ``agg_loss`` / ``loss_agg_mode``).

    ``num_tokens`` / ``num_seqs`` are the totals of the whole mini-batch, so losses of its
    micro-batches are partial sums that add up to the mini-batch loss (never average them
    again); None = this batch. Sequence counts include fully masked rows.

    - token-mean: sum(loss·mask) / num_tokens (no epsilon: an all-masked batch is an error)
    - token-sum: sum(loss·mask)
    - seq-mean-token-sum: sum over rows of the row's token sum / num_seqs
    - seq-mean-token-mean: sum over rows of row_sum / (row_count + 1e-8) / num_seqs
    - seq-mean-token-sum-norm (Dr.GRPO): sum(loss·mask) / (num_seqs · norm_len); norm_len is a
      constant (max_response_length), required.

    Shape: loss_mat (batch, resp_len), mask (batch, resp_len) -> scalar.
    """
    if mode not in LOSS_AGG_MODES:
        raise bad_choice("loss_agg_mode", mode, LOSS_AGG_MODES)
    _check_pair(loss_mat, mask, "loss_mat", "mask")
    if num_seqs is not None and num_seqs <= 0:
        raise AlgoError(f"num_seqs must be > 0, got {num_seqs}")
    masked = _masked(loss_mat, mask)
    seqs = loss_mat.shape[0] if num_seqs is None else num_seqs
    if mode == "token-mean":
        tokens = _mask_count(mask) if num_tokens is None else num_tokens
        if float(tokens) <= 0:
            where = "this batch" if num_tokens is None else "num_tokens"
            raise AlgoError(f"token-mean over zero valid tokens ({where}): the loss would be NaN")
        return masked.sum() / tokens
    if mode == "token-sum":
        return masked.sum()
    if seqs == 0:
        raise AlgoError(f"{mode} over an empty batch")
    if mode == "seq-mean-token-sum":
        return masked.sum(dim=-1).sum() / seqs
    if mode == "seq-mean-token-mean":
        row_mean = masked.sum(dim=-1) / (_mask_count(mask, dim=-1) + _MEAN_EPS)
        return row_mean.sum() / seqs
    if norm_len is None:
        raise AlgoError("seq-mean-token-sum-norm needs norm_len (a constant such as max_response_length)")
    if norm_len <= 0:
        raise AlgoError(f"norm_len must be > 0, got {norm_len}")
    return masked.sum() / (seqs * norm_len)


def weighted_by_rollout_is(loss_tok: Tensor, weights: Tensor | None, mask: Tensor) -> Tensor:
    """``loss_tok`` times the rollout-correction IS weights (detached; 0 at masked positions, so
    NaN there stays out). Shape: loss_tok, weights, mask (batch, resp_len)."""
    if weights is None:
        return loss_tok
    if weights.shape != loss_tok.shape:
        raise AlgoError(f"rollout_is_weights shape {tuple(weights.shape)} != loss shape {tuple(loss_tok.shape)}")
    return loss_tok * torch.where(_as_bool(mask), weights.detach(), weights.new_zeros(()))


def policy_loss(
    old_logp: Tensor,
    logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    clip_c: float | None = None,
    agg: str = "token-mean",
    num_tokens: int | Tensor | None = None,
    num_seqs: int | None = None,
    norm_len: int | None = None,
    rollout_is_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate with decoupled clip (DAPO clip-higher) and optional dual clip
    (verl ``compute_policy_loss_vanilla``).

    log_ratio = clamp(logp - old_logp, ±20); r = exp(log_ratio);
    loss_tok = max(-A·r, -A·clamp(r, 1 - clip_low, 1 + clip_high)); where A < 0 and clip_c is
    set: min(loss_tok, -A·clip_c); times ``rollout_is_weights`` where given (verl's rollout
    correction). Aggregated with :func:`agg_loss` (``agg`` and the totals).
    Metrics (python floats, this micro-batch): clipfrac = masked mean of
    [-A·clamp(r) > -A·r]; clipfrac_lower = masked mean of [A < 0 and the dual clip binds];
    ppo_kl = masked mean of -log_ratio. Masked positions are zeroed before any arithmetic, so
    NaN there reaches neither the loss nor the gradient.

    Shape: old_logp, logp, advantages, mask (batch, resp_len) -> (scalar, metrics).
    """
    for name, t in (("old_logp", old_logp), ("advantages", advantages), ("mask", mask)):
        if t.shape != logp.shape:
            raise AlgoError(f"{name} shape {tuple(t.shape)} != logp shape {tuple(logp.shape)}")
    if not 0.0 <= clip_low < 1.0:
        raise AlgoError(f"clip_low must be in [0, 1), got {clip_low}")
    if clip_high < 0.0:
        raise AlgoError(f"clip_high must be >= 0, got {clip_high}")
    if clip_c is not None and clip_c <= 1.0:
        raise AlgoError(f"clip_c (dual clip) must be > 1, got {clip_c}; use None to disable")
    valid = _as_bool(mask)
    zero = logp.new_zeros(())
    log_ratio = torch.where(valid, logp - old_logp, zero).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    adv = torch.where(valid, advantages, zero)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss_tok = torch.maximum(loss_unclipped, loss_clipped)
    if clip_c is not None:
        loss_dual = -adv * clip_c
        negative = adv < 0
        dual_hit = (loss_tok > loss_dual) & negative
        loss_tok = torch.where(negative, torch.minimum(loss_dual, loss_tok), loss_tok)
    loss_tok = weighted_by_rollout_is(loss_tok, rollout_is_weights, mask)
    loss = agg_loss(loss_tok, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len)
    with torch.no_grad():
        clipped = (loss_clipped > loss_unclipped).to(logp.dtype)
        lower = dual_hit.to(logp.dtype) if clip_c is not None else torch.zeros_like(clipped)
        stats = torch.stack(
            [masked_mean(clipped, mask), masked_mean(lower, mask), masked_mean(-log_ratio.detach(), mask)]
        ).tolist()  # one device sync for all three
    return loss, {"clipfrac": stats[0], "clipfrac_lower": stats[1], "ppo_kl": stats[2]}


