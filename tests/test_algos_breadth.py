"""Tests of the critic-side math (dapo_flow.algos.value) and the policy-loss family
(dapo_flow.algos.policy_losses) against transcriptions of verl 0.9.1's reference code
(`verl/trainer/ppo/core_algos.py` and `verl/utils/torch_functional.py` of the PyPI wheel
verl==0.9.1), compared on random inputs, values and gradients, plus hand-worked cases.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from dapo_flow import algos
from dapo_flow.algos import (
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    AlgoError,
    gae,
    policy_loss,
    remax_advantages,
    value_loss,
)

TIGHT = dict(rtol=1e-6, atol=1e-6)


# =============================================================================================
# Transcriptions of verl 0.9.1 (verl/utils/torch_functional.py, verl/trainer/ppo/core_algos.py).
# `config` lookups become arguments; dp_size = 1; `config.global_batch_info` becomes
# (batch_num_tokens, global_batch_size, loss_scale_factor); rollout_is_weights = None.
# =============================================================================================


def _verl_masked_sum(values, mask, axis=None):
    valid_values = torch.where(mask.bool(), values, 0.0)
    return (valid_values * mask).sum(axis=axis)


def _verl_masked_mean(values, mask, axis=None):
    s = _verl_masked_sum(values, mask, axis)
    return s / (mask.sum(axis=axis) + 1e-8)


def _verl_masked_var(values, mask, unbiased=True):
    mean = _verl_masked_mean(values, mask)
    centered_values = values - mean
    variance = _verl_masked_mean(centered_values**2, mask)
    if unbiased:
        mask_sum = mask.sum()
        if mask_sum == 0:
            raise ValueError("At least one element in the mask has to be 1.")
        if mask_sum == 1:
            raise ValueError("The sum of the mask is one, which can cause a division by zero.")
        bessel_correction = mask_sum / (mask_sum - 1)
        variance = variance * bessel_correction
    return variance


def _verl_masked_whiten(values, mask, shift_mean=True):
    mean, var = _verl_masked_mean(values, mask), _verl_masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened += mean
    return whitened


def _verl_clip_by_value(x, tensor_min, tensor_max):
    clipped = torch.max(torch.min(x, tensor_max), tensor_min)
    return clipped


def _verl_agg_loss(loss_mat, loss_mask, loss_agg_mode, dp_size=1, batch_num_tokens=None, global_batch_size=None,
                   loss_scale_factor=None):
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None:
            batch_num_tokens = loss_mask.sum()
        loss = _verl_masked_sum(loss_mat, loss_mask) / batch_num_tokens * dp_size
    elif loss_agg_mode == "token-sum":
        loss = _verl_masked_sum(loss_mat, loss_mask) * dp_size
    elif loss_agg_mode in ["seq-mean-token-sum", "seq-mean-token-sum-norm"]:
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)  # token-sum
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float()  # exclude fully masked sequences
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        loss = _verl_masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size  # seq-mean
        if loss_agg_mode == "seq-mean-token-sum-norm":
            if loss_scale_factor is None:
                loss_scale_factor = loss_mask.shape[-1]
            loss /= loss_scale_factor
    elif loss_agg_mode == "seq-mean-token-mean":
        seq_mask = torch.sum(loss_mask, dim=-1)  # per-sequence token count
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)  # token-mean
        seq_mask = (seq_mask > 0).float()  # exclude fully masked sequences
        if global_batch_size is None:
            global_batch_size = seq_mask.sum()
        loss = _verl_masked_sum(seq_losses, seq_mask) / global_batch_size * dp_size  # seq-mean
    else:
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")
    return loss


def _verl_compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam):
    with torch.no_grad():
        nextvalues = 0
        lastgaelam = 0
        advantages_reversed = []
        gen_len = token_level_rewards.shape[-1]

        for t in reversed(range(gen_len)):
            delta = token_level_rewards[:, t] + gamma * nextvalues - values[:, t]
            lastgaelam_ = delta + gamma * lam * lastgaelam

            # skip values and TD-error on observation tokens
            nextvalues = values[:, t] * response_mask[:, t] + (1 - response_mask[:, t]) * nextvalues
            lastgaelam = lastgaelam_ * response_mask[:, t] + (1 - response_mask[:, t]) * lastgaelam

            advantages_reversed.append(lastgaelam)
        advantages = torch.stack(advantages_reversed[::-1], dim=1)

        returns = advantages + values
        advantages = _verl_masked_whiten(advantages, response_mask)
    return advantages, returns


def _verl_compute_value_loss(vpreds, returns, values, response_mask, cliprange_value, loss_agg_mode="token-mean",
                             dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None):
    vpredclipped = _verl_clip_by_value(vpreds, values - cliprange_value, values + cliprange_value)
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    clipped_vf_losses = torch.max(vf_losses1, vf_losses2)
    vf_loss = 0.5 * _verl_agg_loss(
        loss_mat=clipped_vf_losses,
        loss_mask=response_mask,
        loss_agg_mode=loss_agg_mode,
        dp_size=dp_size,
        batch_num_tokens=batch_num_tokens,
        global_batch_size=global_batch_size,
        loss_scale_factor=loss_scale_factor,
    )
    vf_clipfrac = _verl_masked_mean(torch.gt(vf_losses2, vf_losses1).float(), response_mask)
    return vf_loss, vf_clipfrac


def _verl_compute_remax_outcome_advantage(token_level_rewards, reward_baselines, response_mask):
    with torch.no_grad():
        returns = (token_level_rewards * response_mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
        advantages = returns - reward_baselines.unsqueeze(-1) * response_mask
    return advantages, returns


def _verl_compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                                      clip_ratio_low, clip_ratio_high, clip_ratio_c, global_batch_info):
    assert clip_ratio_c > 1.0
    cliprange_low, cliprange_high = clip_ratio_low, clip_ratio_high
    negative_approx_kl = log_prob - old_log_prob
    negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = _verl_masked_mean(-negative_approx_kl, response_mask)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = _verl_masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)

    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = _verl_masked_mean(
        torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask
    )

    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    pg_loss = _verl_agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode,
                             **global_batch_info)
    pg_metrics = {
        "actor/pg_clipfrac": pg_clipfrac.detach().item(),
        "actor/ppo_kl": ppo_kl.detach().item(),
        "actor/pg_clipfrac_lower": pg_clipfrac_lower.detach().item(),
    }
    return pg_loss, pg_metrics


def _verl_compute_policy_loss_gspo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                                   clip_ratio_low, clip_ratio_high, global_batch_info):
    negative_approx_kl = log_prob - old_log_prob

    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths

    log_seq_importance_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    log_seq_importance_ratio = torch.clamp(log_seq_importance_ratio, max=10.0)  # clamp for numerical stability

    seq_importance_ratio = torch.exp(log_seq_importance_ratio)

    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(seq_importance_ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)

    pg_loss = _verl_agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode,
                             **global_batch_info)

    pg_clipfrac = _verl_masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    pg_clipfrac_lower = torch.tensor(0.0, device=pg_loss.device)

    ppo_kl = _verl_masked_mean(-negative_approx_kl, response_mask)
    pg_metrics = {
        "actor/pg_clipfrac": pg_clipfrac.detach().item(),
        "actor/ppo_kl": ppo_kl.detach().item(),
        "actor/pg_clipfrac_lower": pg_clipfrac_lower.detach().item(),
    }
    return pg_loss, pg_metrics


def _verl_compute_policy_loss_gpg(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                                  global_batch_info):
    pg_losses = -log_prob * advantages
    pg_loss = _verl_agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode,
                             **global_batch_info)
    return pg_loss, {}


def _verl_compute_policy_loss_cispo(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
                                    clip_ratio_low, clip_ratio_high, global_batch_info):
    negative_approx_kl = log_prob - old_log_prob
    negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = _verl_masked_mean(-negative_approx_kl, response_mask)

    clipped_ratio = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    clipped_ratio_sg = clipped_ratio.detach()

    pg_losses = -clipped_ratio_sg * advantages * log_prob

    pg_clipfrac = _verl_masked_mean((ratio != clipped_ratio).float(), response_mask)

    pg_loss = _verl_agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode,
                             **global_batch_info)

    pg_clipfrac_lower = torch.tensor(0.0, device=pg_loss.device)

    pg_metrics = {
        "actor/pg_clipfrac": pg_clipfrac.detach().item(),
        "actor/ppo_kl": ppo_kl.detach().item(),
        "actor/pg_clipfrac_lower": pg_clipfrac_lower.detach().item(),
    }
    return pg_loss, pg_metrics


# ---------------------------------------------------------------------------------- fixtures


def _mask(seed: int, rows: int = 7, width: int = 11) -> torch.Tensor:
    """Responses of random length (mask-0 tail), holes in the middle (observation tokens), one
    fully masked row and one full row."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, width + 1, (rows,), generator=g)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    mask[torch.rand(rows, width, generator=g) < 0.25] = False
    mask[1, 2:5] = False  # a contiguous observation span
    mask[1, 0] = mask[1, 6] = True
    mask[2] = False
    mask[3] = True
    return mask


