"""Correction for the rollout/trainer mismatch: importance-sampling weights and rejection masks.

The samples of a step were drawn by the rollout engine's policy (its numerics, or an older
version of the weights under asynchronous rollout) and are trained on as the trainer's policy.
With ``log_ratio = log π_train − log π_rollout`` per response token:

- :func:`rollout_correction_weights`: truncated IS (TIS: weights clamped at an upper bound) or
  IcePop (weights outside ``[lower, upper]`` set to zero), per token or per sequence (the
  product of the token ratios), optionally normalized to mean 1 over the batch;
- :func:`rollout_rejection_mask`: a hard trust region: tokens or whole sequences whose divergence
  estimate (k1 = −log ratio, k2 = ½ log², k3 = ratio − 1 − log ratio; per token, or its sum, mean
  or max over the sequence) leaves its bound are masked out of the loss; several criteria, comma
  separated, must all pass.

Semantics, option strings and metric names are verl's (``verl/trainer/ppo/rollout_corr_helper.py``,
``compute_rollout_correction_weights`` / ``compute_rollout_rejection_mask``, 0.9), checked against
a transcription in tests/algos/test_rollout_correction.py. Every log ratio is clamped to ±20
before it is exponentiated. One difference: the batch normalization averages over the tensors
given (verl all-reduces over its data-parallel group when torch.distributed is up); dapo-flow
calls it on the whole step's batch.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dapo_flow.algos.errors import AlgoError
from dapo_flow.algos.masked import _masked, masked_mean
from dapo_flow.reductions import Max, Min

SAFETY_BOUND = 20.0
"""|log ratio| is clamped here before exp: exp(20) ~ 4.9e8."""
ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                      "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


def _masked_sum(x: Tensor, mask: Tensor, dim: int = -1) -> Tensor:
    """verl_F.masked_sum over ``dim``, NaN-safe at masked positions."""
    return _masked(x, mask).sum(dim=dim)


def _masked_max(x: Tensor, mask: Tensor) -> Tensor:
    """Per row (B, T) -> (B,), 0 for a row without valid tokens."""
    best = x.masked_fill(~mask.bool(), float("-inf")).max(dim=-1).values
    return torch.where(torch.isneginf(best), torch.zeros_like(best), best)


def parse_is_threshold(spec: str | float) -> tuple[float, float | None]:
    """``2.0`` or ``"2.0"``: (upper, None), truncation; ``"0.5_2.0"``: (upper, lower), IcePop."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise AlgoError(f"rollout_is_threshold must be a number or a 'lower_upper' string, got {spec!r}")
    lower = None
    try:
        if isinstance(spec, str):
            text = spec.strip()
            if "_" in text:
                lower_text, upper_text = text.split("_", 1)
                lower, upper = float(lower_text), float(upper_text)
            else:
                upper = float(text)
        else:
            upper = float(spec)
    except ValueError:
        raise AlgoError(f"rollout_is_threshold {spec!r} is not a number or 'lower_upper' (e.g. 2.0, '0.5_2.0')") from None
    if upper <= 0 or (lower is not None and not 0 < lower <= upper):
        raise AlgoError(f"rollout_is_threshold {spec!r}: bounds must be positive, lower <= upper")
    return upper, lower


