"""The policy-loss family (verl 0.9 ``actor.policy_loss.loss_mode``): :data:`POLICY_LOSSES` maps a
name to a loss function with one signature::

    fn(old_logp, logp, advantages, mask, *, clip_low, clip_high, agg,
       num_tokens=None, num_seqs=None, norm_len=None, **extra) -> (loss, metrics)

- ``vanilla``: PPO clipped surrogate, clip-higher, optional dual clip (``clip_c``, its only extra
  keyword): :func:`dapo_flow.algos.policy_loss` itself (verl ``compute_policy_loss_vanilla``);
- ``gspo``: sequence-level importance ratio (verl ``compute_policy_loss_gspo``);
- ``cispo``: REINFORCE weighted by a clipped, stop-gradient importance ratio
  (verl ``compute_policy_loss_cispo``);
- ``gpg``: plain policy gradient, -A · logp (verl ``compute_policy_loss_gpg``).

Every loss is aggregated with :func:`~dapo_flow.algos.losses.agg_loss` (``agg`` and the
mini-batch totals ``num_tokens`` / ``num_seqs`` / ``norm_len``, so micro-batch losses are partial
sums of the mini-batch loss). Metrics are python floats for this micro-batch, the same three keys
for every loss: ``clipfrac``, ``clipfrac_lower``, ``ppo_kl`` (0.0 where a loss has no such
quantity). Masked positions are zeroed with ``torch.where`` before any arithmetic, so NaN there
reaches neither the loss nor the gradient. ``rollout_is_weights`` (batch, resp_len), from
:func:`~dapo_flow.algos.rollout_correction_weights`, multiply each token's loss before it is
aggregated, as verl's ``rollout_is_weights`` do. An unknown extra keyword (e.g. ``clip_c`` for gspo) is
an :class:`AlgoError`.

Shape: old_logp, logp, advantages, mask (batch, resp_len) -> (scalar, metrics).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from dapo_flow.algos.errors import AlgoError
from dapo_flow.algos.losses import _LOG_RATIO_CLAMP, agg_loss, policy_loss, weighted_by_rollout_is
from dapo_flow.algos.masked import _as_bool, _mask_count, _masked, masked_mean

GSPO_LOG_RATIO_MAX = 10.0  # verl's clamp of GSPO's (sequence) log ratio, upper side only


def _check(name: str, old_logp: Tensor, logp: Tensor, advantages: Tensor, mask: Tensor, extra: dict,
           clip_low: float, clip_high: float, *, clip_low_below_one: bool = True) -> None:
    if extra:
        raise AlgoError(f"policy loss {name!r} takes no {', '.join(sorted(extra))} "
                        f"(only 'vanilla' has a dual clip, clip_c)")
    for what, t in (("old_logp", old_logp), ("advantages", advantages), ("mask", mask)):
        if t.shape != logp.shape:
            raise AlgoError(f"{what} shape {tuple(t.shape)} != logp shape {tuple(logp.shape)}")
    if logp.dim() != 2:
        raise AlgoError(f"logp must be 2-D (batch, resp_len), got shape {tuple(logp.shape)}")
    if not (0.0 <= clip_low < 1.0 if clip_low_below_one else clip_low >= 0.0):
        bound = "[0, 1)" if clip_low_below_one else ">= 0"
        raise AlgoError(f"clip_low must be {bound} for {name}, got {clip_low}")
    if not clip_high >= 0.0:
        raise AlgoError(f"clip_high must be >= 0, got {clip_high}")


def _stats(mask: Tensor, *values: Tensor) -> list[float]:
    """Masked means as python floats, one device sync for all."""
    with torch.no_grad():
        return torch.stack([masked_mean(v.detach(), mask) for v in values]).tolist()


def vanilla(
    old_logp: Tensor,
    logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    agg: str,
    num_tokens: int | Tensor | None = None,
    num_seqs: int | None = None,
    norm_len: int | None = None,
    clip_c: float | None = None,
    rollout_is_weights: Tensor | None = None,
    **extra,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate with clip-higher and the optional dual clip ``clip_c`` (verl
    ``compute_policy_loss_vanilla``): exactly :func:`dapo_flow.algos.policy_loss`, see there."""
    if extra:
        raise AlgoError(f"policy loss 'vanilla' takes no {', '.join(sorted(extra))}")
    return policy_loss(old_logp, logp, advantages, mask, clip_low=clip_low, clip_high=clip_high, clip_c=clip_c,
                       agg=agg, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len,
                       rollout_is_weights=rollout_is_weights)