def _policy_inputs(seed: int, rows: int = 7, width: int = 11, spread: float = 0.4):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(rows, width, generator=g) - 2.0
    logp = old + spread * torch.randn(rows, width, generator=g)
    adv = torch.randn(rows, width, generator=g)
    return old, logp, adv, _mask(seed, rows, width)


def _totals(mask: torch.Tensor, mode: str, norm_len: int):
    """Ours (num_tokens, num_seqs, norm_len) and verl's global_batch_info for the same normaliser:
    we count every row, verl's default skips fully masked ones, so verl gets the row count."""
    ours = dict(num_tokens=int(mask.sum()), num_seqs=mask.shape[0], norm_len=norm_len)
    verl = dict(batch_num_tokens=int(mask.sum()), global_batch_size=mask.shape[0], loss_scale_factor=norm_len)
    return ours, verl


def _grad(loss, x):
    (g,) = torch.autograd.grad(loss, x)
    return g


# =============================================================================================
# GAE
# =============================================================================================


@pytest.mark.parametrize(("seed", "gamma", "lam"), [(0, 1.0, 1.0), (1, 0.99, 0.95), (2, 0.9, 0.0), (3, 0.0, 0.5)])
def test_gae_matches_verl(seed, gamma, lam):
    mask = _mask(seed)
    g = torch.Generator().manual_seed(100 + seed)
    rewards = torch.randn(mask.shape, generator=g)
    values = torch.randn(mask.shape, generator=g)
    ref_adv, ref_ret = _verl_compute_gae_advantage_return(rewards, values, mask.float(), gamma, lam)
    for m in (mask, mask.float()):
        adv, ret = gae(rewards, values, m, gamma=gamma, lam=lam)
        # verl leaves the carried values at mask-0 positions; ours are 0 there
        assert_close(adv, torch.where(mask, ref_adv, 0.0), **TIGHT)
        assert_close(ret, torch.where(mask, ref_ret, 0.0), **TIGHT)
        assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()


