"""KL estimators (:data:`KL_KINDS`), KL in the reward, and the adaptive KL coefficient."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from dapo_flow.algos.errors import AlgoError, bad_choice
from dapo_flow.algos.groups import _as_numpy
from dapo_flow.algos.losses import _LOG_RATIO_CLAMP
from dapo_flow.algos.masked import _check_pair, _masked, masked_mean

#: KL estimators of log p - log p_ref per token (verl's ``kl_penalty``): k1 = kl, |.| = abs,
#: k2 = mse (0.5 * diff^2), k3 = low_var_kl (clamped to +-10). The `kl` operator's choices.
KL_BASE_KINDS: tuple[str, ...] = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
#: Every accepted `kind` of :func:`kl_penalty`; "+" = value of the base kind, gradient of k2.
#: The `update` operator's `kl_type` choices.
KL_KINDS: tuple[str, ...] = KL_BASE_KINDS + tuple(k + "+" for k in KL_BASE_KINDS)
_K3_CLAMP = 10.0  # low_var_kl value clamp


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
    if base not in KL_BASE_KINDS:
        raise bad_choice("kl_penalty kind", kind, KL_KINDS)
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
