"""Outcome advantages: the estimator table (:data:`ESTIMATORS`), per-sequence
(:func:`sequence_advantages`) and token-level (:func:`outcome_advantages`) entry points."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from dapo_flow.algos.errors import AlgoError, bad_choice
from dapo_flow.algos.groups import (
    GroupIds,
    Groups,
    _as_numpy,
    _constant_groups,
    _groups_for,
    Segments,
)
from dapo_flow.algos.masked import (
    _WHITEN_EPS,
    _as_bool,
    _check_pair,
    _row_counts,
    masked_whiten,
)

from dapo_flow.algos.value import gae, remax_advantages

GRPO_EPS = 1e-6  # verl's `epsilon` of the GRPO-family estimators


# Each estimator maps float64 scores (batch,) to float64 advantages (batch,). Group quantities
# are formed in group space (n_groups,) and gathered back once with `[seg.codes]`.


def _adv_grpo(s: np.ndarray, seg: Segments, norm_by_std: bool, lengths: np.ndarray | None) -> np.ndarray:
    dev = s - seg.mean(s, lone=0.0)[seg.codes]  # verl: a lone sequence uses mean 0 ...
    if not norm_by_std:  # Dr.GRPO: centre only
        return dev
    std = np.sqrt(seg.sum(dev * dev) / np.maximum(seg.counts - 1, 1))  # unbiased, as torch.std
    denom = np.where(seg.counts == 1, 1.0, std) + GRPO_EPS  # ... and std 1: adv = s / (1 + 1e-6)
    return dev / denom[seg.codes]


def _adv_rloo(s: np.ndarray, seg: Segments, norm_by_std: bool, lengths: np.ndarray | None) -> np.ndarray:
    # s_i - mean_{j != i} s_j == (s_i - mean) * n / (n - 1); a lone sequence keeps its score.
    scale = np.where(seg.counts == 1, 1.0, seg.counts / np.maximum(seg.counts - 1, 1))
    return (s - seg.mean(s, lone=0.0)[seg.codes]) * scale[seg.codes]


def _adv_reinforce_pp_baseline(
    s: np.ndarray, seg: Segments, norm_by_std: bool, lengths: np.ndarray | None
) -> np.ndarray:
    assert lengths is not None
    centred = s - seg.mean(s, lone=0.0)[seg.codes]  # verl: a lone sequence uses mean 0
    # verl whitens the broadcast (batch, resp_len) tensor over valid tokens; a sequence with
    # L valid tokens contributes its value L times, so weight the per-sequence vector by L.
    w = lengths.astype(np.float64)
    n_tok = w.sum()
    if n_tok < 2:
        raise AlgoError(f"whitening needs at least 2 valid tokens, got {n_tok:g}")
    mu = (w * centred).sum() / n_tok
    var = (w * (centred - mu) ** 2).sum() / (n_tok - 1)  # unbiased (Bessel), as verl_F.masked_var
    return (centred - mu) / np.sqrt(var + _WHITEN_EPS)


def _adv_opo(s: np.ndarray, seg: Segments, norm_by_std: bool, lengths: np.ndarray | None) -> np.ndarray:
    assert lengths is not None
    w = lengths.astype(np.float64)
    tokens = seg.sum(w)
    # Length-weighted group baseline; lone sequences (and groups with no valid token) use 0.
    baseline = np.divide(seg.sum(w * s), tokens, out=np.zeros(seg.n_groups), where=(tokens > 0) & (seg.counts > 1))
    return s - baseline[seg.codes]


def _adv_grpo_passk(s: np.ndarray, seg: Segments, norm_by_std: bool, lengths: np.ndarray | None) -> np.ndarray:
    if seg.n_groups and seg.counts.min() < 2:
        raise AlgoError(f"grpo_passk needs >= 2 samples per group, got a group of {int(seg.counts.min())}")
    # Sort by (group, score): each group's best is its last row, the runner-up the one before.
    order = np.lexsort((s, seg.codes))
    ends = np.cumsum(seg.counts.astype(np.int64))
    best, runner_up = order[ends - 1], order[ends - 2]
    gap = s[best] - s[runner_up]  # 0 on a tie for best, so tie-breaking does not matter
    if norm_by_std:
        dev = s - seg.mean(s)[seg.codes]
        gap = gap / (np.sqrt(seg.sum(dev * dev) / (seg.counts - 1)) + GRPO_EPS)
    adv = np.zeros_like(s)
    adv[best] = gap
    return adv


def _sequence_advantages64(
    scores: np.ndarray, g: Groups, estimator: str, norm_by_std: bool, lengths: np.ndarray | None
) -> np.ndarray:
    """The one implementation behind both advantage entry points. float64, Shape: (batch,)."""
    if not np.isfinite(scores).all():
        raise AlgoError("scores contain NaN or inf")
    s = scores.astype(np.float64, copy=False)
    seg = Segments.of(g)
    adv = ESTIMATORS[estimator].sequence(s, seg, norm_by_std, lengths)
    # dapo-flow: a constant group of >= 2 gets exactly 0, not verl's one-ulp noise. For float32
    # (or integer) scores the float64 group sums above are exact, so the centring already yields
    # exact zeros for grpo / rloo / grpo_passk; other inputs get the explicit exact check.
    # reinforce_pp_baseline is excluded: its batch whitening shifts every row.
    float32_exact = scores.dtype.kind in "biu" or scores.dtype.itemsize <= 4
    if estimator == "opo" or (estimator != "reinforce_pp_baseline" and not float32_exact):
        constant = _constant_groups(seg, s) & (seg.counts > 1)
        adv[constant[seg.codes]] = 0.0
    return adv


def sequence_advantages(
    scores: np.ndarray | Sequence[float] | Tensor,
    group_ids: GroupIds,
    estimator: str,
    *,
    norm_by_std: bool = True,
    lengths: np.ndarray | Sequence[int] | Tensor | None = None,
) -> np.ndarray:
    """Per-sequence outcome advantage, for operators working on one row per sequence.

    Same math as :func:`outcome_advantages` (shared code) before the broadcast over tokens:
    ``outcome_advantages(...)[i, t] == sequence_advantages(...)[i] * mask[i, t]``.
    Estimators: grpo, rloo, reinforce_pp_baseline, grpo_passk, opo. "reinforce_pp" discounts
    per token and is token-level only. "reinforce_pp_baseline" (batch whitening over valid
    tokens) and "opo" (length-weighted baseline) need ``lengths`` = valid response tokens per
    sequence. ``norm_by_std`` applies to grpo / grpo_passk (False = Dr.GRPO).

    Shape: scores (batch,), lengths (batch,) -> (batch,) float32.
    """
    if estimator not in ESTIMATORS:
        raise bad_choice("estimator", estimator, [k for k, e in ESTIMATORS.items() if e.sequence is not None])
    if ESTIMATORS[estimator].sequence is None:
        raise AlgoError(f"{estimator!r} is token-level (it discounts per token); use outcome_advantages")
    s = _as_numpy(scores, "scores")
    g = _groups_for(group_ids, s.shape[0])
    lens = None
    if ESTIMATORS[estimator].needs_lengths:
        if lengths is None:
            raise AlgoError(f"estimator {estimator!r} needs `lengths` (valid response tokens per sequence)")
        lens = _as_numpy(lengths, "lengths")
        if lens.shape != s.shape:
            raise AlgoError(f"lengths shape {lens.shape} != scores shape {s.shape}")
    return _sequence_advantages64(s, g, estimator, norm_by_std, lens).astype(np.float32)


def outcome_advantages(
    token_rewards: Tensor,
    mask: Tensor,
    group_ids: GroupIds,
    estimator: str,
    *,
    norm_by_std: bool = True,
    gamma: float = 1.0,
    out: Tensor | None = None,
) -> Tensor:
    """Token-level outcome advantages (verl's ``compute_*_outcome_advantage``), without gradient.

    score = sum of a row's token rewards over ALL positions; the per-sequence advantage
    (:func:`sequence_advantages` math) is broadcast over the row and masked: padding and
    all-masked rows get 0. "reinforce_pp" instead whitens the discounted return-to-go (``gamma``)
    over valid tokens and ignores ``group_ids``. ``out`` (optional, same shape/dtype as
    ``token_rewards``) receives the result, avoiding a fresh allocation.

    Shape: token_rewards (batch, resp_len), mask (batch, resp_len) bool/int/float,
    group_ids (batch,) -> (batch, resp_len), dtype of token_rewards.
    """
    if estimator not in ESTIMATORS:
        raise bad_choice("estimator", estimator, ESTIMATORS)
    _check_pair(token_rewards, mask, "token_rewards", "mask")
    if not token_rewards.is_floating_point():
        raise AlgoError(f"token_rewards must be floating point, got {token_rewards.dtype}")
    if not 0.0 <= gamma <= 1.0:
        raise AlgoError(f"gamma must be in [0, 1], got {gamma}")
    if out is not None and (out.shape != token_rewards.shape or out.dtype != token_rewards.dtype):
        raise AlgoError(f"out must have shape {tuple(token_rewards.shape)} and dtype {token_rewards.dtype}")
    if ESTIMATORS[estimator].with_input is not None:
        raise AlgoError(f"estimator {estimator!r} also needs {ESTIMATORS[estimator].reads!r}, which "
                        "outcome_advantages does not take: call it from algos (e.g. algos.gae)")
    with torch.no_grad():
        token_fn = ESTIMATORS[estimator].token
        if token_fn is not None:
            adv_tok = token_fn(token_rewards, mask, gamma)[0]
            return adv_tok if out is None else out.copy_(adv_tok)
        rewards = token_rewards.detach()
        if out is None:
            out = torch.empty_like(rewards)
        g = _groups_for(group_ids, rewards.shape[0])
        # Row sums as a matrix-vector product: one bandwidth-bound read of the rewards.
        if rewards.dtype not in (torch.float32, torch.float64):
            scores = rewards.sum(dim=-1, dtype=torch.float32)  # numpy has no bfloat16
        elif rewards.shape[1] and rewards.is_contiguous():
            scores = torch.mv(rewards, rewards.new_ones(rewards.shape[1]))
        else:
            scores = rewards.sum(dim=-1)
        lengths = _row_counts(mask).cpu().numpy() if ESTIMATORS[estimator].needs_lengths else None
        adv64 = _sequence_advantages64(scores.cpu().numpy(), g, estimator, norm_by_std, lengths)
        adv = torch.from_numpy(adv64).to(device=rewards.device, dtype=rewards.dtype)
        return _broadcast_masked(adv, mask, out)


def _broadcast_masked(adv: Tensor, mask: Tensor, out: Tensor) -> Tensor:
    """out[i, t] = adv[i] where mask[i, t] else 0. Shape: (batch,) -> (batch, T)."""
    column = adv[:, None]
    if mask.dtype == torch.bool:
        return torch.where(mask, column, column.new_zeros(()), out=out)
    if mask.dtype == out.dtype:
        return torch.mul(mask, column, out=out)  # verl: adv * mask (same-dtype mul is vectorised)
    return torch.where(mask != 0, column, column.new_zeros(()), out=out)


def reinforce_pp_advantages(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (verl ``compute_reinforce_plus_plus_outcome_advantage``, current multi-turn rule):
    the discounted return-to-go of the token rewards, whitened over the batch's valid tokens.

    Mask-0 positions inside a response (tool / observation tokens) carry the running return
    through unchanged, neither reset nor discounted: γ discounts valid tokens only, and their
    rewards are ignored. Advantages and returns are 0 at mask-0 positions. Without gradient.
    Shape: token_rewards, mask (batch, resp_len) -> advantages, returns (batch, resp_len).
    """
    _check_pair(token_rewards, mask, "token_rewards", "mask")
    if not 0.0 <= gamma <= 1.0:
        raise AlgoError(f"gamma must be in [0, 1], got {gamma}")
    with torch.no_grad():
        valid = _as_bool(mask)
        rewards = token_rewards.detach()
        returns = torch.zeros_like(rewards)
        running = rewards.new_zeros(rewards.shape[0])
        for t in reversed(range(rewards.shape[1])):  # over time steps, vectorised over the batch
            running = torch.where(valid[:, t], rewards[:, t] + gamma * running, running)
            returns[:, t] = running
        returns = torch.where(valid, returns, 0.0)
        return torch.where(valid, masked_whiten(returns, valid), 0.0), returns


SequenceFn = Callable[[np.ndarray, Segments, bool, "np.ndarray | None"], np.ndarray]


TokenFn = Callable[[Tensor, Tensor, float], "tuple[Tensor, Tensor]"]


#: (token_rewards (batch, T), input, mask (batch, T), gamma, lam) -> (advantages, returns) (batch, T)
InputFn = Callable[[Tensor, Tensor, Tensor, float, float], "tuple[Tensor, Tensor]"]


def _gae(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    return gae(token_rewards, values, mask, gamma=gamma, lam=lam)


def _remax(token_rewards: Tensor, baselines: Tensor, mask: Tensor, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    return remax_advantages(token_rewards, baselines, mask)


def _no_outcome(token_rewards: Tensor, mask: Tensor, gamma: float) -> tuple[Tensor, Tensor]:
    """No outcome advantage (zeros): the signal is elsewhere (distillation's teacher, added by
    the `advantage` operator's distill_coef). Shape: (batch, T) -> (batch, T) twice."""
    zeros = torch.zeros_like(token_rewards)
    return zeros, zeros


class Estimator(NamedTuple):
    """One advantage estimator: what it computes, and how (exactly one of the two functions)."""

    doc: str
    sequence: SequenceFn | None = None  # (scores, groups, norm_by_std, lengths) -> advantages (batch,)
    needs_lengths: bool = False  # `sequence` needs the valid response tokens per sequence
    token: TokenFn | None = None  # (token_rewards, mask, gamma) -> (advantages, returns) (batch, T)
    with_input: InputFn | None = None  # token-level from the rewards and one more column, `reads`
    reads: str | None = None  # that column: "values" (per token, a critic's) or "baseline" (per sequence)
    needs_reward: bool = True  # False: no outcome at all (distillation alone: the teacher is the signal)
    #: which rows one row's advantage reads: "group" (its prompt group's: computed on any share of
    #: whole groups alike), "batch" (whitened over the batch), "row" (its own alone)
    scope: str = "batch"


#: Every advantage estimator, in the order docs list them: the `advantage` operator's choices and
#: the names :func:`sequence_advantages` / :func:`outcome_advantages` accept come from here.
ESTIMATORS: dict[str, Estimator] = {
    "grpo": Estimator("(r - group mean) / (group std + 1e-6); `norm_by_std: false` centres only (Dr.GRPO)",
                      _adv_grpo, scope="group"),
    "rloo": Estimator("r - mean of the other samples of the group (leave-one-out)", _adv_rloo,
                      scope="group"),
    "reinforce_pp_baseline": Estimator("r - group mean, whitened over the batch's valid tokens",
                                       _adv_reinforce_pp_baseline, needs_lengths=True),
    "reinforce_pp": Estimator("REINFORCE++: discounted return-to-go of the token rewards (`gamma`), whitened "
                              "over valid tokens; token-level, no groups", token=reinforce_pp_advantages),
    "grpo_passk": Estimator("pass@k: only each group's best sample gets its gap to the runner-up (n >= 2)",
                            _adv_grpo_passk, scope="group"),
    "opo": Estimator("r - length-weighted group mean (optimal baseline)", _adv_opo, needs_lengths=True,
                     scope="group"),
    "gae": Estimator("PPO's GAE over a critic's per-token `values` (from a `values` node; `gamma`, `lam`), "
                     "whitened over the batch's valid tokens; token-level, no groups", with_input=_gae,
                     reads="values"),
    "remax": Estimator("ReMax: reward-to-go minus the `baseline` reward (the greedy response's, joined by a "
                       "`baseline` node); token-level, no groups, not whitened", with_input=_remax, reads="baseline"),
    "distill": Estimator("on-policy distillation alone: no reward, the advantage is `distill_coef` x (teacher_logp - "
                         "old_logp) per sampled token (algos.distill); token-level", token=_no_outcome,
                         needs_reward=False),
}
#: The built-in estimators of :func:`sequence_advantages` (the token-level ones discount per token);
#: code that must see estimators registered later reads ESTIMATORS itself.
SEQUENCE_ESTIMATORS: tuple[str, ...] = tuple(k for k, e in ESTIMATORS.items() if e.sequence is not None)
#: Estimators whose advantage differs per token (the `advantage` operator emits token_advantage).
TOKEN_ESTIMATORS: tuple[str, ...] = tuple(k for k, e in ESTIMATORS.items() if e.sequence is None)