def test_gae_carries_value_and_advantage_across_observation_tokens():
    # one row, tokens 0..3, token 1 an observation token (mask 0), gamma = lam = 1: V and A of
    # token 2 are carried through token 1, so returns = rewards-to-go over the valid tokens and the
    # observation token's reward (5.0) is ignored. returns: t3 = 2, t2 = 1 + 2, t0 = 0.5 + 3.
    rewards = torch.tensor([[0.5, 5.0, 1.0, 2.0]])
    values = torch.tensor([[0.3, float("nan"), -0.2, 0.7]])  # NaN at the masked position: harmless
    mask = torch.tensor([[True, False, True, True]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert_close(ret, torch.tensor([[3.5, 0.0, 3.0, 2.0]]))
    raw = torch.tensor([3.5 - 0.3, 3.0 + 0.2, 2.0 - 0.7])
    expected = (raw - raw.mean()) / torch.sqrt(raw.var() + 1e-8)  # torch.var is Bessel-corrected
    assert_close(adv[mask], expected)
    assert adv[0, 1] == 0 and torch.isfinite(adv).all()
    # gamma = 0.5, lam = 1: the observation token is not a time step: discounted once, not twice
    _, ret = gae(rewards, values, mask, gamma=0.5, lam=1.0)
    assert_close(ret[0, 2], torch.tensor(1.0 + 0.5 * 2.0))
    assert_close(ret[0, 0], torch.tensor(0.5 + 0.5 * 2.0))


def test_gae_errors_and_no_grad():
    rewards, values = torch.randn(2, 3), torch.randn(2, 3, requires_grad=True)
    one = torch.tensor([[False, True, False], [False, False, False]])
    with pytest.raises(AlgoError, match=r"gae whitens .* needs at least 2, got 1"):
        gae(rewards, values, one, gamma=1.0, lam=1.0)
    with pytest.raises(AlgoError, match=r"at least 2, got 0"):
        gae(rewards, values, torch.zeros(2, 3, dtype=torch.bool), gamma=1.0, lam=1.0)
    with pytest.raises(AlgoError, match="gamma"):
        gae(rewards, values, torch.ones(2, 3), gamma=1.5, lam=1.0)
    with pytest.raises(AlgoError, match="shape"):
        gae(rewards, values[:, :2], torch.ones(2, 3), gamma=1.0, lam=1.0)
    adv, ret = gae(rewards, values, torch.ones(2, 3, dtype=torch.bool), gamma=1.0, lam=0.9)
    assert not adv.requires_grad and not ret.requires_grad


# =============================================================================================
# Value loss
# =============================================================================================


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize(("seed", "clip"), [(0, 0.2), (1, 0.5), (2, 0.0)])
def test_value_loss_matches_verl(seed, clip, mode):
    mask = _mask(seed)
    g = torch.Generator().manual_seed(200 + seed)
    values = torch.randn(mask.shape, generator=g)
    returns = values + torch.randn(mask.shape, generator=g)
    vpreds = (values + 0.5 * torch.randn(mask.shape, generator=g)).requires_grad_()
    ours_tot, verl_tot = _totals(mask, mode, norm_len=16)
    loss, m = value_loss(vpreds, returns, values, mask, clip=clip, agg=mode, **ours_tot)
    vp = vpreds.detach().clone().requires_grad_()
    ref, ref_clipfrac = _verl_compute_value_loss(vp, returns, values, mask.float(), clip, mode, **verl_tot)
    assert_close(loss, ref, **TIGHT)
    assert_close(_grad(loss, vpreds), _grad(ref, vp), **TIGHT)
    assert m["vf_clipfrac"] == pytest.approx(ref_clipfrac.item(), rel=1e-6) and isinstance(m["vf_clipfrac"], float)
    if clip > 0.0:
        assert 0.0 < m["vf_clipfrac"] < 1.0


def test_value_loss_hand_worked_and_nan_safe():
    # values 0, returns 1, clip 0.2: vpred 0.5 -> clipped 0.2: max(0.25, 0.64) = 0.64 (clipped);
    # vpred 1.5 -> clipped 0.2: max(0.25, 0.64) = 0.64 (clipped); vpred -0.1 -> unclipped: 1.21
    # both ways (a tie, not clipped). token-mean: 0.5 * (0.64 + 0.64 + 1.21) / 3.
    vpreds = torch.tensor([[0.5, 1.5, -0.1, float("nan")]], requires_grad=True)
    returns = torch.tensor([[1.0, 1.0, 1.0, float("nan")]])
    values = torch.zeros(1, 4)
    mask = torch.tensor([[True, True, True, False]])
    loss, m = value_loss(vpreds, returns, values, mask, clip=0.2)
    assert_close(loss, torch.tensor(0.5 * (0.64 + 0.64 + 1.21) / 3))
    assert m["vf_clipfrac"] == pytest.approx(2 / 3)
    loss.backward()
    # d/dv 0.5 (v - R)^2 / 3 = (v - R) / 3 where unclipped; 0 where the clipped term (constant in
    # v, the clamp binds) wins. At -0.1 the two terms tie: torch.max gives each half, and both
    # carry (v - R) / 3 (the clamp does not bind there), so the total is -1.1 / 3.
    assert_close(vpreds.grad, torch.tensor([[0.0, 0.0, -1.1 / 3, 0.0]]))
    with pytest.raises(AlgoError, match="clip"):
        value_loss(vpreds, returns, values, mask, clip=-0.1)
    with pytest.raises(AlgoError, match="shape"):
        value_loss(vpreds, returns[:, :2], values, mask, clip=0.1)


# =============================================================================================
# ReMax
# =============================================================================================


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_remax_matches_verl(seed):
    mask = _mask(seed)
    g = torch.Generator().manual_seed(300 + seed)
    rewards = torch.randn(mask.shape, generator=g)
    baselines = torch.randn(mask.shape[0], generator=g)
    ref_adv, ref_ret = _verl_compute_remax_outcome_advantage(rewards, baselines, mask.float())
    for m in (mask, mask.float()):
        adv, ret = remax_advantages(rewards, baselines, m)
        assert_close(adv, torch.where(mask, ref_adv, 0.0), **TIGHT)
        assert_close(ret, torch.where(mask, ref_ret, 0.0), **TIGHT)


def test_remax_hand_worked_and_errors():
    # reward 1.0 at the last valid token, 9.0 on an observation token (ignored), baseline 0.25
    rewards = torch.tensor([[0.0, 9.0, 1.0, float("nan")]])
    mask = torch.tensor([[True, False, True, False]])
    adv, ret = remax_advantages(rewards, torch.tensor([0.25]), mask)
    assert_close(ret, torch.tensor([[1.0, 0.0, 1.0, 0.0]]))
    assert_close(adv, torch.tensor([[0.75, 0.0, 0.75, 0.0]]))
    with pytest.raises(AlgoError, match="baselines shape"):
        remax_advantages(rewards, torch.zeros(2), mask)


# =============================================================================================
# Policy losses
# =============================================================================================


def _ours(name, old, logp, adv, mask, mode, tot, clip_low=0.2, clip_high=0.28, **extra):
    return POLICY_LOSSES[name](old, logp, adv, mask, clip_low=clip_low, clip_high=clip_high, agg=mode, **tot, **extra)


def test_policy_losses_table_and_update_choices():
    from typing import get_args

    from dapo_flow.operators.update import Params

    assert list(POLICY_LOSSES) == ["vanilla", "gspo", "cispo", "gpg"]
    assert set(get_args(Params.model_fields["policy_loss"].annotation)) == set(POLICY_LOSSES)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize(("seed", "clip_c"), [(0, 3.0), (1, None)])
def test_vanilla_is_policy_loss_and_matches_verl(seed, clip_c, mode):
    old, logp, adv, mask = _policy_inputs(seed, spread=0.5)
    tot, verl_tot = _totals(mask, mode, norm_len=16)
    x = logp.clone().requires_grad_()
    loss, m = _ours("vanilla", old, x, adv, mask, mode, tot, clip_c=clip_c)
    y = logp.clone().requires_grad_()
    direct, m_direct = policy_loss(old, y, adv, mask, clip_low=0.2, clip_high=0.28, clip_c=clip_c, agg=mode, **tot)
    assert torch.equal(loss, direct) and m == m_direct  # the same function: bit for bit
    gx = _grad(loss, x)
    assert torch.equal(gx, _grad(direct, y))
    z = logp.clone().requires_grad_()
    ref, rm = _verl_compute_policy_loss_vanilla(old, z, adv, mask.float(), mode, 0.2, 0.28,
                                                1e30 if clip_c is None else clip_c, verl_tot)
    assert_close(loss, ref, **TIGHT)
    assert_close(gx, _grad(ref, z), **TIGHT)
    assert m["clipfrac"] == pytest.approx(rm["actor/pg_clipfrac"], rel=1e-6)
    assert m["ppo_kl"] == pytest.approx(rm["actor/ppo_kl"], rel=1e-5)
    assert m["clipfrac_lower"] == pytest.approx(rm["actor/pg_clipfrac_lower"], rel=1e-6)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize(("seed", "clip_low", "clip_high", "spread"),
                         [(0, 0.2, 0.28, 0.1), (1, 3e-4, 4e-4, 0.01), (2, 0.2, 0.2, 0.05)])
def test_gspo_matches_verl(seed, clip_low, clip_high, spread, mode):
    old, logp, adv, mask = _policy_inputs(seed, spread=spread)
    tot, verl_tot = _totals(mask, mode, norm_len=16)
    x = logp.clone().requires_grad_()
    o = old.clone().requires_grad_()
    loss, m = _ours("gspo", o, x, adv, mask, mode, tot, clip_low=clip_low, clip_high=clip_high)
    z = logp.clone().requires_grad_()
    ref, rm = _verl_compute_policy_loss_gspo(old, z, adv, mask.float(), mode, clip_low, clip_high, verl_tot)
    assert_close(loss, ref, **TIGHT)
    gx, go = torch.autograd.grad(loss, (x, o), allow_unused=True)
    assert_close(gx, _grad(ref, z), **TIGHT)
    assert go is None  # the sequence ratio is stop-gradient: nothing flows to old_logp
    assert m["clipfrac"] == pytest.approx(rm["actor/pg_clipfrac"], rel=1e-6)
    assert m["ppo_kl"] == pytest.approx(rm["actor/ppo_kl"], rel=1e-5)
    assert m["clipfrac_lower"] == 0.0
    if spread <= 0.05 and clip_high > 1e-3:
        assert m["clipfrac"] < 1.0  # some sequences inside the clip range: gradient flows
        assert gx.abs().sum() > 0


def test_gspo_ratio_is_the_sequence_geometric_mean_and_the_clamp_binds():
    # row 0: token log ratios 0.3 and 0.1 -> sequence log ratio 0.2 (mean over its 2 valid
    #   tokens; the masked third is ignored); A = 1, clip (0.2, 0.5): r = e^0.2 < 1.5 unclipped:
    #   loss_tok = -e^0.2 on both tokens, d/dlogp = -e^0.2 each (sum over tokens: token-sum).
    # row 1: token log ratios 12 and 14 -> sequence 13, clamped to 10: r = e^10, A = -1: the
    #   unclipped -A r = e^10 is the max, but the clamp kills the gradient.
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.3, 0.1, float("nan")], [12.0, 14.0, float("nan")]], requires_grad=True)
    adv = torch.tensor([[1.0, 1.0, float("nan")], [-1.0, -1.0, float("nan")]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    loss, m = POLICY_LOSSES["gspo"](old, logp, adv, mask, clip_low=0.2, clip_high=0.5, agg="token-sum")
    assert_close(loss, torch.tensor(-2 * math.exp(0.2) + 2 * math.exp(10.0)))
    loss.backward()
    assert_close(logp.grad, torch.tensor([[-math.exp(0.2), -math.exp(0.2), 0.0], [0.0, 0.0, 0.0]]))
    assert m["clipfrac"] == 0.0  # row 1 is not "clipped": the unclipped term is the larger
    assert m["ppo_kl"] == pytest.approx(-(0.3 + 0.1 + 12 + 14) / 4, rel=1e-6)  # token log ratios, unclamped
    # verl agrees on values and gradients (NaN-free inputs: verl multiplies by the mask)
    clean = torch.where(mask, logp.detach(), 0.0).requires_grad_()
    ref, _ = _verl_compute_policy_loss_gspo(old, clean, torch.where(mask, adv, 0.0), mask.float(), "token-sum",
                                            0.2, 0.5, {})
    assert_close(loss, ref)
    assert_close(logp.grad, _grad(ref, clean))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize(("seed", "clip_low", "clip_high"), [(0, 0.2, 0.28), (1, 10.0, 0.2), (2, 0.1, 0.1)])
def test_cispo_matches_verl(seed, clip_low, clip_high, mode):
    old, logp, adv, mask = _policy_inputs(seed, spread=0.4)
    tot, verl_tot = _totals(mask, mode, norm_len=16)
    x = logp.clone().requires_grad_()
    loss, m = _ours("cispo", old, x, adv, mask, mode, tot, clip_low=clip_low, clip_high=clip_high)
    z = logp.clone().requires_grad_()
    ref, rm = _verl_compute_policy_loss_cispo(old, z, adv, mask.float(), mode, clip_low, clip_high, verl_tot)
    assert_close(loss, ref, **TIGHT)
    assert_close(_grad(loss, x), _grad(ref, z), **TIGHT)
    assert m["clipfrac"] == pytest.approx(rm["actor/pg_clipfrac"], rel=1e-6)
    assert 0.0 < m["clipfrac"] < 1.0
    assert m["ppo_kl"] == pytest.approx(rm["actor/ppo_kl"], rel=1e-5)
    assert m["clipfrac_lower"] == 0.0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_cispo_gradient_is_minus_adv_times_the_detached_clipped_ratio(mode):
    # d loss / d logp = -A · sg[clamp(r)] · (the aggregation's weight of the token): clipped tokens
    # keep their gradient (PPO would zero them), and nothing flows through the ratio.
    old, logp, adv, mask = _policy_inputs(4, spread=0.6)
    x = logp.clone().requires_grad_()
    o = old.clone().requires_grad_()
    loss, m = POLICY_LOSSES["cispo"](o, x, adv, mask, clip_low=0.2, clip_high=0.28, agg=mode)
    gx, go = torch.autograd.grad(loss, (x, o), allow_unused=True)
    clipped = torch.clamp(torch.exp(logp - old), 0.8, 1.28)
    if mode == "token-mean":
        weight = mask.float() / mask.sum()
    else:  # each row's token mean, averaged over all rows (the fully masked one included)
        weight = mask.float() / (mask.sum(-1, keepdim=True) + 1e-8) / mask.shape[0]
    assert_close(gx, -adv * clipped * weight, **TIGHT)
    assert go is None  # no gradient through the ratio, so none to old_logp
    assert m["clipfrac"] > 0.2 and (gx[mask & (clipped != torch.exp(logp - old))] != 0).all()


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("seed", [0, 1])
def test_gpg_matches_verl(seed, mode):
    old, logp, adv, mask = _policy_inputs(seed)
    tot, verl_tot = _totals(mask, mode, norm_len=16)
    x = logp.clone().requires_grad_()
    loss, m = _ours("gpg", old, x, adv, mask, mode, tot)
    z = logp.clone().requires_grad_()
    ref, rm = _verl_compute_policy_loss_gpg(old, z, adv, mask.float(), mode, verl_tot)
    assert rm == {}
    assert_close(loss, ref, **TIGHT)
    assert_close(_grad(loss, x), _grad(ref, z), **TIGHT)
    # verl logs nothing; we log the same keys as the other losses
    assert m["clipfrac"] == 0.0 and m["clipfrac_lower"] == 0.0
    assert m["ppo_kl"] == pytest.approx(float(((old - logp) * mask).sum() / mask.sum()), rel=1e-5)


@pytest.mark.parametrize("name", list(POLICY_LOSSES))
def test_policy_losses_nan_at_masked_positions_does_not_leak(name):
    old, logp, adv, mask = _policy_inputs(5)
    for t in (old, logp, adv):
        t[~mask] = float("nan")
    x = logp.clone().requires_grad_()
    o = old.clone().requires_grad_()
    a = adv.clone().requires_grad_()
    extra = {"clip_c": 3.0} if name == "vanilla" else {}
    loss, m = POLICY_LOSSES[name](o, x, a, mask, clip_low=0.2, clip_high=0.28, agg="seq-mean-token-mean", **extra)
    loss.backward()
    assert torch.isfinite(loss) and all(math.isfinite(v) for v in m.values())
    assert set(m) == {"clipfrac", "clipfrac_lower", "ppo_kl"} and all(type(v) is float for v in m.values())
    for grad in (x.grad, o.grad, a.grad):  # old_logp gets none where the ratio is stop-gradient
        assert grad is None or (torch.isfinite(grad).all() and (grad[~mask] == 0).all())
    assert x.grad is not None and a.grad is not None


def test_policy_losses_errors():
    old, logp, adv, mask = _policy_inputs(0)
    for name in ("gspo", "cispo", "gpg"):
        with pytest.raises(AlgoError, match=rf"policy loss '{name}' takes no clip_c"):
            _ours(name, old, logp, adv, mask, "token-mean", {}, clip_c=3.0)
        with pytest.raises(AlgoError, match="shape"):
            _ours(name, old[:, :2], logp, adv, mask, "token-mean", {})
        with pytest.raises(AlgoError, match="loss_agg_mode"):
            _ours(name, old, logp, adv, mask, "mean", {})
    with pytest.raises(AlgoError, match="takes no foo"):
        _ours("vanilla", old, logp, adv, mask, "token-mean", {}, foo=1)
    with pytest.raises(AlgoError, match=r"clip_low must be \[0, 1\) for gspo"):
        _ours("gspo", old, logp, adv, mask, "token-mean", {}, clip_low=1.0)
    with pytest.raises(AlgoError, match="clip_high"):
        _ours("cispo", old, logp, adv, mask, "token-mean", {}, clip_high=-0.1)
    assert algos.POLICY_LOSSES is POLICY_LOSSES


def test_lowest_token_probability_is_the_weakest_response_token():
    logp = torch.log(torch.tensor([[0.9, 0.2, 0.7], [0.99, 1.0, 0.5], [0.3, 0.3, 0.3]]))
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    got = algos.lowest_token_probability(logp, mask)
    assert_close(got, torch.tensor([0.2, 0.99, 0.0]))  # the padded 0.5 is not read; no tokens: 0
    logp[1, 2] = float("nan")  # whatever sits under the padding
    assert_close(algos.lowest_token_probability(logp, mask.bool()), torch.tensor([0.2, 0.99, 0.0]))
    with pytest.raises(algos.AlgoError, match="same"):
        algos.lowest_token_probability(logp, mask[:, :2])