def rollout_correction_weights(log_ratio: Tensor, response_mask: Tensor, rollout_is: str = "token",
                               rollout_is_threshold: str | float = 2.0,
                               rollout_is_batch_normalize: bool = False) -> tuple[Tensor, dict[str, float]]:
    """IS weights π_train / π_rollout, truncated (TIS) or bounded (IcePop), zero at padding.

    Shapes: log_ratio, response_mask (B, T) -> weights (B, T), detached. ``rollout_is``:
    "token" (each token its ratio) or "sequence" (every token the product over its sequence).
    Metrics (verl's names): ``rollout_is_mean/max/min/std``, ``..._ratio_fraction_high/low``,
    ``..._eff_sample_size``, ``..._seq_*``, ``rollout_is_oob_ratio`` (IcePop),
    ``rollout_is_batch_norm_factor`` (normalized)."""
    if rollout_is not in ROLLOUT_IS_LEVELS:
        raise AlgoError(f"rollout_is must be one of {', '.join(ROLLOUT_IS_LEVELS)}, got {rollout_is!r}")
    upper, lower = parse_is_threshold(rollout_is_threshold)
    mask = response_mask
    if rollout_is == "token":
        log_ratio_for_metrics = log_ratio
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    else:
        log_ratio_for_metrics = _masked_sum(log_ratio, mask).unsqueeze(-1)  # (B, 1)
        raw = torch.exp(log_ratio_for_metrics.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    raw = _masked(raw, mask)  # 0 at padding, NaN there included
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    metrics = _is_metrics(weights, raw, log_ratio_for_metrics, mask, rollout_is, upper, lower)
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = masked_mean(((raw < lower) | (raw > upper)).float(), mask).item()
    weights = weights.detach()  # the weights change the measure, not the objective
    if rollout_is_batch_normalize:
        if rollout_is == "token":
            mean = masked_mean(weights, mask)
        else:
            per_seq = masked_mean(weights, mask.to(weights.dtype), dim=-1)
            valid = (mask.sum(dim=-1) > 0).to(weights.dtype)
            mean = (per_seq * valid).sum() / valid.sum().clamp_min(1e-8)
        if mean > 1e-8:
            weights = weights / mean
            metrics["rollout_is_batch_norm_factor"] = mean.item()
        else:
            metrics["rollout_is_batch_norm_factor"] = 1.0
    return weights, metrics


def _is_metrics(weights: Tensor, raw: Tensor, log_ratio_for_metrics: Tensor, mask: Tensor, level: str,
                upper: float, lower: float | None) -> dict[str, float]:
    if not mask.any():
        raise AlgoError("response_mask has no valid token: nothing to weight")
    lower = 1.0 / upper if lower is None else lower
    m: dict[str, float] = {}
    valid = mask.bool()
    if level == "sequence":
        log_upper = torch.log(torch.tensor(upper, device=weights.device))
        log_lower = torch.log(torch.tensor(lower, device=weights.device))
        m["rollout_is_max"] = Max(torch.exp(log_ratio_for_metrics.max().clamp(max=SAFETY_BOUND)).item())
        m["rollout_is_min"] = Min(torch.exp(log_ratio_for_metrics.min()).item())
        m["rollout_is_mean"] = masked_mean(weights, mask).item()
        m["rollout_is_ratio_fraction_high"] = (log_ratio_for_metrics > log_upper).float().mean().item()
        m["rollout_is_ratio_fraction_low"] = (log_ratio_for_metrics < log_lower).float().mean().item()
    else:  # the applied weights give mean, max and min; the raw ones how often a bound was crossed
        m["rollout_is_mean"] = masked_mean(weights, mask).item()
        m["rollout_is_ratio_fraction_high"] = masked_mean((raw > upper).float(), mask).item()
        m["rollout_is_ratio_fraction_low"] = masked_mean((raw < lower).float(), mask).item()
        m["rollout_is_max"] = Max(weights.masked_fill(~valid, float("-inf")).max().item())
        m["rollout_is_min"] = Min(weights.masked_fill(~valid, float("inf")).min().item())
    clamped = weights.clamp(min=0.0, max=upper)
    mean_clamped = masked_mean(clamped, mask)
    if mask.sum() > 1:
        var = masked_mean(clamped.square(), mask) - mean_clamped.square()
        m["rollout_is_std"] = torch.sqrt(var.clamp(min=0.0)).item()
    else:
        m["rollout_is_std"] = 0.0
    m["rollout_is_eff_sample_size"] = 1.0 / masked_mean((clamped / (mean_clamped + 1e-8)).square(), mask).item()
    if weights.dim() > 1:
        per_seq = masked_mean(weights, mask.to(weights.dtype), dim=-1)
        m["rollout_is_seq_mean"] = per_seq.mean().item()
        m["rollout_is_seq_std"] = per_seq.std().item() if per_seq.numel() > 1 else 0.0
        m["rollout_is_seq_max"] = Max(per_seq.max().item())
        m["rollout_is_seq_min"] = Min(per_seq.min().item())
        m["rollout_is_seq_max_deviation"] = (per_seq - 1.0).abs().max().item()
        # the raw per-sequence mean: a mean of clamped weights never exceeds the bound
        raw_per_seq = masked_mean(raw, mask.to(raw.dtype), dim=-1)
        m["rollout_is_seq_fraction_high"] = (raw_per_seq > upper).float().mean().item()
        m["rollout_is_seq_fraction_low"] = (raw_per_seq < lower).float().mean().item()
    return m


def parse_rs_options(rollout_rs: str) -> list[str]:
    """The options of a comma separated ``rollout_rs``, in order, each once; AlgoError when one
    is unknown or none is given."""
    options = list(dict.fromkeys(o.strip() for o in rollout_rs.split(",") if o.strip()))
    unknown = [o for o in options if o not in ROLLOUT_RS_OPTIONS]
    if unknown or not options:
        raise AlgoError(f"rollout_rs option(s) {', '.join(unknown) or '(none)'} unknown; "
                        f"choose from {', '.join(ROLLOUT_RS_OPTIONS)}")
    return options


def parse_rs_thresholds(options: list[str], spec: str | float | None) -> dict[str, tuple[float | None, float]]:
    """Option -> (lower, upper): one entry per option, comma separated, or one for all. A k1
    option takes ``"lower_upper"`` ratio bounds (an upper alone means [1/upper, upper]); the
    others one upper bound on their divergence."""
    if spec is None:
        raise AlgoError("rollout_rs_threshold is required with rollout_rs (e.g. '0.5_2.0' for token_k1, 0.01 for k3)")
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise AlgoError(f"rollout_rs_threshold must be a number or a comma separated string, got {spec!r}")
    parts = [str(spec)] if isinstance(spec, (int, float)) else [p.strip() for p in spec.split(",") if p.strip()]
    if len(parts) not in (1, len(options)):
        raise AlgoError(f"rollout_rs_threshold has {len(parts)} entries for {len(options)} rollout_rs options "
                        f"({', '.join(options)}): give one shared by all or one each")
    parts = parts * len(options) if len(parts) == 1 else parts
    out: dict[str, tuple[float | None, float]] = {}
    for option, part in zip(options, parts):
        if option.endswith("k1"):
            lower_text, upper_text = part.split("_", 1) if "_" in part else (None, part)
            upper = _number(upper_text, option)
            lower = _number(lower_text, option) if lower_text is not None else 1.0 / upper
            if lower <= 0 or upper <= 0 or lower > upper:
                raise AlgoError(f"rollout_rs_threshold {part!r} for {option}: bounds must be positive, lower <= upper")
        else:
            if "_" in part:
                raise AlgoError(f"rollout_rs_threshold {part!r} for {option}: one upper bound, not 'lower_upper'")
            lower, upper = None, _number(part, option)
            if upper <= 0:
                raise AlgoError(f"rollout_rs_threshold {part!r} for {option} must be positive")
        out[option] = (lower, upper)
    return out


def _number(text: str, option: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise AlgoError(f"rollout_rs_threshold {text!r} for {option} is not a number") from None


def rollout_rejection_mask(log_ratio: Tensor, response_mask: Tensor, rollout_rs: str = "token_k1",
                           rollout_rs_threshold: str | float | None = None) -> tuple[Tensor, dict[str, float]]:
    """``response_mask`` with the tokens (or whole sequences) outside the trust region set to 0.

    Shapes: log_ratio, response_mask (B, T) -> mask (B, T) of response_mask's dtype.
    ``rollout_rs``: comma separated options of :data:`ROLLOUT_RS_OPTIONS`, all of which must
    pass. Metrics (verl's names): per option ``rollout_rs_{option}_mean/max/min/std``,
    ``..._fraction_high/low``, ``..._seq_*``, ``..._masked_fraction``, and in all
    ``rollout_rs_masked_fraction`` and ``rollout_rs_seq_masked_fraction``."""
    if not isinstance(rollout_rs, str) or not rollout_rs.strip():
        raise AlgoError("rollout_rs must be a non-empty string of comma separated options")
    if rollout_rs_threshold is None:
        raise AlgoError("rollout_rs_threshold is required with rollout_rs (e.g. '0.5_2.0' for token_k1, 0.01 for k3)")
    if log_ratio.shape[0] == 0:
        return response_mask, {}
    options = parse_rs_options(rollout_rs)
    bounds = parse_rs_thresholds(options, rollout_rs_threshold)
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    divergence = {"k1": -safe, "k2": 0.5 * safe**2, "k3": torch.exp(safe) - 1.0 - safe}
    valid = response_mask.bool()
    seq_valid = response_mask.sum(dim=-1) > 0
    combined = torch.ones_like(response_mask, dtype=log_ratio.dtype)
    metrics: dict[str, float] = {}
    for option in options:
        lower, upper = bounds[option]
        scope, kind = option.rsplit("_", 1)
        per_token = divergence[kind]
        if kind == "k1":  # bounds on the ratio are bounds on its log
            lo, hi = math.log(lower), math.log(upper)
        else:
            lo, hi = None, upper
        per_seq = None
        if scope == "token":
            stat = per_token
        else:
            if scope == "seq_sum":
                per_seq = _masked_sum(per_token, response_mask)
            elif scope == "seq_mean":
                per_seq = masked_mean(per_token, response_mask.to(per_token.dtype), dim=-1)
            else:
                per_seq = _masked_max(per_token, response_mask)
            stat = per_seq.unsqueeze(-1).expand_as(log_ratio)
        keep = stat <= hi if lo is None else (stat >= lo) & (stat <= hi)
        keep_float = keep.to(log_ratio.dtype)
        combined = combined * keep_float
        metrics.update(_rs_metrics(option, stat, response_mask, seq_valid, per_seq, hi, lo))
        seq_keep = (~(~keep & valid)).all(dim=-1)
        metrics[f"rollout_rs_{option}_masked_fraction"] = masked_mean(1 - keep_float, response_mask).item()
        n_valid = seq_valid.float().sum()
        metrics[f"rollout_rs_{option}_seq_masked_fraction"] = (
            (((1.0 - seq_keep.to(log_ratio.dtype)) * seq_valid.float()).sum() / n_valid).item() if n_valid > 0 else 0.0)
    metrics["rollout_rs_masked_fraction"] = masked_mean(1 - combined, response_mask).item()
    kept = (combined > 0.5) & valid
    metrics["rollout_rs_seq_masked_fraction"] = (~kept & valid).any(dim=-1).float().mean().item()
    return (response_mask * combined).to(response_mask.dtype), metrics


def _rs_metrics(option: str, stat: Tensor, mask: Tensor, seq_valid: Tensor, per_seq: Tensor | None,
                upper: float, lower: float | None) -> dict[str, float]:
    """One option's statistics (``lower`` only for k1 options, in log space)."""
    if not mask.any():
        raise AlgoError("response_mask has no valid token: nothing to filter")
    p = f"rollout_rs_{option}"
    valid = mask.bool()
    seq_values = per_seq if per_seq is not None else masked_mean(stat, mask.to(stat.dtype), dim=-1)
    seq_ok = seq_values[seq_valid]
    sequence_level = per_seq is not None and seq_ok.numel() > 0
    m = {f"{p}_mean": masked_mean(stat, mask).item()}
    if sequence_level:
        m[f"{p}_max"], m[f"{p}_min"] = Max(seq_ok.max().item()), Min(seq_ok.min().item())
        m[f"{p}_fraction_high"] = (seq_ok > upper).float().mean().item()
        m[f"{p}_fraction_low"] = (seq_ok < lower).float().mean().item() if lower is not None else 0.0
    else:
        m[f"{p}_max"] = Max(stat.masked_fill(~valid, float("-inf")).max().item())
        m[f"{p}_min"] = Min(stat.masked_fill(~valid, float("inf")).min().item())
        m[f"{p}_fraction_high"] = masked_mean((stat > upper).float(), mask).item()
        m[f"{p}_fraction_low"] = masked_mean((stat < lower).float(), mask).item() if lower is not None else 0.0
    if mask.sum() > 1:
        clamped = stat.clamp(min=lower if lower is not None else 0.0, max=upper)
        mean = masked_mean(clamped, mask)
        m[f"{p}_std"] = torch.sqrt((masked_mean(clamped.square(), mask) - mean.square()).clamp(min=0.0)).item()
    else:
        m[f"{p}_std"] = 0.0
    if seq_ok.numel() > 0:
        m[f"{p}_seq_mean"] = seq_ok.mean().item()
        m[f"{p}_seq_std"] = seq_ok.std().item() if seq_ok.numel() > 1 else 0.0
        m[f"{p}_seq_max"], m[f"{p}_seq_min"] = Max(seq_ok.max().item()), Min(seq_ok.min().item())
        m[f"{p}_seq_max_deviation"] = seq_ok.abs().max().item()
        m[f"{p}_seq_fraction_high"] = (seq_ok > upper).float().mean().item()
        if lower is not None:
            m[f"{p}_seq_fraction_low"] = (seq_ok < lower).float().mean().item()
    else:
        m.update({f"{p}_seq_{k}": 0.0 for k in ("mean", "std", "max", "min", "max_deviation", "fraction_high",
                                                 "fraction_low")})
    return m
