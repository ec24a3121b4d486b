"""Pure math of DAPO / GRPO: advantages, policy loss, KL, loss aggregation, overlong shaping,
dynamic-sampling keep mask.

Semantics follow verl 0.9 (`verl/trainer/ppo/core_algos.py`, `verl/utils/torch_functional.py`,
`verl/workers/reward_manager/dapo.py`) to float32 precision, values and gradients; see
`shared/reference/dapo-semantics.md`. Deliberate improvements over verl:

- a group of >= 2 sequences whose scores are all exactly equal gets advantage exactly 0
  (verl's float32 group mean can be one ulp off and then yields noise of |adv| ~ 0.05);
- NaN/inf at masked positions never reaches a value or a gradient (``torch.where``, not ``x * mask``);
- bad input raises :class:`AlgoError` with the valid choices, instead of NaN or a bare assert.

Group statistics never loop over rows or groups in Python: ids are factorized once into dense
integer codes (:func:`factorize`), then every per-group quantity is a segment reduction
(``np.bincount``) on the small per-sequence vector, and token tensors are touched by at most one
read (row sums) and one fused broadcast write.

Only torch, numpy, polars and numba (:mod:`dapo_flow.algos.kernels`) are used here: no Ray, Arrow
or MLflow.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple, TypeAlias

import numpy as np
import polars as pl
import torch
from torch import Tensor

from dapo_flow.errors import DapoFlowError
from dapo_flow.algos.kernels import grpo_token_advantages, masked_broadcast, new_output

__all__ = [
    "AlgoError",
    "ESTIMATORS",
    "GRPO_EPS",
    "Groups",
    "KL_KINDS",
    "LOSS_AGG_MODES",
    "SEQUENCE_ESTIMATORS",
    "adaptive_kl_coef",
    "agg_loss",
    "entropy_from_logits",
    "factorize",
    "keep_groups",
    "kl_in_reward",
    "kl_penalty",
    "logprobs_from_logits",
    "masked_mean",
    "masked_whiten",
    "outcome_advantages",
    "overlong_penalty",
    "policy_loss",
    "sequence_advantages",
]


class AlgoError(DapoFlowError, ValueError):
    """Bad input to an algorithm function (unknown mode, all-masked batch, shape mismatch, ...).

    A DapoFlowError, so a run that reaches one (e.g. an update fed an empty batch) ends with
    the message and exit 2, not a traceback; still a ValueError for callers of the math."""


LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
_KL_BASE_KINDS: tuple[str, ...] = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
#: Every accepted `kind` of :func:`kl_penalty`; "+" = value of the base kind, gradient of k2.
KL_KINDS: tuple[str, ...] = _KL_BASE_KINDS + tuple(k + "+" for k in _KL_BASE_KINDS)
#: Estimators of :func:`outcome_advantages`.
ESTIMATORS: tuple[str, ...] = (
    "grpo",
    "rloo",
    "reinforce_pp_baseline",
    "reinforce_pp",
    "grpo_passk",
    "opo",
)
#: Estimators of :func:`sequence_advantages` (reinforce_pp discounts per token: token-level only).
SEQUENCE_ESTIMATORS: tuple[str, ...] = tuple(e for e in ESTIMATORS if e != "reinforce_pp")
_NEEDS_LENGTHS: frozenset[str] = frozenset({"reinforce_pp_baseline", "opo"})

GRPO_EPS = 1e-6  # verl's `epsilon` of the GRPO-family estimators
_MEAN_EPS = 1e-8  # verl_F.masked_mean denominator epsilon
_WHITEN_EPS = 1e-8  # verl_F.masked_whiten: rsqrt(var + 1e-8)
_LOG_RATIO_CLAMP = 20.0  # policy-loss log-ratio and k3 clamp
_K3_CLAMP = 10.0  # low_var_kl value clamp
_LOGSUMEXP_CHUNK = 1 << 24  # elements per logsumexp chunk: bounds the exp() temporary to 64 MiB


def _bad_choice(what: str, value: object, valid: Sequence[str]) -> AlgoError:
    hint = difflib.get_close_matches(str(value), valid, n=1)
    did_you_mean = f" (did you mean {hint[0]!r}?)" if hint else ""
    return AlgoError(f"unknown {what} {value!r}{did_you_mean}; valid: {', '.join(valid)}")


# --------------------------------------------------------------------------------------------
# Group ids -> dense codes
# --------------------------------------------------------------------------------------------


class Groups(NamedTuple):
    """Dense group codes: ``codes[i]`` in ``[0, n_groups)``; equal ids <=> equal codes.

    Returned by :func:`factorize`; every function taking ``group_ids`` also accepts a ``Groups``
    (no re-factorizing), so an operator can factorize a batch once and reuse it.
    """

    codes: np.ndarray  # int64, Shape: (batch,)
    n_groups: int


GroupIds: TypeAlias = Groups | Sequence[Hashable] | np.ndarray | pl.Series | Tensor


def factorize(group_ids: GroupIds) -> Groups:
    """Map group ids (str or int; list, numpy, polars, torch or Arrow array) to dense codes.

    Codes are assigned by value, not position; their order is unspecified. Strings go through a
    polars Categorical cast (one hash pass, no string sort), integers through a dense remap or
    ``np.unique``.
    Shape: (batch,) -> codes (batch,).
    """
    if isinstance(group_ids, Groups):
        return group_ids
    if isinstance(group_ids, Tensor):
        group_ids = group_ids.detach().cpu().numpy()
    if isinstance(group_ids, np.ndarray):
        if group_ids.ndim != 1:
            raise AlgoError(f"group ids must be 1-D, got shape {group_ids.shape}")
        kind = group_ids.dtype.kind
        if kind in "biu":
            return _factorize_ints(group_ids)
        if kind == "f":
            return _factorize_floats(group_ids)
        if kind in "US":
            return _factorize_series(pl.Series(group_ids.astype(str), dtype=pl.String))
        if kind == "O":
            try:  # the common case: Python str objects (Arrow `to_numpy`, verl's uid array)
                return _factorize_series(pl.Series(group_ids, dtype=pl.String))
            except (TypeError, pl.exceptions.PolarsError):
                group_ids = group_ids.tolist()  # ints as objects; polars infers the type
        else:
            raise AlgoError(f"unsupported group id dtype {group_ids.dtype}")
    if isinstance(group_ids, pl.Series):
        return _factorize_series(group_ids)
    try:  # lists, tuples, pyarrow (Chunked)Arrays, ...
        series = pl.Series(group_ids)
    except (TypeError, ValueError, pl.exceptions.PolarsError) as e:
        raise AlgoError(f"group ids must be all str or all int: {e}") from e
    return _factorize_series(series)


def _factorize_series(s: pl.Series) -> Groups:
    if s.len() == 0:
        return Groups(np.zeros(0, np.int64), 0)
    if s.null_count():
        raise AlgoError(f"group ids contain {s.null_count()} null(s)")
    dtype = s.dtype
    if dtype == pl.Boolean or dtype.is_integer():
        return _factorize_ints(s.to_numpy())
    if dtype.is_float():
        return _factorize_floats(s.to_numpy())
    if dtype == pl.Categorical or isinstance(dtype, pl.Enum):
        s, dtype = s.cast(pl.String), pl.String
    if dtype != pl.String:
        raise AlgoError(f"group ids must be str or int, got polars dtype {dtype}")
    if hasattr(pl, "Categories"):  # polars >= 1.32
        # A fresh (unnamed, garbage-collected) category set numbers strings 0, 1, ... by first
        # appearance: dense codes by value from one hash pass, and no global string cache growth.
        codes = s.cast(pl.Categorical(pl.Categories.random())).to_physical().to_numpy().astype(np.int64)
        return Groups(codes, int(codes.max()) + 1)
    categories = s.unique()  # Enum physical codes index `categories`
    codes = s.cast(pl.Enum(categories)).to_physical().to_numpy().astype(np.int64)
    return Groups(codes, len(categories))


def _factorize_ints(ids: np.ndarray) -> Groups:
    ids = ids.astype(np.int64, copy=False)
    if ids.size == 0:
        return Groups(np.zeros(0, np.int64), 0)
    lo, hi = int(ids.min()), int(ids.max())
    span = hi - lo + 1
    if span <= 4 * ids.size + 1024:  # compact range (e.g. already-dense codes): O(n + span)
        shifted = ids - lo
        present = np.zeros(span, np.int64)
        present[shifted] = 1
        remap = np.cumsum(present) - 1
        return Groups(remap[shifted], int(remap[-1]) + 1)
    uniq, codes = np.unique(ids, return_inverse=True)
    return Groups(codes.astype(np.int64, copy=False), len(uniq))


def _factorize_floats(ids: np.ndarray) -> Groups:
    if np.isnan(ids).any():
        raise AlgoError("group ids contain NaN")
    uniq, codes = np.unique(ids, return_inverse=True)
    return Groups(codes.astype(np.int64, copy=False), len(uniq))


def _groups_for(group_ids: GroupIds, n: int) -> Groups:
    groups = factorize(group_ids)
    if groups.codes.shape != (n,):
        raise AlgoError(f"got {groups.codes.shape[0]} group ids for {n} sequences")
    return groups


# --------------------------------------------------------------------------------------------
# Segment reductions shared by every group statistic
# --------------------------------------------------------------------------------------------


class _Segments(NamedTuple):
    """Groups plus their sizes, computed once per call. Reductions are np.bincount (float64)."""

    codes: np.ndarray  # int64, Shape: (batch,)
    n_groups: int
    counts: np.ndarray  # float64, Shape: (n_groups,)

    @classmethod
    def of(cls, g: Groups) -> _Segments:
        return cls(g.codes, g.n_groups, np.bincount(g.codes, minlength=g.n_groups).astype(np.float64))

    def sum(self, weights: np.ndarray) -> np.ndarray:
        """Per-group sum. Shape: (batch,) -> (n_groups,)."""
        return np.bincount(self.codes, weights=weights, minlength=self.n_groups)

    def mean(self, values: np.ndarray, lone: float | None = None) -> np.ndarray:
        """Per-group mean; `lone` replaces it for singleton groups. Shape: (batch,) -> (n_groups,)."""
        mean = self.sum(values) / np.maximum(self.counts, 1)
        return mean if lone is None else np.where(self.counts == 1, lone, mean)


def _constant_groups(seg: _Segments, values: np.ndarray) -> np.ndarray:
    """True for groups whose values are all exactly equal (singletons included).

    Exact for any dtype: compares every member with one representative member, no arithmetic.
    Shape: values (batch,) -> (n_groups,).
    """
    representative = np.zeros(seg.n_groups, np.int64)
    representative[seg.codes] = np.arange(seg.codes.size)  # whichever write wins is a member
    differs = values != values[representative][seg.codes]
    return seg.sum(differs) == 0


# Each estimator maps float64 scores (batch,) to float64 advantages (batch,). Group quantities
# are formed in group space (n_groups,) and gathered back once with `[seg.codes]`.


def _adv_grpo(s: np.ndarray, seg: _Segments, norm_by_std: bool, lengths: np.ndarray | None) -> np.ndarray:
    dev = s - seg.mean(s, lone=0.0)[seg.codes]  # verl: a lone sequence uses mean 0 ...
    if not norm_by_std:  # Dr.GRPO: centre only
        return dev
    std = np.sqrt(seg.sum(dev * dev) / np.maximum(seg.counts - 1, 1))  # unbiased, as torch.std
    denom = np.where(seg.counts == 1, 1.0, std) + GRPO_EPS  # ... and std 1: adv = s / (1 + 1e-6)
    return dev / denom[seg.codes]


def _adv_rloo(s: np.ndarray, seg: _Segments, norm_by_std: bool, lengths: np.ndarray | None) -> np.ndarray:
    # s_i - mean_{j != i} s_j == (s_i - mean) * n / (n - 1); a lone sequence keeps its score.
    scale = np.where(seg.counts == 1, 1.0, seg.counts / np.maximum(seg.counts - 1, 1))
    return (s - seg.mean(s, lone=0.0)[seg.codes]) * scale[seg.codes]


def _adv_reinforce_pp_baseline(
    s: np.ndarray, seg: _Segments, norm_by_std: bool, lengths: np.ndarray | None
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


def _adv_opo(s: np.ndarray, seg: _Segments, norm_by_std: bool, lengths: np.ndarray | None) -> np.ndarray:
    assert lengths is not None
    w = lengths.astype(np.float64)
    tokens = seg.sum(w)
    # Length-weighted group baseline; lone sequences (and groups with no valid token) use 0.
    baseline = np.divide(seg.sum(w * s), tokens, out=np.zeros(seg.n_groups), where=(tokens > 0) & (seg.counts > 1))
    return s - baseline[seg.codes]


def _adv_grpo_passk(s: np.ndarray, seg: _Segments, norm_by_std: bool, lengths: np.ndarray | None) -> np.ndarray:
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


_SEQUENCE_ESTIMATOR_FNS: dict[str, Callable[[np.ndarray, _Segments, bool, np.ndarray | None], np.ndarray]] = {
    "grpo": _adv_grpo,
    "rloo": _adv_rloo,
    "reinforce_pp_baseline": _adv_reinforce_pp_baseline,
    "grpo_passk": _adv_grpo_passk,
    "opo": _adv_opo,
}
assert tuple(_SEQUENCE_ESTIMATOR_FNS) == SEQUENCE_ESTIMATORS


def _sequence_advantages64(
    scores: np.ndarray, g: Groups, estimator: str, norm_by_std: bool, lengths: np.ndarray | None
) -> np.ndarray:
    """The one implementation behind both advantage entry points. float64, Shape: (batch,)."""
    if not np.isfinite(scores).all():
        raise AlgoError("scores contain NaN or inf")
    s = scores.astype(np.float64, copy=False)
    seg = _Segments.of(g)
    adv = _SEQUENCE_ESTIMATOR_FNS[estimator](s, seg, norm_by_std, lengths)
    # dapo-flow: a constant group of >= 2 gets exactly 0, not verl's one-ulp noise. For float32
    # (or integer) scores the float64 group sums above are exact, so the centring already yields
    # exact zeros for grpo / rloo / grpo_passk; other inputs get the explicit exact check.
    # reinforce_pp_baseline is excluded: its batch whitening shifts every row.
    float32_exact = scores.dtype.kind in "biu" or scores.dtype.itemsize <= 4
    if estimator == "opo" or (estimator != "reinforce_pp_baseline" and not float32_exact):
        constant = _constant_groups(seg, s) & (seg.counts > 1)
        adv[constant[seg.codes]] = 0.0
    return adv


def _as_numpy(x: object, what: str) -> np.ndarray:
    if isinstance(x, Tensor):
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.ndim != 1:
        raise AlgoError(f"{what} must be 1-D, got shape {arr.shape}")
    return arr


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
    if estimator not in SEQUENCE_ESTIMATORS:
        if estimator == "reinforce_pp":
            raise AlgoError("'reinforce_pp' is token-level (discounted return-to-go); use outcome_advantages")
        raise _bad_choice("estimator", estimator, SEQUENCE_ESTIMATORS)
    s = _as_numpy(scores, "scores")
    g = _groups_for(group_ids, s.shape[0])
    lens = None
    if estimator in _NEEDS_LENGTHS:
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
        raise _bad_choice("estimator", estimator, ESTIMATORS)
    _check_pair(token_rewards, mask, "token_rewards", "mask")
    if not token_rewards.is_floating_point():
        raise AlgoError(f"token_rewards must be floating point, got {token_rewards.dtype}")
    if not 0.0 <= gamma <= 1.0:
        raise AlgoError(f"gamma must be in [0, 1], got {gamma}")
    if out is not None and (out.shape != token_rewards.shape or out.dtype != token_rewards.dtype):
        raise AlgoError(f"out must have shape {tuple(token_rewards.shape)} and dtype {token_rewards.dtype}")
    with torch.no_grad():
        if estimator == "reinforce_pp":
            adv_tok = _reinforce_pp_token(token_rewards, mask, gamma)
            return adv_tok if out is None else out.copy_(adv_tok)
        rewards = token_rewards.detach()
        zeroed = False  # a fresh large output: huge pages (faults 512x less), already all zeros
        if out is None:
            out, zeroed = new_output(rewards)
        g = _groups_for(group_ids, rewards.shape[0])
        if estimator == "grpo":  # the DAPO hot path: one fused CPU sweep when the kernel applies
            codes = np.ascontiguousarray(g.codes, dtype=np.int64)
            finite = grpo_token_advantages(rewards, mask, codes, g.n_groups, norm_by_std, GRPO_EPS,
                                           out, zeroed)
            if finite is False:
                raise AlgoError("scores contain NaN or inf")
            if finite:
                return out
        # Row sums as a matrix-vector product: one bandwidth-bound read of the rewards.
        if rewards.dtype not in (torch.float32, torch.float64):
            scores = rewards.sum(dim=-1, dtype=torch.float32)  # numpy has no bfloat16
        elif rewards.shape[1] and rewards.is_contiguous():
            scores = torch.mv(rewards, rewards.new_ones(rewards.shape[1]))
        else:
            scores = rewards.sum(dim=-1)
        lengths = _row_counts(mask).cpu().numpy() if estimator in _NEEDS_LENGTHS else None
        adv64 = _sequence_advantages64(scores.cpu().numpy(), g, estimator, norm_by_std, lengths)
        adv = torch.from_numpy(adv64).to(device=rewards.device, dtype=rewards.dtype)
        return _broadcast_masked(adv, mask, out, zeroed)


def _broadcast_masked(adv: Tensor, mask: Tensor, out: Tensor, zeroed: bool = False) -> Tensor:
    """out[i, t] = adv[i] where mask[i, t] else 0, in one fused pass (``zeroed``: ``out`` is all
    zeros already). Shape: (batch,) -> (batch, T)."""
    if masked_broadcast(adv, mask, out, zeroed) is not None:  # CPU: numba, ~3x faster than torch.where
        return out
    column = adv[:, None]
    if mask.dtype == torch.bool:
        return torch.where(mask, column, column.new_zeros(()), out=out)
    if mask.dtype == out.dtype:
        return torch.mul(mask, column, out=out)  # verl: adv * mask (same-dtype mul is vectorised)
    return torch.where(mask != 0, column, column.new_zeros(()), out=out)


def _reinforce_pp_token(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """verl's REINFORCE++: discounted return-to-go, reset after masked positions, whitened over
    valid tokens. The loop runs over time steps (columns), vectorised over the batch.
    Shape: (batch, resp_len) -> (batch, resp_len)."""
    valid = _as_bool(mask)
    keep = valid.to(rewards.dtype)
    returns = torch.empty_like(rewards)
    running = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * keep[:, t]  # a masked position cuts the return (verl: reset after EOS)
    return torch.where(valid, masked_whiten(returns, valid), 0.0)


# --------------------------------------------------------------------------------------------
# Dynamic sampling and overlong shaping (per sequence, numpy)
# --------------------------------------------------------------------------------------------


def keep_groups(group_ids: GroupIds, values: np.ndarray | Sequence[float] | Tensor) -> np.ndarray:
    """Dynamic-sampling keep mask: keep a group unless all its values are exactly equal;
    singleton groups are kept (DAPO; verl's ``np.std > 0`` for exactly equal values).

    Shape: group_ids (batch,), values (batch,) -> (batch,) bool, constant within a group.
    """
    v = _as_numpy(values, "values")
    g = _groups_for(group_ids, v.shape[0])
    if v.dtype.kind == "f" and np.isnan(v).any():
        raise AlgoError("values contain NaN (verl would silently drop such a group)")
    seg = _Segments.of(g)
    keep = ~_constant_groups(seg, v) | (seg.counts == 1)
    return keep[seg.codes]


def pass_at_k(group_ids: GroupIds, correct: np.ndarray | Sequence[float] | Tensor, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021, the Codex paper): the mean over prompts of
    ``1 - C(n - c, k) / C(n, k)``, a prompt having n samples (rows of its group) of which c are
    correct (``correct`` > 0); prompts with fewer than k samples are left out. pass@1 is the
    plain accuracy; pass@n is the share of prompts with any correct sample.

    Shape: group_ids (batch,), correct (batch,) -> scalar.
    """
    if k < 1:
        raise AlgoError(f"k must be >= 1, got {k}")
    ok = _as_numpy(correct, "correct")
    g = _groups_for(group_ids, ok.shape[0])
    n = np.bincount(g.codes, minlength=g.n_groups)
    c = np.bincount(g.codes[ok > 0], minlength=g.n_groups)
    n, c = n[n >= k], c[n >= k]
    if not n.size:
        raise AlgoError(f"pass@{k} needs a prompt with at least {k} samples")
    # C(n - c, k) / C(n, k) through log-gamma (float64), 0 where fewer than k samples are wrong
    lg = lambda x: torch.lgamma(torch.from_numpy(x.astype(np.float64))).numpy()  # noqa: E731
    wrong = n - c
    ratio = np.exp(lg(wrong + 1) - lg(np.maximum(wrong - k, 0) + 1) - lg(n + 1) + lg(n - k + 1))
    return float(np.mean(1.0 - np.where(wrong >= k, ratio, 0.0)))


def overlong_penalty(
    lengths: np.ndarray | Sequence[int] | Tensor, *, max_len: int, buffer_len: int, factor: float
) -> np.ndarray:
    """Soft overlong punishment (DAPO eq. 13, verl DAPORewardManager).

    penalty = min(-(L - (max_len - buffer_len)) / buffer_len * factor, 0), no lower clamp;
    L = valid response tokens (EOS included). Computed in float32 like verl's tensor math.
    Shape: (batch,) -> (batch,) float32.
    """
    lens = _as_numpy(lengths, "lengths")
    if buffer_len <= 0:
        raise AlgoError(f"buffer_len must be > 0, got {buffer_len}")
    if max_len < buffer_len:
        raise AlgoError(f"max_len ({max_len}) must be >= buffer_len ({buffer_len})")
    if factor < 0:
        raise AlgoError(f"factor must be >= 0, got {factor}")
    if lens.size and lens.min() < 0:
        raise AlgoError("lengths must be >= 0")
    exceed = lens.astype(np.int64) - (max_len - buffer_len)
    # verl: int tensor / int -> float32, * python float -> float32
    penalty = (-exceed).astype(np.float32) / np.float32(buffer_len) * np.float32(factor)
    return np.minimum(penalty, np.float32(0.0))


# --------------------------------------------------------------------------------------------
# Masked statistics (verl_F semantics, NaN-safe)
# --------------------------------------------------------------------------------------------


def _check_pair(x: Tensor, mask: Tensor, x_name: str = "x", mask_name: str = "mask") -> None:
    if x.shape != mask.shape:
        raise AlgoError(f"{x_name} shape {tuple(x.shape)} != {mask_name} shape {tuple(mask.shape)}")
    if x.dim() != 2:
        raise AlgoError(f"{x_name} must be 2-D (batch, resp_len), got shape {tuple(x.shape)}")


def _as_bool(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def _masked(x: Tensor, mask: Tensor) -> Tensor:
    """x at valid positions, 0 elsewhere; NaN/inf at masked positions cannot leak (verl_F.masked_sum
    keeps float-mask weights too)."""
    kept = torch.where(_as_bool(mask), x, x.new_zeros(()))
    return kept * mask if mask.is_floating_point() else kept


def _row_counts(mask: Tensor) -> Tensor:
    """Valid tokens per row. Shape: (batch, T) -> (batch,) int32 (bool sums to int64 are slow)."""
    if mask.dtype == torch.bool:
        return mask.view(torch.uint8).sum(dim=-1, dtype=torch.int32)
    return (mask != 0).view(torch.uint8).sum(dim=-1, dtype=torch.int32)


def _mask_count(mask: Tensor, dim: int | None = None) -> Tensor:
    """verl's ``mask.sum(axis)`` (float masks keep their weights)."""
    if mask.is_floating_point():
        return mask.sum() if dim is None else mask.sum(dim=dim)
    return torch.count_nonzero(mask) if dim is None else torch.count_nonzero(mask, dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """verl_F.masked_mean: sum(x * mask) / (mask.sum() + 1e-8), NaN-safe at masked positions.
    Shape: x, mask (...) -> scalar, or x reduced over `dim`."""
    if x.shape != mask.shape:
        raise AlgoError(f"x shape {tuple(x.shape)} != mask shape {tuple(mask.shape)}")
    total = _masked(x, mask).sum() if dim is None else _masked(x, mask).sum(dim=dim)
    return total / (_mask_count(mask, dim) + _MEAN_EPS)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """verl_F.masked_whiten: (x - mean) * rsqrt(var_unbiased + 1e-8) over valid positions.

    var is the masked variance times n / (n - 1) (Bessel). Values at masked positions are
    computed but meaningless; callers mask them. Raises for fewer than 2 valid positions.
    Shape: (...) -> (...).
    """
    n = float(_mask_count(mask))
    if n < 2:
        raise AlgoError(f"masked_whiten needs at least 2 valid positions, got {n:g}")
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask) * (n / (n - 1))
    whitened = (x - mean) * torch.rsqrt(var + _WHITEN_EPS)
    return whitened + mean if not shift_mean else whitened


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Categorical entropy, verl_F.entropy_from_logits: logsumexp(z) - sum(softmax(z) * z).
    Shape: (..., vocab) -> (...)."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(probs * logits, dim=-1)


def logprobs_from_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """log softmax(logits)[label] as gather minus logsumexp, never materialising log_softmax.

    logsumexp runs in row chunks (its exp temporary stays <= 64 MiB) and in float32 for
    bf16/fp16 logits (verl falls back to log_softmax there for stability); the result is then
    float32. Shape: logits (..., vocab), labels (...) int -> (...).
    """
    if labels.shape != logits.shape[:-1]:
        raise AlgoError(f"labels shape {tuple(labels.shape)} != logits shape[:-1] {tuple(logits.shape[:-1])}")
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    acc = logits.dtype if logits.dtype in (torch.float32, torch.float64) else torch.float32
    picked = flat.gather(-1, labels.reshape(-1, 1).long()).squeeze(-1).to(acc)
    rows = max(1, _LOGSUMEXP_CHUNK // max(vocab, 1))
    if flat.shape[0] <= rows:
        lse = torch.logsumexp(flat.to(acc), dim=-1)
    else:
        lse = torch.cat([torch.logsumexp(c.to(acc), dim=-1) for c in flat.split(rows)])
    return (picked - lse).reshape(labels.shape)


# --------------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------------


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
        raise _bad_choice("loss_agg_mode", mode, LOSS_AGG_MODES)
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
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate with decoupled clip (DAPO clip-higher) and optional dual clip
    (verl ``compute_policy_loss_vanilla``).

    log_ratio = clamp(logp - old_logp, ±20); r = exp(log_ratio);
    loss_tok = max(-A·r, -A·clamp(r, 1 - clip_low, 1 + clip_high)); where A < 0 and clip_c is
    set: min(loss_tok, -A·clip_c). Aggregated with :func:`agg_loss` (``agg`` and the totals).
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
    loss = agg_loss(loss_tok, mask, agg, num_tokens=num_tokens, num_seqs=num_seqs, norm_len=norm_len)
    with torch.no_grad():
        clipped = (loss_clipped > loss_unclipped).to(logp.dtype)
        lower = dual_hit.to(logp.dtype) if clip_c is not None else torch.zeros_like(clipped)
        stats = torch.stack(
            [masked_mean(clipped, mask), masked_mean(lower, mask), masked_mean(-log_ratio.detach(), mask)]
        ).tolist()  # one device sync for all three
    return loss, {"clipfrac": stats[0], "clipfrac_lower": stats[1], "ppo_kl": stats[2]}


def kl_in_reward(
    scores: np.ndarray, logp: Tensor, ref_logp: Tensor, mask: Tensor, kind: str, coef: float
) -> tuple[np.ndarray, np.ndarray, float]:
    """KL penalty folded into the reward (verl ``apply_kl_penalty``, ``use_kl_in_reward``).

    verl writes ``token_level_rewards = token_level_scores - coef * kl * mask`` per token; the
    outcome estimators sum a row's token rewards, so per sequence that is
    ``score - coef * sum_t(kl * mask)``, returned with the summed KL. ``current_kl`` is verl's
    controller input: the batch mean of each row's masked-mean KL (``masked_mean(kl, mask,
    axis=-1).mean()``). The KL is computed without gradient (it is a reward).
    Shape: scores (batch,), logp / ref_logp / mask (batch, T) -> (batch,) float32 reward,
    (batch,) float32 summed KL, scalar.
    """
    if coef < 0:
        raise AlgoError(f"coef must be >= 0, got {coef}")
    s = _as_numpy(scores, "scores")
    _check_pair(logp, mask, "logp", "mask")
    if s.shape[0] != logp.shape[0]:
        raise AlgoError(f"got {s.shape[0]} scores for {logp.shape[0]} sequences")
    with torch.no_grad():
        kl = _masked(kl_penalty(logp.detach(), ref_logp.detach(), kind), mask)
        kl_sum = kl.sum(dim=-1)
        current = float(masked_mean(kl, mask, dim=-1).mean()) if kl.shape[0] else 0.0
    kl_np = kl_sum.to(torch.float32).cpu().numpy()
    reward = (s.astype(np.float32) - np.float32(coef) * kl_np).astype(np.float32)
    return reward, kl_np, current


def adaptive_kl_coef(coef: float, current_kl: float, *, target_kl: float, horizon: int, n_steps: int) -> float:
    """verl's ``AdaptiveKLController.update`` (Ziegler et al. 2019): move the coefficient toward
    keeping the KL at ``target_kl``: ``coef * (1 + clip(current / target - 1, -0.2, 0.2) *
    n_steps / horizon)``, with ``n_steps`` the batch size."""
    if target_kl <= 0 or horizon <= 0:
        raise AlgoError(f"target_kl and horizon must be > 0, got {target_kl}, {horizon}")
    error = float(np.clip(current_kl / target_kl - 1, -0.2, 0.2))
    return coef * (1 + error * n_steps / horizon)


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate between the policy and the reference (verl ``kl_penalty``).

    kl/k1: logp - ref; abs: |logp - ref|; mse/k2: 0.5·(logp - ref)²;
    low_var_kl/k3: kl = clamp(ref - logp, ±20), clamp(exp(kl) - kl - 1, ±10) (zero gradient
    where a clamp binds). A "+" suffix (k1+, k3+, ...) is straight-through: the forward value of
    the base kind, the gradient of k2. "full" needs whole-vocabulary distributions: an error.
    Shape: (batch, resp_len) -> (batch, resp_len).
    """
    straight_through = kind.endswith("+")
    base = kind[:-1] if straight_through else kind
    if base == "full":
        raise AlgoError("kl_penalty 'full' needs full-vocabulary log-probs; per-token estimators: "
                        + ", ".join(KL_KINDS))
    if base not in _KL_BASE_KINDS:
        raise _bad_choice("kl_penalty kind", kind, KL_KINDS)
    if logp.shape != ref_logp.shape:
        raise AlgoError(f"logp shape {tuple(logp.shape)} != ref_logp shape {tuple(ref_logp.shape)}")
    if base in ("kl", "k1"):
        value = logp - ref_logp
    elif base == "abs":
        value = (logp - ref_logp).abs()
    elif base in ("mse", "k2"):
        value = 0.5 * (logp - ref_logp).square()
    else:  # low_var_kl / k3 (Schulman's k3), clamped for stability
        kl = torch.clamp(ref_logp - logp, min=-_LOG_RATIO_CLAMP, max=_LOG_RATIO_CLAMP)
        value = torch.clamp(torch.exp(kl) - kl - 1, min=-_K3_CLAMP, max=_K3_CLAMP)
    if not straight_through or base in ("mse", "k2"):
        return value
    k2 = 0.5 * (logp - ref_logp).square()
    return k2 - k2.detach() + value.detach()  # forward: value; backward: d k2
