"""Tests of dapo_flow.algos: hand-worked numbers (derivations in comments), gradients, transcriptions
of verl's reference code (loop-based, as in verl) compared on random inputs, and hypothesis
properties. What each function computes, and where it follows or differs from verl: docs/semantics.md.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import polars as pl
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from torch.testing import assert_close

from dapo_flow import algos
from dapo_flow.algos import logprobs as logprobs_module
from dapo_flow.algos import (
    ESTIMATORS,
    KL_KINDS,
    LOSS_AGG_MODES,
    SEQUENCE_ESTIMATORS,
    AlgoError,
    Groups,
    agg_loss,
    entropy_from_logits,
    factorize,
    keep_groups,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    masked_whiten,
    outcome_advantages,
    overlong_penalty,
    policy_loss,
    sequence_advantages,
)

EPS = 1e-6
PROPS = settings(max_examples=40, deadline=None)


# =============================================================================================
# Transcriptions of verl 0.9 (verl/utils/torch_functional.py, verl/trainer/ppo/core_algos.py)
# =============================================================================================


def _verl_masked_mean(values, mask, axis=None):
    valid = torch.where(mask.bool(), values, 0.0)
    s = (valid * mask).sum() if axis is None else (valid * mask).sum(axis)
    return s / ((mask.sum() if axis is None else mask.sum(axis)) + 1e-8)


def _verl_masked_whiten(values, mask):
    mean = _verl_masked_mean(values, mask)
    variance = _verl_masked_mean((values - mean) ** 2, mask)
    mask_sum = mask.sum()
    variance = variance * (mask_sum / (mask_sum - 1))
    return (values - mean) * torch.rsqrt(variance + 1e-8)


def _verl_reference_grpo(token_level_rewards, response_mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True):
    scores = token_level_rewards.sum(dim=-1)
    id2score, id2mean, id2std = defaultdict(list), {}, {}
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx] = torch.tensor(0.0)
                id2std[idx] = torch.tensor(1.0)
            else:
                scores_tensor = torch.stack(id2score[idx])
                id2mean[idx] = torch.mean(scores_tensor)
                id2std[idx] = torch.std(scores_tensor)
        for i in range(bsz):
            if norm_adv_by_std_in_grpo:
                scores[i] = (scores[i] - id2mean[index[i]]) / (id2std[index[i]] + epsilon)
            else:
                scores[i] = scores[i] - id2mean[index[i]]
        return scores.unsqueeze(-1) * response_mask


def _verl_reference_rloo(token_level_rewards, response_mask, index):
    scores = token_level_rewards.sum(dim=-1)
    id2score, id2mean = defaultdict(list), {}
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx] = torch.tensor(0.0)
            else:
                id2mean[idx] = torch.mean(torch.stack(id2score[idx]))
        for i in range(bsz):
            n = len(id2score[index[i]])
            if n > 1:
                scores[i] = scores[i] * n / (n - 1) - id2mean[index[i]] * n / (n - 1)
        return scores.unsqueeze(-1) * response_mask


def _verl_reference_reinforce_pp_baseline(token_level_rewards, response_mask, index):
    response_length = token_level_rewards.shape[-1]
    scores = token_level_rewards.sum(dim=-1)
    id2score, id2mean = defaultdict(list), {}
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2mean[idx] = torch.tensor(0.0)
            else:
                id2mean[idx] = torch.mean(torch.stack(id2score[idx]))
        for i in range(bsz):
            scores[i] = scores[i] - id2mean[index[i]]
        scores = scores.unsqueeze(-1).tile([1, response_length]) * response_mask
        return _verl_masked_whiten(scores, response_mask) * response_mask


def _verl_reference_reinforce_pp(token_level_rewards, response_mask, gamma):
    """verl's REINFORCE++ with the multi-turn rule: γ where the token is valid, 1 where it is a
    tool/observation token or padding, so the running return is carried across them, not reset."""
    with torch.no_grad():
        gamma_masked = torch.where(response_mask.bool(), gamma, 1.0)
        returns = torch.zeros_like(token_level_rewards)
        running_return = torch.zeros(token_level_rewards.shape[0])
        for t in reversed(range(token_level_rewards.shape[1])):
            running_return = token_level_rewards[:, t] + gamma_masked[:, t] * running_return
            returns[:, t] = running_return
        return _verl_masked_whiten(returns, response_mask) * response_mask, returns * response_mask


def _verl_reference_opo(token_level_rewards, response_mask, index):
    response_length = response_mask.sum(dim=-1)
    scores = token_level_rewards.sum(dim=-1)
    id2score, id2len, id2bsl = defaultdict(list), defaultdict(list), {}
    with torch.no_grad():
        bsz = scores.shape[0]
        for i in range(bsz):
            id2score[index[i]].append(scores[i])
            id2len[index[i]].append(response_length[i])
        for idx in id2score:
            if len(id2score[idx]) == 1:
                id2bsl[idx] = torch.tensor(0.0)
            else:
                score_tensor = torch.stack(id2score[idx])
                len_tensor = torch.stack(id2len[idx])
                id2bsl[idx] = (len_tensor * score_tensor).sum() / len_tensor.sum()
        for i in range(bsz):
            scores[i] = scores[i] - id2bsl[index[i]]
        return scores.unsqueeze(-1) * response_mask


def _verl_reference_grpo_passk(token_level_rewards, response_mask, index, norm_adv_by_std_in_grpo=True):
    scores = token_level_rewards.sum(dim=-1)
    advantages = torch.zeros_like(scores)
    id2scores, id2indices = defaultdict(list), defaultdict(list)
    with torch.no_grad():
        for i in range(scores.shape[0]):
            id2scores[index[i]].append(scores[i])
            id2indices[index[i]].append(i)
        for idx in id2scores:
            rewards = torch.stack(id2scores[idx])
            topk, topk_idx = torch.topk(rewards, 2)
            i_max = id2indices[idx][topk_idx[0].item()]
            advantage = topk[0] - topk[1]
            if norm_adv_by_std_in_grpo:
                advantage = advantage / (torch.std(rewards) + 1e-6)
            advantages[i_max] = advantage
    return advantages.unsqueeze(-1) * response_mask


def _verl_policy_loss(old_log_prob, log_prob, advantages, response_mask, cliprange_low, cliprange_high, clip_ratio_c):
    """compute_policy_loss_vanilla with loss_agg_mode="token-mean"."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
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
    return _verl_masked_mean(pg_losses, response_mask), pg_clipfrac, ppo_kl, pg_clipfrac_lower


def _verl_kl_penalty(logprob, ref_logprob, kl_penalty):
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty == "abs":
        return (logprob - ref_logprob).abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)


# ---------------------------------------------------------------------------------- fixtures