def gspo(
    old_logp: Tensor,
    logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    agg: str,
    num_tokens: int | Tensor | None = None,
    num_seqs: int | None = None,
    norm_len: int | None = None,
    rollout_is_weights: Tensor | None = None,
    **extra,
) -> tuple[Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071; verl ``compute_policy_loss_gspo``).

    s_i = (1/|y_i|) · sum over valid t of (logp - old_logp), the sequence's mean log ratio
    (|y_i| clamped to >= 1; no ±20 clamp on the token log ratios, as in verl);
    log s_i,t = sg[s_i] + logp - sg[logp], clamped at max 10 (verl's only clamp: where it binds
    the sequence gets no gradient); r_i,t = exp(log s_i,t): the value is the sequence ratio, the
    gradient that of the token's own logp. loss_tok = max(-A·r, -A·clamp(r, 1 - clip_low,
    1 + clip_high)); no dual clip. Aggregated with ``agg``.

    Aggregation: verl before 0.9 forced ``seq-mean-token-mean`` for GSPO (the paper's sequence
    mean) whatever ``loss_agg_mode`` said; verl 0.9 takes ``loss_agg_mode`` (the function's default
    is seq-mean-token-mean, the actor passes ``actor.loss_agg_mode``, default token-mean). We take
    ``agg`` like verl 0.9; set ``loss_agg_mode: seq-mean-token-mean`` for the paper's form. The
    GSPO paper's clip ranges are ~1e-4 scale (verl's example: clip_low 3e-4, clip_high 4e-4), as
    the sequence ratio is a geometric mean of token ratios.

    Metrics: clipfrac (masked mean of [-A·clamp(r) > -A·r]), clipfrac_lower 0.0, ppo_kl (masked
    mean of old_logp - logp, unclamped as in verl).
    """
    _check("gspo", old_logp, logp, advantages, mask, extra, clip_low, clip_high)
    valid = _as_bool(mask)
    zero = logp.new_zeros(())
    log_ratio = torch.where(valid, logp - old_logp, zero)
    seq_log_ratio = _masked(log_ratio, mask).sum(dim=-1) / _mask_count(mask, dim=-1).clamp(min=1)
    token_part = torch.where(valid, logp - logp.detach(), zero)  # value 0, gradient d logp
    log_seq_ratio = (token_part + seq_log_ratio.detach().unsqueeze(-1)).clamp(max=GSPO_LOG_RATIO_MAX)
    ratio = torch.exp(log_seq_ratio)
    adv = torch.where(valid, advantages, zero)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss_tok = torch.maximum(loss_unclipped, loss_clipped)
    loss_tok = weighted_by_rollout_is(loss_tok, rollout_is_weights, mask)
    loss = agg_loss(loss_tok, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len)
    clipfrac, ppo_kl = _stats(mask, (loss_clipped > loss_unclipped).to(logp.dtype), -log_ratio)
    return loss, {"clipfrac": clipfrac, "clipfrac_lower": 0.0, "ppo_kl": ppo_kl}


def cispo(
    old_logp: Tensor,
    logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    agg: str,
    num_tokens: int | Tensor | None = None,
    num_seqs: int | None = None,
    norm_len: int | None = None,
    rollout_is_weights: Tensor | None = None,
    **extra,
) -> tuple[Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585; verl ``compute_policy_loss_cispo``).

    r = exp(clamp(logp - old_logp, ±20)); w = sg[clamp(r, 1 - clip_low, 1 + clip_high)];
    loss_tok = -w · A · logp. The clipped ratio carries no gradient: d loss_tok / d logp = -w·A
    on every valid token, clipped or not (PPO would zero the clipped ones). Aggregated with
    ``agg``. ``clip_low`` >= 1 disables the lower bound (verl's CISPO example uses
    clip_ratio_low = 10, clip_ratio_high = 0.2).

    Metrics: clipfrac (masked mean of [r != clamp(r)]), clipfrac_lower 0.0, ppo_kl (masked mean
    of -clamp(logp - old_logp, ±20)).
    """
    _check("cispo", old_logp, logp, advantages, mask, extra, clip_low, clip_high, clip_low_below_one=False)
    valid = _as_bool(mask)
    zero = logp.new_zeros(())
    with torch.no_grad():
        log_ratio = torch.where(valid, logp - old_logp, zero).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        ratio = torch.exp(log_ratio)
        weight = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    adv = torch.where(valid, advantages, zero)
    loss_tok = -weight * adv * torch.where(valid, logp, zero)  # verl's order: (-w · A) · logp
    loss_tok = weighted_by_rollout_is(loss_tok, rollout_is_weights, mask)
    loss = agg_loss(loss_tok, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len)
    clipfrac, ppo_kl = _stats(mask, (ratio != weight).to(logp.dtype), -log_ratio)
    return loss, {"clipfrac": clipfrac, "clipfrac_lower": 0.0, "ppo_kl": ppo_kl}


def gpg(
    old_logp: Tensor,
    logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    agg: str,
    num_tokens: int | Tensor | None = None,
    num_seqs: int | None = None,
    norm_len: int | None = None,
    rollout_is_weights: Tensor | None = None,
    **extra,
) -> tuple[Tensor, dict[str, float]]:
    """GPG (Chu et al. 2025, arXiv:2504.02546; verl ``compute_policy_loss_gpg``): plain policy
    gradient, loss_tok = -logp · A, aggregated with ``agg``. No importance ratio and no clip:
    ``clip_low`` / ``clip_high`` are accepted for the common signature and not used; ``old_logp``
    only feeds the ppo_kl metric.

    Metrics: verl returns none; we return clipfrac 0.0, clipfrac_lower 0.0 and ppo_kl (masked mean
    of old_logp - logp, unclamped) so every loss logs the same keys.
    """
    _check("gpg", old_logp, logp, advantages, mask, extra, 0.0, 0.0)
    valid = _as_bool(mask)
    zero = logp.new_zeros(())
    loss_tok = -torch.where(valid, logp, zero) * torch.where(valid, advantages, zero)
    loss_tok = weighted_by_rollout_is(loss_tok, rollout_is_weights, mask)
    loss = agg_loss(loss_tok, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len)
    (ppo_kl,) = _stats(mask, torch.where(valid, old_logp - logp, zero))
    return loss, {"clipfrac": 0.0, "clipfrac_lower": 0.0, "ppo_kl": ppo_kl}


PolicyLoss = Callable[..., "tuple[Tensor, dict[str, float]]"]

#: Every policy loss by name (the `update` operator's ``policy_loss`` choices), in docs order.
POLICY_LOSSES: dict[str, PolicyLoss] = {"vanilla": vanilla, "gspo": gspo, "cispo": cispo, "gpg": gpg}
