"""Critic-side math: GAE advantages and returns, the clipped value loss, and ReMax's advantages
(verl 0.9 ``compute_gae_advantage_return``, ``compute_value_loss``,
``compute_remax_outcome_advantage`` in ``verl/trainer/ppo/core_algos.py``).

Like the rest of :mod:`dapo_flow.algos`: NaN/inf at masked positions never reaches a value or a
gradient (``torch.where``, not ``x * mask``), and bad input raises :class:`AlgoError`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dapo_flow.algos.errors import AlgoError
from dapo_flow.algos.losses import agg_loss
from dapo_flow.algos.masked import _as_bool, _check_pair, _mask_count, _masked, masked_mean, masked_whiten


def gae(token_rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation (verl ``compute_gae_advantage_return``), without gradient.

    Backwards over t, vectorised over the batch::

        delta_t = r_t + gamma * V_next - V_t
        A_t     = delta_t + gamma * lam * A_next

    where V_next / A_next are those of the next *valid* token: at a mask-0 position
    (a tool / observation token inside a multi-turn response, or padding) both are carried through
    unchanged, so an observation span is skipped, neither discounted nor bootstrapped from, and
    its reward is ignored (verl's rule). returns = A + V with the raw A; the advantages are
    then whitened over every valid token of the batch (:func:`masked_whiten`: zero mean, Bessel
    variance, ``rsqrt(var + 1e-8)``); the returns are not.

    Advantages and returns are 0 at mask-0 positions (verl leaves the carried values there; no loss
    reads them, and a NaN value at a masked position then cannot reach either output). A non-zero
    mask entry counts as valid in the recursion; a float mask's weights enter the whitening
    statistics, as in verl.

    Raises :class:`AlgoError` for fewer than 2 valid tokens in the batch (the whitening variance
    would divide by zero), gamma or lam outside [0, 1], or mismatched shapes.

    Shape: token_rewards, values, mask (batch, T) -> advantages, returns (batch, T).
    """
    _check_pair(token_rewards, mask, "token_rewards", "mask")
    _check_pair(values, mask, "values", "mask")
    for name, x in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= x <= 1.0:
            raise AlgoError(f"{name} must be in [0, 1], got {x}")
    n_valid = float(_mask_count(mask))
    if n_valid < 2:
        raise AlgoError(
            f"gae whitens the advantages over the batch's valid tokens and needs at least 2, got {n_valid:g}: "
            "train on a batch with more (unmasked) response tokens")
    with torch.no_grad():
        valid = _as_bool(mask)
        rewards, vals = token_rewards.detach(), values.detach()
        advantages = torch.zeros_like(vals)
        next_value = vals.new_zeros(vals.shape[0])
        last_gae = vals.new_zeros(vals.shape[0])
        for t in reversed(range(vals.shape[1])):  # over time steps, vectorised over the batch
            delta = rewards[:, t] + gamma * next_value - vals[:, t]
            step = delta + gamma * lam * last_gae  # verl's operation order: (gamma * lam) * A_next
            keep = valid[:, t]
            next_value = torch.where(keep, vals[:, t], next_value)
            last_gae = torch.where(keep, step, last_gae)
            advantages[:, t] = last_gae
        zero = vals.new_zeros(())
        returns = torch.where(valid, advantages + vals, zero)
        whitened = torch.where(valid, masked_whiten(advantages, mask), zero)
    return whitened, returns


def value_loss(
    vpreds: Tensor,
    returns: Tensor,
    values: Tensor,
    mask: Tensor,
    *,
    clip: float,
    agg: str = "token-mean",
    num_tokens: int | Tensor | None = None,
    num_seqs: int | None = None,
    norm_len: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO's clipped value loss (verl ``compute_value_loss``), with verl's factor 0.5.

    v_clip = clamp(vpreds, values - clip, values + clip) (elementwise bounds, verl's
    ``clip_by_value``: max(min(v, hi), lo)); loss_tok = max((vpreds - R)^2, (v_clip - R)^2);
    loss = 0.5 * :func:`agg_loss` (loss_tok, mask, ``agg``, totals). The totals follow agg_loss's
    convention: ``num_tokens`` / ``num_seqs`` of the whole mini-batch make micro-batch losses
    partial sums of it. Metric ``vf_clipfrac``: masked mean of [(v_clip - R)^2 > (vpreds - R)^2]
    (strict), a python float for this micro-batch. Gradient flows to ``vpreds`` only (R and the
    old values are targets); masked positions are zeroed before any arithmetic.

    Shape: vpreds, returns, values, mask (batch, T) -> (scalar, metrics).
    """
    for name, t in (("returns", returns), ("values", values), ("mask", mask)):
        if t.shape != vpreds.shape:
            raise AlgoError(f"{name} shape {tuple(t.shape)} != vpreds shape {tuple(vpreds.shape)}")
    if not clip >= 0.0:
        raise AlgoError(f"value clip must be >= 0, got {clip}")
    valid = _as_bool(mask)
    zero = vpreds.new_zeros(())
    v = torch.where(valid, vpreds, zero)
    target = torch.where(valid, returns, zero).detach()
    old = torch.where(valid, values, zero).detach()
    v_clipped = torch.max(torch.min(v, old + clip), old - clip)
    loss1 = (v - target) ** 2
    loss2 = (v_clipped - target) ** 2
    loss_tok = torch.max(loss1, loss2)
    loss = 0.5 * agg_loss(loss_tok, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len)
    with torch.no_grad():
        clipfrac = float(masked_mean((loss2 > loss1).to(v.dtype), mask))
    return loss, {"vf_clipfrac": clipfrac}


def remax_advantages(token_rewards: Tensor, baselines: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """ReMax advantages (verl ``compute_remax_outcome_advantage``), without gradient.

    returns_t = sum over t' >= t of r_t' (valid tokens only, no discount);
    advantages_t = returns_t - b, with b the sequence's baseline reward (ReMax: the reward of the
    greedy response). Both are 0 at mask-0 positions (verl leaves the reward-to-go there, and
    there its advantage lacks the baseline; no loss reads them).

    Shape: token_rewards, mask (batch, T), baselines (batch,) -> advantages, returns (batch, T).
    """
    _check_pair(token_rewards, mask, "token_rewards", "mask")
    if baselines.shape != token_rewards.shape[:1]:
        raise AlgoError(f"baselines shape {tuple(baselines.shape)} != (batch,) = ({token_rewards.shape[0]},)")
    with torch.no_grad():
        valid = _as_bool(mask)
        rewards = _masked(token_rewards.detach(), mask)
        returns = rewards.flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
        base = _masked(baselines.detach().unsqueeze(-1).expand_as(returns), mask)
        zero = returns.new_zeros(())
        return torch.where(valid, returns - base, zero), torch.where(valid, returns, zero)