def _random_batch(seed: int, rows: int = 48, width: int = 12, n_prompts: int = 9):
    """Token rewards with one score at the last valid token, holes in the mask, str uids."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    mask[torch.rand(rows, width, generator=g) < 0.1] = False  # holes (e.g. tool tokens)
    mask[0] = False  # one fully masked row
    rewards = torch.zeros(rows, width)
    rewards[torch.arange(rows), lengths - 1] = torch.randn(rows, generator=g)
    uids = np.array([f"p{int(i)}" for i in torch.randint(0, n_prompts, (rows,), generator=g)], dtype=object)
    return rewards, mask, uids


def _token_rewards(scores) -> torch.Tensor:
    return torch.tensor(scores, dtype=torch.float32)[:, None] * torch.tensor([0.0, 1.0])  # score at t=1


# =============================================================================================
# factorize
# =============================================================================================


@pytest.mark.parametrize(
    "ids",
    [
        ["b", "a", "b", "c"],
        np.array(["b", "a", "b", "c"], dtype=object),  # verl's uid array / Arrow to_numpy
        np.array(["b", "a", "b", "c"]),  # numpy unicode
        pl.Series(["b", "a", "b", "c"]),
        pa.chunked_array([pa.array(["b", "a"]), pa.array(["b", "c"])]),  # an Arrow column
        [7, 3, 7, 10**12],  # sparse ints: np.unique path
        np.array([7, 3, 7, 9], dtype=np.int32),  # compact ints: dense remap path
        np.array([7, 3, 7, 9], dtype=object),
        torch.tensor([7, 3, 7, 9]),
        [0.5, 1.5, 0.5, 2.5],
    ],
)
def test_factorize_codes_by_value(ids):
    codes, n_groups = factorize(ids)
    assert codes.dtype == np.int64 and n_groups == 3
    assert codes[0] == codes[2] and len({codes[0], codes[1], codes[3]}) == 3
    assert set(codes.tolist()) == {0, 1, 2}


def test_factorize_enum_fallback_for_older_polars(monkeypatch):
    monkeypatch.delattr(pl, "Categories", raising=False)  # polars < 1.32 has no Categories
    codes, n_groups = factorize(["b", "a", "b", "c"])
    assert n_groups == 3 and codes[0] == codes[2] and set(codes.tolist()) == {0, 1, 2}


def test_factorize_passthrough_empty_and_errors():
    g = factorize(["x", "y"])
    assert factorize(g) is g
    assert factorize([]).n_groups == 0
    with pytest.raises(AlgoError, match="null"):
        factorize(["a", None])
    with pytest.raises(AlgoError, match="all str or all int"):
        factorize(["a", 1])
    with pytest.raises(AlgoError, match="NaN"):
        factorize(np.array([1.0, np.nan]))
    with pytest.raises(AlgoError, match="1-D"):
        factorize(np.zeros((2, 2), np.int64))
    with pytest.raises(AlgoError, match="3 group ids for 2 sequences"):
        sequence_advantages([1.0, 2.0], ["a", "a", "b"], "grpo")


# =============================================================================================
# Outcome advantages
# =============================================================================================


def test_grpo_hand_worked():
    # group a: scores [1, 0, 1]: mean 2/3, unbiased var ((1/3)^2 + (2/3)^2 + (1/3)^2) / 2 = 1/3,
    #   std 0.5773503 -> adv (1/3)/(std + 1e-6) = 0.5773493, (-2/3)/(std + 1e-6) = -1.1546985.
    # group b: a single sequence with score 2: mean 0, std 1 -> 2 / (1 + 1e-6) = 1.999998, NOT 0.
    # group c: [0.7, 0.7]: all equal -> exactly 0 (dapo-flow; verl may give one-ulp noise).
    scores = [1.0, 0.0, 1.0, 2.0, 0.7, 0.7]
    ids = ["a", "a", "a", "b", "c", "c"]
    std = math.sqrt(1 / 3)
    expected = [(1 / 3) / (std + EPS), (-2 / 3) / (std + EPS), (1 / 3) / (std + EPS), 2 / (1 + EPS), 0.0, 0.0]
    adv = sequence_advantages(np.array(scores, np.float32), ids, "grpo")
    assert adv.dtype == np.float32
    assert_close(adv, np.array(expected, np.float32), rtol=1e-6, atol=1e-7)
    assert adv[4] == 0.0 and adv[5] == 0.0
    # Dr.GRPO (norm_by_std=False): s - mean: 1/3, -2/3, 1/3; the singleton keeps 2.
    dr = sequence_advantages(np.array(scores, np.float32), ids, "grpo", norm_by_std=False)
    assert_close(dr, np.array([1 / 3, -2 / 3, 1 / 3, 2.0, 0.0, 0.0], np.float32))


def test_grpo_token_broadcast_score_over_all_positions():
    # score = sum over ALL positions, masked ones included (verl sums token_level_rewards);
    # the advantage is then written only where mask is true; an all-masked row gets 0.
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.0, 0.5], [0.0, 0.0, 3.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    ids = [0, 0, 0, 1]
    # scores [1, 0, 1 (0.5 at a masked position counts), 3]; group 0 as in the test above.
    adv = outcome_advantages(rewards, mask, ids, "grpo")
    a = (1 / 3) / (math.sqrt(1 / 3) + EPS)
    expected = torch.tensor([[a, a, 0], [-2 * a, -2 * a, -2 * a], [a, 0, 0], [0, 0, 0]])
    assert_close(adv, expected)
    assert adv[3].abs().sum() == 0 and adv.dtype == rewards.dtype


def test_constant_groups_exact_zero_where_verl_is_noisy():
    # 16 copies of 0.7f: verl's float32 torch.mean is off by an ulp and then divides a ~1e-7
    # difference by std + 1e-6 ~ 1e-6 -> |adv| up to ~0.06. dapo-flow returns exact zeros.
    rewards = _token_rewards([0.7] * 16 + [0.3] * 12)
    mask = torch.ones_like(rewards, dtype=torch.bool)
    ids = np.array(["a"] * 16 + ["b"] * 12, dtype=object)
    ours = outcome_advantages(rewards, mask, ids, "grpo")
    assert (ours == 0).all()
    ref = _verl_reference_grpo(rewards, mask, ids)
    assert ref.abs().max() > 0  # the verl trap this improvement removes
    for est in ("rloo", "opo", "grpo_passk"):
        assert (outcome_advantages(rewards, mask, ids, est) == 0).all(), est


def test_constant_groups_exact_zero_for_float64_scores():
    # float64 sums of equal values need not be exact (0.1 + 0.1 + 0.1 = 0.30000000000000004,
    # mean 0.10000000000000002), so float64 input takes the explicit exact-equality check.
    scores = np.array([0.1, 0.1, 0.1, 0.2, 0.3])
    ids = [0, 0, 0, 1, 1]
    for est in ("grpo", "rloo", "opo", "grpo_passk"):
        adv = sequence_advantages(scores, ids, est, lengths=[3, 1, 2, 2, 2])
        assert (adv[:3] == 0).all() and (adv[3:] != 0).any(), est
    tok = outcome_advantages(torch.tensor([[0.1], [0.1], [0.1]], dtype=torch.float64),
                             torch.ones(3, 1, dtype=torch.bool), [0, 0, 0], "grpo")
    assert (tok == 0).all()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_matches_verl_reference(seed, norm):
    rewards, mask, uids = _random_batch(seed)
    ours = outcome_advantages(rewards, mask, uids, "grpo", norm_by_std=norm)
    assert_close(ours, _verl_reference_grpo(rewards, mask.float(), uids, norm_adv_by_std_in_grpo=norm))


def test_rloo_hand_worked_and_reference():
    # [1, 0, 1]: leave-one-out means 0.5, 1, 0.5 -> 0.5, -1, 0.5; singleton keeps its score 2.
    adv = sequence_advantages(np.array([1, 0, 1, 2], np.float32), ["a", "a", "a", "b"], "rloo")
    assert_close(adv, np.array([0.5, -1.0, 0.5, 2.0], np.float32))
    for seed in range(3):
        rewards, mask, uids = _random_batch(seed)
        ref = _verl_reference_rloo(rewards, mask.float(), uids)
        assert_close(outcome_advantages(rewards, mask, uids, "rloo"), ref)


def test_reinforce_pp_baseline_hand_worked_and_reference():
    # scores [1, 0] (group a) and [3] (group b, singleton: mean 0); lengths 1, 2, 1 tokens.
    # centred: 0.5, -0.5, 3. Token values: 0.5 | -0.5, -0.5 | 3 -> N = 4, mean 2.5/4 = 0.625,
    # unbiased var = ((0.5-.625)^2 + 2 (-0.5-.625)^2 + (3-.625)^2) / 3 = 8.1875/3 = 2.7291667.
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0], [3.0, 0.0]])
    mask = torch.tensor([[1, 0], [1, 1], [1, 0]], dtype=torch.bool)
    sd = math.sqrt(8.1875 / 3 + 1e-8)
    w = [(0.5 - 0.625) / sd, (-0.5 - 0.625) / sd, (3 - 0.625) / sd]
    expected = torch.tensor([[w[0], 0.0], [w[1], w[1]], [w[2], 0.0]])
    assert_close(outcome_advantages(rewards, mask, ["a", "a", "b"], "reinforce_pp_baseline"), expected)
    seq = sequence_advantages([1.0, 0.0, 3.0], ["a", "a", "b"], "reinforce_pp_baseline", lengths=[1, 2, 1])
    assert_close(seq, np.array(w, np.float32))
    for seed in range(3):
        rewards, mask, uids = _random_batch(seed)
        ref = _verl_reference_reinforce_pp_baseline(rewards, mask.float(), uids)
        assert_close(outcome_advantages(rewards, mask, uids, "reinforce_pp_baseline"), ref)


def test_reinforce_pp_hand_worked_and_reference():
    # gamma 0.5, row [0, 0, 1] all valid: returns [0.25, 0.5, 1]; row [2, 0(masked), 4]: the
    # masked (tool) position carries the running return through undiscounted: returns [4, x, 4].
    # Valid tokens 0.25, 0.5, 1, 4, 4: mean 9.75/5 = 1.95; squared deviations
    # 2.89 + 2.1025 + 0.9025 + 4.2025 + 4.2025 = 14.3 -> unbiased var 14.3/4 = 3.575.
    rewards = torch.tensor([[0.0, 0.0, 1.0], [2.0, 0.0, 4.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]], dtype=torch.bool)
    ret = torch.tensor([[0.25, 0.5, 1.0], [4.0, 0.0, 4.0]])
    sd = math.sqrt(3.575 + 1e-8)
    expected = torch.where(mask, (ret - 1.95) / sd, 0.0)
    ours = outcome_advantages(rewards, mask, ["x", "y"], "reinforce_pp", gamma=0.5)
    assert_close(ours, expected)
    adv, returns = algos.reinforce_pp_advantages(rewards, mask, 0.5)
    assert_close(adv, expected)
    assert_close(returns, ret)
    for seed, gamma in [(0, 1.0), (1, 0.9), (2, 0.5)]:
        rewards, mask, uids = _random_batch(seed)  # holes in the middle of responses
        rewards = rewards * mask  # rewards sit on valid tokens (a reward on a tool token is ignored)
        ref_adv, ref_ret = _verl_reference_reinforce_pp(rewards, mask.float(), gamma)
        assert_close(outcome_advantages(rewards, mask, uids, "reinforce_pp", gamma=gamma), ref_adv)
        adv, returns = algos.reinforce_pp_advantages(rewards, mask, gamma)
        assert_close(adv, ref_adv)
        assert_close(returns, ref_ret)


def test_grpo_passk_hand_worked_and_reference():
    # [1, 0, 0.5]: only the best gets r_max - r_2nd = 0.5, over (unbiased std 0.5 + 1e-6);
    # a tie for best [1, 1, 0] gives all zeros.
    adv = sequence_advantages([1.0, 0.0, 0.5, 1.0, 1.0, 0.0], [0, 0, 0, 1, 1, 1], "grpo_passk")
    assert_close(adv, np.array([0.5 / (0.5 + EPS), 0, 0, 0, 0, 0], np.float32))
    raw = sequence_advantages([1.0, 0.0, 0.5], [0, 0, 0], "grpo_passk", norm_by_std=False)
    assert_close(raw, np.array([0.5, 0, 0], np.float32))
    with pytest.raises(AlgoError, match=">= 2 samples"):
        sequence_advantages([1.0, 0.0, 0.5], [0, 0, 1], "grpo_passk")
    for seed in range(3):
        rewards, mask, _ = _random_batch(seed)
        uids = np.array([f"q{i // 4}" for i in range(rewards.shape[0])], dtype=object)
        for norm in (True, False):
            ref = _verl_reference_grpo_passk(rewards, mask.float(), uids, norm)
            assert_close(outcome_advantages(rewards, mask, uids, "grpo_passk", norm_by_std=norm), ref)


def test_opo_hand_worked_and_reference():
    # scores [1, 0], lengths [2, 6]: baseline (2*1 + 6*0) / 8 = 0.25 -> [0.75, -0.25].
    adv = sequence_advantages([1.0, 0.0, 5.0], ["a", "a", "b"], "opo", lengths=[2, 6, 3])
    assert_close(adv, np.array([0.75, -0.25, 5.0], np.float32))  # singleton: baseline 0
    for seed in range(3):
        rewards, mask, uids = _random_batch(seed)
        mask[0, 0] = True  # verl divides by the group's token count: keep it non-zero
        assert_close(outcome_advantages(rewards, mask, uids, "opo"), _verl_reference_opo(rewards, mask.float(), uids))


@pytest.mark.parametrize("estimator", SEQUENCE_ESTIMATORS)
def test_sequence_and_token_advantages_share_math(estimator):
    rewards, mask, _ = _random_batch(5)
    uids = [i // 4 for i in range(rewards.shape[0])]
    tok = outcome_advantages(rewards, mask, uids, estimator)
    seq = sequence_advantages(rewards.sum(-1).numpy(), uids, estimator, lengths=mask.sum(-1).numpy())
    assert_close(tok, torch.from_numpy(seq)[:, None] * mask)


def test_mask_dtypes_and_out_buffer():
    rewards, mask, uids = _random_batch(3)
    ref = outcome_advantages(rewards, mask, uids, "grpo")
    assert_close(outcome_advantages(rewards, mask.float(), uids, "grpo"), ref)
    assert_close(outcome_advantages(rewards, mask.long(), uids, "grpo"), ref)
    out = torch.full_like(rewards, float("nan"))
    assert outcome_advantages(rewards, mask, uids, "grpo", out=out) is out
    assert_close(out, ref)
    r64 = outcome_advantages(rewards.double(), mask, uids, "grpo")
    assert r64.dtype == torch.float64
    assert_close(r64, ref.double(), rtol=1e-6, atol=1e-6)


def test_advantage_errors():
    rewards, mask, uids = _random_batch(0)
    with pytest.raises(AlgoError, match=r"unknown estimator 'gpro' \(did you mean 'grpo'\?\); valid: grpo, rloo"):
        outcome_advantages(rewards, mask, uids, "gpro")
    with pytest.raises(AlgoError, match="token-level"):
        sequence_advantages([1.0, 2.0], [0, 0], "reinforce_pp")
    with pytest.raises(AlgoError, match="needs `lengths`"):
        sequence_advantages([1.0, 2.0], [0, 0], "reinforce_pp_baseline")
    with pytest.raises(AlgoError, match="NaN or inf"):
        sequence_advantages([1.0, float("nan")], [0, 0], "grpo")
    with pytest.raises(AlgoError, match="shape"):
        outcome_advantages(rewards, mask[:, :3], uids, "grpo")
    with pytest.raises(AlgoError, match="gamma"):
        outcome_advantages(rewards, mask, uids, "reinforce_pp", gamma=1.5)
    one_token = torch.zeros_like(mask[:1])
    one_token[0, 0] = True
    with pytest.raises(AlgoError, match="at least 2 valid"):
        outcome_advantages(rewards[:1], one_token, ["a"], "reinforce_pp_baseline")
    assert set(SEQUENCE_ESTIMATORS) < set(ESTIMATORS)


# =============================================================================================
# Dynamic sampling keep mask, overlong penalty
# =============================================================================================


def test_keep_groups_hand_worked():
    # a: [1, 1] all equal -> drop; b: [0, 1] -> keep; c: singleton -> keep;
    # d: [0.7]*3 non-dyadic but exactly equal -> drop; e: 1 ulp apart -> keep.
    one_ulp = np.nextafter(np.float32(0.7), np.float32(1))
    ids = ["a", "a", "b", "b", "c", "d", "d", "d", "e", "e"]
    values = np.array([1, 1, 0, 1, 1, 0.7, 0.7, 0.7, 0.7, one_ulp], np.float32)
    expected = [False, False, True, True, True, False, False, False, True, True]
    assert keep_groups(ids, values).tolist() == expected
    assert keep_groups(ids, torch.from_numpy(values)).tolist() == expected
    assert keep_groups(["a", "a"], [True, False]).tolist() == [True, True]
    with pytest.raises(AlgoError, match="NaN"):
        keep_groups(["a", "a"], [1.0, float("nan")])


def test_keep_groups_penalty_metric():
    # All-correct group with different overlong penalties: kept for seq_final_reward, dropped for acc.
    acc = [1.0, 1.0]
    final = [1.0, 1.0 + overlong_penalty([20], max_len=16, buffer_len=4, factor=1.0)[0]]
    assert keep_groups([0, 0], acc).tolist() == [False, False]
    assert keep_groups([0, 0], final).tolist() == [True, True]


def test_overlong_penalty_hand_worked_and_verl():
    # max_len 16, buffer 4 -> expected 12: L=10 -> 0; 12 -> 0; 13 -> -1/4; 16 -> -1;
    # 20 -> -2 (no lower clamp); factor 0.5 halves.
    lens = [10, 12, 13, 16, 20]
    pen = overlong_penalty(lens, max_len=16, buffer_len=4, factor=1.0)
    assert pen.dtype == np.float32
    assert pen.tolist() == [0.0, 0.0, -0.25, -1.0, -2.0]
    assert overlong_penalty(lens, max_len=16, buffer_len=4, factor=0.5).tolist() == [0.0, 0.0, -0.125, -0.5, -1.0]
    # verl DAPORewardManager: tensor(int) arithmetic in float32, python min(., 0).
    rng = np.random.default_rng(0)
    for length in rng.integers(0, 25000, 200):
        exceed_len = torch.tensor(int(length)) - (20480 - 4096)
        verl = min(-exceed_len / 4096 * 0.7, 0)
        ours = overlong_penalty([length], max_len=20480, buffer_len=4096, factor=0.7)[0]
        assert ours == np.float32(float(verl))
    with pytest.raises(AlgoError, match="buffer_len"):
        overlong_penalty([1], max_len=16, buffer_len=0, factor=1.0)
    with pytest.raises(AlgoError, match="max_len"):
        overlong_penalty([1], max_len=2, buffer_len=4, factor=1.0)


# =============================================================================================
# Masked statistics, entropy, log-probs
# =============================================================================================


def test_masked_mean_hand_worked_no_nan_leak():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]], requires_grad=True)
    m = torch.tensor([[1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    # (1 + 2 + 4 + 6) / (4 + 1e-8) = 3.25; per row: 1.5, 5.
    out = masked_mean(x, m)
    assert_close(out, torch.tensor(3.25))
    assert_close(masked_mean(x, m, dim=-1), torch.tensor([1.5, 5.0]))
    out.backward()
    assert_close(x.grad, m.float() / 4)  # finite, 0 at masked positions
    assert_close(masked_mean(x.detach(), m.float()), _verl_masked_mean(x.detach(), m.float()))


def test_masked_whiten_hand_worked_and_reference():
    # [1, 2, 3, 4]: mean 2.5, unbiased var 5/3 -> (x - 2.5) / sqrt(5/3 + 1e-8); position 5 masked.
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 100.0])
    m = torch.tensor([1, 1, 1, 1, 0], dtype=torch.bool)
    w = masked_whiten(x, m)
    assert_close(w[:4], (x[:4] - 2.5) / math.sqrt(5 / 3 + 1e-8))
    assert_close(masked_whiten(x, m, shift_mean=False)[:4], (x[:4] - 2.5) / math.sqrt(5 / 3 + 1e-8) + 2.5)
    y = torch.randn(6, 7, generator=torch.Generator().manual_seed(0))
    mm = torch.rand(6, 7, generator=torch.Generator().manual_seed(1)) > 0.3
    assert_close(masked_whiten(y, mm), _verl_masked_whiten(y, mm.float()))
    with pytest.raises(AlgoError, match="at least 2"):
        masked_whiten(x, torch.tensor([1, 0, 0, 0, 0], dtype=torch.bool))


def test_entropy_from_logits():
    # uniform over 4 -> log 4; shape (..., vocab) -> (...)
    assert_close(entropy_from_logits(torch.zeros(2, 3, 4)), torch.full((2, 3), math.log(4)))
    z = torch.randn(5, 11, dtype=torch.float64, requires_grad=True)
    assert_close(entropy_from_logits(z), torch.distributions.Categorical(logits=z).entropy())
    assert torch.autograd.gradcheck(entropy_from_logits, (z,))


def test_logprobs_from_logits(monkeypatch):
    g = torch.Generator().manual_seed(0)
    z = torch.randn(3, 5, 17, generator=g)
    labels = torch.randint(0, 17, (3, 5), generator=g)
    ref = torch.log_softmax(z, -1).gather(-1, labels[..., None]).squeeze(-1)
    assert_close(logprobs_from_logits(z, labels), ref)
    monkeypatch.setattr(logprobs_module, "_LOGSUMEXP_CHUNK", 40)  # 2 rows per chunk: chunked path
    assert_close(logprobs_from_logits(z, labels), ref)
    low = logprobs_from_logits(z.bfloat16(), labels)  # float32 logsumexp of bf16 logits
    assert low.dtype == torch.float32
    assert_close(low, torch.log_softmax(z.bfloat16().float(), -1).gather(-1, labels[..., None]).squeeze(-1))
    z64 = z.double().requires_grad_()
    assert torch.autograd.gradcheck(lambda t: logprobs_from_logits(t, labels), (z64,))
    with pytest.raises(AlgoError, match="labels shape"):
        logprobs_from_logits(z, labels[:, :2])


# =============================================================================================
# Loss aggregation
# =============================================================================================

_LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
_MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)  # row 3 fully masked


@pytest.mark.parametrize(
    ("mode", "kwargs", "expected"),
    [
        ("token-mean", {}, 7 / 3),  # (1 + 2 + 4) / 3 valid tokens
        ("token-mean", {"num_tokens": 14}, 0.5),  # mini-batch total: 7 / 14
        ("token-sum", {}, 7.0),
        ("seq-mean-token-sum", {}, 7 / 3),  # (3 + 4 + 0) / 3 sequences, masked row counted
        ("seq-mean-token-sum", {"num_seqs": 7}, 1.0),
        ("seq-mean-token-mean", {}, (1.5 + 4.0 + 0.0) / 3),  # row means 3/2, 4/1, 0/(0 + 1e-8)
        ("seq-mean-token-sum-norm", {"norm_len": 4}, 7 / (3 * 4)),  # Dr.GRPO: / (num_seqs * norm_len)
        ("seq-mean-token-sum-norm", {"norm_len": 4, "num_seqs": 7}, 7 / 28),
    ],
)
def test_agg_loss_hand_worked(mode, kwargs, expected):
    assert_close(agg_loss(_LOSS, _MASK, mode, **kwargs), torch.tensor(expected))
    assert_close(agg_loss(_LOSS, _MASK.float(), mode, **kwargs), torch.tensor(expected))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_nan_at_masked_positions_does_not_leak(mode):
    loss = _LOSS.clone()
    loss[~_MASK] = float("nan")
    loss[2, 2] = float("inf")
    loss.requires_grad_()
    out = agg_loss(loss, _MASK, mode, norm_len=4)
    assert_close(out, agg_loss(_LOSS, _MASK, mode, norm_len=4))
    out.backward()
    assert torch.isfinite(loss.grad).all() and (loss.grad[~_MASK] == 0).all()


def test_agg_loss_dr_grpo_constant_norm_len():
    # verl's default normaliser is the padded width (a trap: padding changes the loss);
    # with a constant norm_len, extra padded columns change nothing.
    padded_loss = torch.cat([_LOSS, torch.ones(3, 5)], dim=1)
    padded_mask = torch.cat([_MASK, torch.zeros(3, 5, dtype=torch.bool)], dim=1)
    a = agg_loss(_LOSS, _MASK, "seq-mean-token-sum-norm", norm_len=16)
    b = agg_loss(padded_loss, padded_mask, "seq-mean-token-sum-norm", norm_len=16)
    assert_close(a, b)


def test_agg_loss_errors_and_verl():
    with pytest.raises(AlgoError, match="zero valid tokens"):
        agg_loss(_LOSS, torch.zeros_like(_MASK), "token-mean")
    # an all-masked micro-batch of a non-empty mini-batch just contributes 0
    assert agg_loss(_LOSS, torch.zeros_like(_MASK), "token-mean", num_tokens=5).item() == 0.0
    with pytest.raises(AlgoError, match="needs norm_len"):
        agg_loss(_LOSS, _MASK, "seq-mean-token-sum-norm")
    with pytest.raises(AlgoError, match="valid: token-mean, token-sum"):
        agg_loss(_LOSS, _MASK, "token_mean")
    with pytest.raises(AlgoError, match="num_seqs"):
        agg_loss(_LOSS, _MASK, "seq-mean-token-sum", num_seqs=0)
    x = torch.randn(5, 9, generator=torch.Generator().manual_seed(0))
    m = torch.rand(5, 9, generator=torch.Generator().manual_seed(1)) > 0.3
    m[:, 0] = True
    mf = m.float()
    assert_close(agg_loss(x, m, "token-mean"), _verl_masked_mean(x, mf))
    assert_close(agg_loss(x, m, "seq-mean-token-sum"), torch.mean(torch.sum(x * mf, dim=-1)))
    assert_close(agg_loss(x, m, "seq-mean-token-mean"), torch.mean(torch.sum(x * mf, -1) / torch.sum(mf, -1)))


# =============================================================================================
# Policy loss
# =============================================================================================


def _hand_policy_batch():
    # tokens (log ratio, A): clip_low 0.2, clip_high 0.28, clip_c 3
    #   t00 (ln 1.5, +1): max(-1.5, -1.28) = -1.28   clipped (pg2 > pg1); A > 0: no dual clip
    #                     (applied, min(-1.28, -A·3) would give -3)
    #   t01 (ln 1.5, -1): max( 1.5,  1.28) =  1.5
    #   t02 (ln 0.5, -1): max( 0.5,  0.8 ) =  0.8    clipped
    #   t03 (ln 0.5, +1): max(-0.5, -0.8 ) = -0.5
    #   t10 (ln 5,   -1): max(5, 1.28) = 5 -> dual clip min(5, 3) = 3   clipfrac_lower
    #   t11 (0,       0): 0   (A = 0 counts in the clipfrac denominator)
    #   t12, t13 masked, NaN log-probs and advantages
    log_ratio = torch.tensor([[math.log(1.5), math.log(1.5), math.log(0.5), math.log(0.5)],
                              [math.log(5.0), 0.0, float("nan"), float("nan")]])
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0], [-1.0, 0.0, float("nan"), float("nan")]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
    old = torch.zeros(2, 4)
    old[1, 3] = float("inf")
    return old, log_ratio, adv, mask


def test_policy_loss_hand_worked():
    old, logp, adv, mask = _hand_policy_batch()
    logp.requires_grad_()
    loss, m = policy_loss(old, logp, adv, mask, clip_c=3.0)
    # token-mean over 6 valid tokens: (-1.28 + 1.5 + 0.8 - 0.5 + 3 + 0) / 6 = 3.52 / 6
    assert_close(loss, torch.tensor(3.52 / 6))
    assert m["clipfrac"] == pytest.approx(2 / 6)
    assert m["clipfrac_lower"] == pytest.approx(1 / 6)
    # ppo_kl = mean(old - logp) = -(2 ln 1.5 + 2 ln 0.5 + ln 5) / 6
    assert m["ppo_kl"] == pytest.approx(-(2 * math.log(1.5) + 2 * math.log(0.5) + math.log(5)) / 6, rel=1e-6)
    assert all(isinstance(v, float) for v in m.values())
    loss.backward()
    # d/dlogp of -A r is -A r on unclipped tokens (dr/dlogp = r); 0 where clipped, dual-clipped,
    # A = 0 or masked. Divided by the 6 valid tokens.
    expected = torch.tensor([[0.0, 1.5, 0.0, -0.5], [0.0, 0.0, 0.0, 0.0]]) / 6
    assert_close(logp.grad, expected)
    # without dual clip t10 costs 5: (0.52 + 5) / 6, and clipfrac_lower is 0
    loss_nodual, m2 = policy_loss(old, logp.detach(), adv, mask)
    assert_close(loss_nodual, torch.tensor(5.52 / 6))
    assert m2["clipfrac_lower"] == 0.0


def test_policy_loss_masked_nan_does_not_leak_into_grad():
    old, logp, adv, mask = _hand_policy_batch()
    logp = logp.clone().requires_grad_()
    old = old.clone().requires_grad_()
    adv = adv.clone().requires_grad_()
    loss, m = policy_loss(old, logp, adv, mask, clip_c=3.0, agg="seq-mean-token-mean")
    loss.backward()
    assert torch.isfinite(loss) and all(math.isfinite(v) for v in m.values())
    for t in (logp.grad, old.grad, adv.grad):
        assert torch.isfinite(t).all() and (t[~mask] == 0).all()
    assert_close(old.grad, -logp.grad)


def test_policy_loss_log_ratio_clamp():
    # logp - old = 25 is clamped to 20: r = e^20 (not e^25), and the clamp kills the gradient;
    # at exactly 20 torch's clamp is inclusive and the gradient passes: d(-A r)/dlogp = e^20.
    adv = torch.tensor([[-1.0, -1.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    logp = torch.tensor([[25.0, 20.0]], requires_grad=True)
    loss, m = policy_loss(torch.zeros(1, 2), logp, adv, mask, agg="token-sum")
    assert_close(loss, torch.tensor(2 * math.exp(20.0)))
    assert m["ppo_kl"] == pytest.approx(-20.0)
    loss.backward()
    assert_close(logp.grad, torch.tensor([[0.0, math.exp(20.0)]]))


def test_policy_loss_boundary_ties_follow_torch():
    # Dual-clip tie: A = -1, r = clip_c exactly -> min(clip1, -A clip_c) ties, torch splits the
    # gradient 0.5 / 0.5: d/dlogp = 0.5 * (-A r) + 0.5 * 0 = 0.5 r. Not a dual-clip hit (strict >).
    x = torch.tensor([[math.log(3.0)]])
    r = torch.exp(x).item()  # the float32 ratio; representable, so -A * clip_c == r exactly
    logp = x.clone().requires_grad_()
    loss, m = policy_loss(torch.zeros(1, 1), logp, torch.tensor([[-1.0]]), torch.ones(1, 1, dtype=torch.bool),
                          clip_c=r, agg="token-sum")
    loss.backward()
    assert_close(loss, torch.tensor(r))
    assert_close(logp.grad, torch.tensor([[0.5 * r]]))
    assert m["clipfrac_lower"] == 0.0 and m["clipfrac"] == 0.0
    # Ratio exactly on the clip boundary (clip_low = clip_high = 0, r = 1): max(-A r, -A clamp(r))
    # ties; clamp passes the gradient at its bound, so both halves give -A: total -A.
    logp = torch.zeros(1, 2, requires_grad=True)
    loss, m = policy_loss(torch.zeros(1, 2), logp, torch.tensor([[2.0, -3.0]]), torch.ones(1, 2, dtype=torch.bool),
                          clip_low=0.0, clip_high=0.0, agg="token-sum")
    loss.backward()
    assert_close(logp.grad, torch.tensor([[-2.0, 3.0]]))
    assert m["clipfrac"] == 0.0  # strict inequality: a tie is not clipped


def test_policy_loss_gradcheck_float64():
    g = torch.Generator().manual_seed(0)
    old = torch.randn(3, 5, generator=g, dtype=torch.float64)
    # ratios in (0.3, 3): some clipped, none within 1e-3 of a kink
    delta = torch.empty(3, 5, dtype=torch.float64).uniform_(-1.2, 1.1, generator=g)
    kinks = torch.tensor([math.log(0.8), math.log(1.28), math.log(1.5), 0.0], dtype=torch.float64)  # 1.5 = clip_c
    delta[(delta[..., None] - kinks).abs().min(-1).values < 1e-3] += 0.01
    logp = (old + delta).requires_grad_()
    adv = torch.randn(3, 5, generator=g, dtype=torch.float64)
    mask = torch.rand(3, 5, generator=g) > 0.2
    for agg in LOSS_AGG_MODES:
        def f(lp, agg=agg):
            return policy_loss(old, lp, adv, mask, clip_c=1.5, agg=agg, norm_len=8)[0]
        assert torch.autograd.gradcheck(f, (logp,))


@pytest.mark.parametrize(("seed", "clip_c"), [(0, 3.0), (1, 10.0), (2, None)])
def test_policy_loss_matches_verl_reference(seed, clip_c):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(6, 10, generator=g) - 2
    logp = (old + 0.5 * torch.randn(6, 10, generator=g)).requires_grad_()
    adv = torch.randn(6, 10, generator=g)
    mask = torch.rand(6, 10, generator=g) > 0.25
    loss, m = policy_loss(old, logp, adv, mask, clip_c=clip_c)
    (grad,) = torch.autograd.grad(loss, logp)
    logp_ref = logp.detach().clone().requires_grad_()
    ref = _verl_policy_loss(old, logp_ref, adv, mask.float(), 0.2, 0.28, 1e30 if clip_c is None else clip_c)
    (grad_ref,) = torch.autograd.grad(ref[0], logp_ref)
    assert_close(loss, ref[0])
    assert_close(grad, grad_ref)
    assert m["clipfrac"] == pytest.approx(ref[1].item())
    assert m["ppo_kl"] == pytest.approx(ref[2].item(), rel=1e-5, abs=1e-7)
    assert m["clipfrac_lower"] == pytest.approx(ref[3].item())


def test_policy_loss_errors():
    old, logp, adv, mask = _hand_policy_batch()
    with pytest.raises(AlgoError, match="clip_c"):
        policy_loss(old, logp, adv, mask, clip_c=1.0)
    with pytest.raises(AlgoError, match="shape"):
        policy_loss(old[:, :2], logp, adv, mask)
    with pytest.raises(AlgoError, match="loss_agg_mode"):
        policy_loss(old, logp, adv, mask, agg="mean")


# =============================================================================================
# KL penalty
# =============================================================================================


def test_kl_penalty_hand_worked_values_and_grads():
    # logp = -1, ref = -2: logp - ref = 1. k1 = 1 (grad 1), abs = 1 (grad 1), k2 = 0.5 (grad 1),
    # k3: kl = ref - logp = -1 -> e^-1 + 1 - 1 = 0.3679, grad d/dlogp = 1 - e^kl = 0.6321.
    cases = {"k1": (1.0, 1.0), "kl": (1.0, 1.0), "abs": (1.0, 1.0), "k2": (0.5, 1.0), "mse": (0.5, 1.0),
             "k3": (math.exp(-1), 1 - math.exp(-1)), "low_var_kl": (math.exp(-1), 1 - math.exp(-1))}
    for kind, (value, grad) in cases.items():
        logp = torch.tensor([-1.0], requires_grad=True)
        out = kl_penalty(logp, torch.tensor([-2.0]), kind)
        out.sum().backward()
        assert_close(out, torch.tensor([value]), msg=kind)
        assert_close(logp.grad, torch.tensor([grad]), msg=kind)


def test_kl_penalty_k3_clamps_have_zero_gradient():
    # ref - logp = 2: e^2 - 3 = 4.389 (inside), grad 1 - e^2.  ref - logp = 3: e^3 - 4 = 16.09 ->
    # value clamp 10, grad 0.  -11: e^-11 + 10 > 10 -> clamp 10, grad 0.  25: kl clamp 20, then 10.
    ref = torch.tensor([2.0, 3.0, -11.0, 25.0])
    logp = torch.zeros(4, requires_grad=True)
    out = kl_penalty(logp, ref, "k3")
    out.sum().backward()
    assert_close(out, torch.tensor([math.exp(2) - 3, 10.0, 10.0, 10.0]))
    assert_close(logp.grad, torch.tensor([1 - math.exp(2), 0.0, 0.0, 0.0]))


@pytest.mark.parametrize("base", ["k1", "kl", "abs", "k3", "low_var_kl", "k2", "mse"])
def test_kl_penalty_straight_through(base):
    # "+": forward = base value, gradient = d k2/dlogp = logp - ref, even where k3 is clamped.
    ref = torch.tensor([2.0, 3.0, -0.5, 25.0])
    logp = torch.tensor([0.0, 0.0, 0.7, 0.0], requires_grad=True)
    out = kl_penalty(logp, ref, base + "+")
    assert torch.equal(out.detach(), kl_penalty(logp.detach(), ref, base))
    out.sum().backward()
    assert_close(logp.grad, logp.detach() - ref)


def test_kl_penalty_gradcheck_reference_and_errors():
    g = torch.Generator().manual_seed(0)
    ref = torch.randn(4, 6, generator=g, dtype=torch.float64)
    logp = (ref + torch.randn(4, 6, generator=g, dtype=torch.float64)).requires_grad_()
    for kind in ("k1", "abs", "k2", "k3"):
        assert torch.autograd.gradcheck(lambda lp, kind=kind: kl_penalty(lp, ref, kind), (logp,))
        assert_close(kl_penalty(logp, ref, kind), _verl_kl_penalty(logp, ref, kind))
    assert set(KL_KINDS) >= {"k1+", "k3+", "low_var_kl+"}
    with pytest.raises(AlgoError, match="full"):
        kl_penalty(logp, ref, "full")
    with pytest.raises(AlgoError, match=r"unknown kl_penalty kind 'k4'.*valid: kl, k1"):
        kl_penalty(logp, ref, "k4")


@pytest.mark.parametrize("kind", ["kl", "low_var_kl", "mse"])
def test_kl_in_reward_matches_verl_apply_kl_penalty(kind):
    # verl: token_level_rewards = token_level_scores - beta * kl_penalty(old, ref) * mask, the
    # score sitting on the last valid token; outcome estimators read the row sums of that.
    g = torch.Generator().manual_seed(1)
    rows, width, beta = 6, 5, 0.05
    lengths = torch.tensor([5, 3, 1, 4, 2, 5])
    mask = torch.arange(width)[None, :] < lengths[:, None]
    old, ref = torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)
    old[~mask] = float("nan")  # padding must not leak
    scores = torch.randn(rows, generator=g)
    token_scores = torch.zeros(rows, width)
    token_scores[torch.arange(rows), lengths - 1] = scores
    kld = _verl_kl_penalty(old.nan_to_num(0.0), ref, kind) * mask
    verl_rewards = token_scores - beta * kld
    verl_current = _verl_masked_mean(kld, mask, axis=-1).mean()
    reward, kl_sum, current = algos.kl_in_reward(scores.numpy(), old, ref, mask, kind, beta)
    assert_close(torch.from_numpy(reward), verl_rewards.sum(-1), rtol=1e-5, atol=1e-6)
    assert_close(torch.from_numpy(kl_sum), kld.sum(-1), rtol=1e-5, atol=1e-6)
    assert current == pytest.approx(float(verl_current), rel=1e-5)
    with pytest.raises(AlgoError, match="coef"):
        algos.kl_in_reward(scores.numpy(), old, ref, mask, kind, -1.0)
    with pytest.raises(AlgoError, match="scores for"):
        algos.kl_in_reward(scores.numpy()[:2], old, ref, mask, kind, beta)


def test_adaptive_kl_coef_is_verl_controller():
    # verl AdaptiveKLController: error = clip(current/target - 1, -0.2, 0.2); coef *= 1 + error * n / horizon
    assert algos.adaptive_kl_coef(0.1, 0.15, target_kl=0.1, horizon=100, n_steps=10) == pytest.approx(0.1 * 1.02)
    assert algos.adaptive_kl_coef(0.1, 0.0, target_kl=0.1, horizon=100, n_steps=10) == pytest.approx(0.1 * 0.98)
    assert algos.adaptive_kl_coef(0.1, 0.1, target_kl=0.1, horizon=100, n_steps=10) == pytest.approx(0.1)
    with pytest.raises(AlgoError, match="target_kl"):
        algos.adaptive_kl_coef(0.1, 0.1, target_kl=0.0, horizon=100, n_steps=10)


# =============================================================================================
# Properties (hypothesis)
# =============================================================================================

_scores = hnp.arrays(  # a few values, so constant groups and ties are common
    np.float32, st.integers(1, 40), elements=st.sampled_from([np.float32(v) for v in (-1, 0, 0.5, 0.7, 1, 2.3)])
)


@PROPS
@given(scores=_scores, data=st.data())
def test_prop_permuting_rows_permutes_outputs(scores, data):
    n = scores.shape[0]
    ids = np.array(data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n)))
    lengths = np.array(data.draw(st.lists(st.integers(1, 9), min_size=n, max_size=n)))
    perm = np.array(data.draw(st.permutations(range(n))))
    for est in ("grpo", "rloo", "opo", "reinforce_pp_baseline"):
        if est == "reinforce_pp_baseline" and lengths.sum() < 2:
            continue
        a = sequence_advantages(scores, ids, est, lengths=lengths)
        b = sequence_advantages(scores[perm], ids[perm], est, lengths=lengths[perm])
        assert_close(b, a[perm], rtol=1e-5, atol=1e-5)
    assert np.array_equal(keep_groups(ids[perm], scores[perm]), keep_groups(ids, scores)[perm])


@PROPS
@given(scores=_scores, data=st.data())
def test_prop_group_advantages_sum_to_zero_and_keep_is_constant(scores, data):
    n = scores.shape[0]
    ids = np.array(data.draw(st.lists(st.sampled_from(["a", "b", "c", "d"]), min_size=n, max_size=n)))
    codes, n_groups = factorize(ids)
    sizes = np.bincount(codes, minlength=n_groups)
    keep = keep_groups(ids, scores)
    for est in ("grpo", "rloo"):
        adv = sequence_advantages(scores, ids, est).astype(np.float64)
        sums = np.bincount(codes, weights=adv, minlength=n_groups)
        assert np.allclose(sums[sizes > 1], 0.0, atol=1e-4)
    for g in range(n_groups):
        in_g = codes == g
        assert keep[in_g].all() or not keep[in_g].any()
        assert keep[in_g][0] == (in_g.sum() == 1 or len(set(scores[in_g].tolist())) > 1)


@PROPS
@given(
    data=st.data(),
    rows=st.integers(2, 8),
    width=st.integers(1, 6),
    mode=st.sampled_from(LOSS_AGG_MODES),
)
def test_prop_micro_batches_add_up_to_mini_batch(data, rows, width, mode):
    loss = torch.tensor(data.draw(hnp.arrays(np.float32, (rows, width), elements=st.floats(-3, 3, width=32))))
    mask = torch.tensor(data.draw(hnp.arrays(np.bool_, (rows, width))))
    mask[0, 0] = True
    split = data.draw(st.integers(1, rows - 1))
    totals = {"num_tokens": int(mask.sum()), "num_seqs": rows, "norm_len": 7}
    whole = agg_loss(loss, mask, mode, **totals)
    parts = agg_loss(loss[:split], mask[:split], mode, **totals) + agg_loss(loss[split:], mask[split:], mode, **totals)
    assert_close(parts, whole, rtol=1e-5, atol=1e-5)
    if mode != "token-sum":  # without totals this batch is its own mini-batch
        kw = {"norm_len": 7}
        assert_close(agg_loss(loss, mask, mode, **kw), whole, rtol=1e-5, atol=1e-5)


@PROPS
@given(scores=_scores, data=st.data())
def test_prop_groups_object_reuse_matches_raw_ids(scores, data):
    n = scores.shape[0]
    ids = data.draw(st.lists(st.sampled_from(["x", "y", "z"]), min_size=n, max_size=n))
    g = factorize(ids)
    assert isinstance(g, Groups)
    assert np.array_equal(sequence_advantages(scores, g, "grpo"), sequence_advantages(scores, ids, "grpo"))
    assert np.array_equal(keep_groups(g, scores), keep_groups(ids, scores))


# --------------------------------------------------------------------------- pass@k


def test_pass_at_k_hand_worked():
    # one prompt, 4 samples, 1 correct: pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    assert algos.pass_at_k(["a"] * 4, [1, 0, 0, 0], 2) == pytest.approx(0.5)
    # pass@1 is the accuracy; pass@n is "any correct" per prompt: (1 + 0) / 2
    ids, ok = ["a"] * 4 + ["b"] * 4, [1, 0, 1, 0, 0, 0, 0, 0]
    assert algos.pass_at_k(ids, ok, 1) == pytest.approx(0.25)
    assert algos.pass_at_k(ids, ok, 4) == pytest.approx(0.5)
    # fewer than k wrong samples: certain success; prompts with < k samples are left out
    assert algos.pass_at_k(["a"] * 4 + ["b"], [1, 1, 0, 1, 0], 2) == pytest.approx(1.0)
    with pytest.raises(AlgoError, match="at least 5 samples"):
        algos.pass_at_k(ids, ok, 5)
    with pytest.raises(AlgoError, match="k must be"):
        algos.pass_at_k(ids, ok, 0)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_prop_pass_at_k_equals_the_codex_estimator(data):
    groups = data.draw(st.lists(st.tuples(st.integers(1, 12), st.integers(0, 12)), min_size=1, max_size=6))
    k = data.draw(st.integers(1, 12))
    ids, ok, per_prompt = [], [], []
    for i, (n, c) in enumerate(groups):
        c = min(c, n)
        ids += [i] * n
        ok += [1.0] * c + [0.0] * (n - c)
        if n >= k:  # the numerically stable form from the Codex paper
            per_prompt.append(1.0 if n - c < k else 1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))
    if not per_prompt:
        with pytest.raises(AlgoError):
            algos.pass_at_k(ids, ok, k)
    else:
        assert algos.pass_at_k(ids, ok, k) == pytest.approx(np.mean(per_prompt), abs=1e-12)
