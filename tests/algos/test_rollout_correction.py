"""algos.rollout_correction_weights / rollout_rejection_mask against verl 0.9's
compute_rollout_correction_weights / compute_rollout_rejection_mask, transcribed below (branch by
branch, with verl_F's masked_sum / masked_mean) and compared on random log ratios with padding,
ratios far beyond the bounds, and every option: weights, masks and every metric, to float32."""

from __future__ import annotations

import math

import pytest
import torch

from dapo_flow import algos
from dapo_flow.algos import AlgoError

SAFETY = 20.0


# --- verl, transcribed ---------------------------------------------------------------------

def v_masked_sum(values, mask, axis=None):
    return (values * mask).sum() if axis is None else (values * mask).sum(axis)


def v_masked_mean(values, mask, axis=None):
    s = v_masked_sum(values, mask, axis)
    return s / (mask.sum() + 1e-8) if axis is None else s / (mask.sum(axis) + 1e-8)


def v_parse_is(spec):
    if isinstance(spec, (int, float)):
        return float(spec), None
    spec = spec.strip()
    if "_" in spec:
        lo, hi = spec.split("_", 1)
        return float(hi), float(lo)
    return float(spec), None


def v_is_metrics(w, raw, lrm, mask, level, upper, lower):
    m = {}
    lower = 1.0 / upper if lower is None else lower
    lu, ll = torch.log(torch.tensor(upper)), torch.log(torch.tensor(lower))
    if level == "sequence":
        m["rollout_is_max"] = torch.exp(torch.clamp(lrm.max(), max=SAFETY)).item()
        m["rollout_is_min"] = torch.exp(lrm.min()).item()
        m["rollout_is_mean"] = v_masked_mean(w, mask).item()
        m["rollout_is_ratio_fraction_high"] = (lrm > lu).float().mean().item()
        m["rollout_is_ratio_fraction_low"] = (lrm < ll).float().mean().item()
    else:
        m["rollout_is_mean"] = v_masked_mean(w, mask).item()
        m["rollout_is_ratio_fraction_high"] = v_masked_mean((raw > upper).float(), mask).item()
        m["rollout_is_ratio_fraction_low"] = v_masked_mean((raw < lower).float(), mask).item()
        mb = mask.bool()
        m["rollout_is_max"] = w.masked_fill(~mb, float("-inf")).max().item()
        m["rollout_is_min"] = w.masked_fill(~mb, float("inf")).min().item()
    if mask.sum() > 1:
        ws = w.clamp(min=0.0, max=upper)
        mc = v_masked_mean(ws, mask)
        m["rollout_is_std"] = torch.sqrt(torch.clamp(v_masked_mean(ws.square(), mask) - mc.square(), min=0.0)).item()
    else:
        m["rollout_is_std"] = 0.0
    we = w.clamp(min=0.0, max=upper)
    norm = we / (v_masked_mean(we, mask) + 1e-8)
    m["rollout_is_eff_sample_size"] = 1.0 / v_masked_mean(norm.square(), mask).item()
    sm = v_masked_mean(w, mask, axis=-1)
    m["rollout_is_seq_mean"] = sm.mean().item()
    m["rollout_is_seq_std"] = sm.std().item() if sm.numel() > 1 else 0.0
    m["rollout_is_seq_max"] = sm.max().item()
    m["rollout_is_seq_min"] = sm.min().item()
    m["rollout_is_seq_max_deviation"] = (sm - 1.0).abs().max().item()
    rsm = v_masked_mean(raw, mask, axis=-1)
    m["rollout_is_seq_fraction_high"] = (rsm > upper).float().mean().item()
    m["rollout_is_seq_fraction_low"] = (rsm < lower).float().mean().item()
    return m


def v_weights(log_ratio, mask, rollout_is, threshold, normalize):
    upper, lower = v_parse_is(threshold)
    if rollout_is == "token":
        lrm = log_ratio
        raw = torch.exp(torch.clamp(log_ratio, min=-SAFETY, max=SAFETY))
    else:
        lrm = v_masked_sum(log_ratio, mask, axis=-1).unsqueeze(-1)
        raw = torch.exp(torch.clamp(lrm, min=-SAFETY, max=SAFETY)).expand_as(log_ratio)
    raw = raw * mask
    if lower is None:
        w = raw.clamp(max=upper)
    else:
        w = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    m = v_is_metrics(w, raw, lrm, mask, rollout_is, upper, lower)
    if lower is not None:
        m["rollout_is_oob_ratio"] = v_masked_mean(((raw < lower) | (raw > upper)).float(), mask).item()
    if normalize:
        if rollout_is == "token":
            mean = v_masked_mean(w, mask)
        else:
            sw = v_masked_mean(w, mask, axis=-1)
            sk = (mask.sum(dim=-1) > 0).to(w.dtype)
            mean = (sw * sk).sum() / sk.sum().clamp_min(1e-8)
        if mean > 1e-8:
            w = w / mean
            m["rollout_is_batch_norm_factor"] = mean.item()
        else:
            m["rollout_is_batch_norm_factor"] = 1.0
    return w, m


def v_rs_metrics(name, stat, mask, seq_valid, level, per_seq, upper, lower, apply_lower):
    m, p, mb = {}, f"rollout_rs_{name}", mask.bool()
    sv = per_seq if per_seq is not None else v_masked_mean(stat, mask, axis=-1)
    if sv.dim() > 1:
        sv = sv.squeeze(-1)
    svv = sv[seq_valid]
    m[f"{p}_mean"] = v_masked_mean(stat, mask).item()
    if level == "sequence" and svv.numel() > 0:
        m[f"{p}_max"], m[f"{p}_min"] = svv.max().item(), svv.min().item()
        m[f"{p}_fraction_high"] = (svv > upper).float().mean().item()
        m[f"{p}_fraction_low"] = (svv < lower).float().mean().item() if apply_lower else 0.0
    else:
        m[f"{p}_max"] = stat.masked_fill(~mb, float("-inf")).max().item()
        m[f"{p}_min"] = stat.masked_fill(~mb, float("inf")).min().item()
        m[f"{p}_fraction_high"] = v_masked_mean((stat > upper).float(), mask).item()
        m[f"{p}_fraction_low"] = v_masked_mean((stat < lower).float(), mask).item() if apply_lower else 0.0
    if mask.sum() > 1:
        sc = stat.clamp(min=lower if apply_lower else 0.0, max=upper)
        mc = v_masked_mean(sc, mask)
        m[f"{p}_std"] = torch.sqrt(torch.clamp(v_masked_mean(sc.square(), mask) - mc.square(), min=0.0)).item()
    else:
        m[f"{p}_std"] = 0.0
    if svv.numel() > 0:
        m[f"{p}_seq_mean"] = svv.mean().item()
        m[f"{p}_seq_std"] = svv.std().item() if svv.numel() > 1 else 0.0
        m[f"{p}_seq_max"], m[f"{p}_seq_min"] = svv.max().item(), svv.min().item()
        m[f"{p}_seq_max_deviation"] = (svv - 0.0).abs().max().item()
        m[f"{p}_seq_fraction_high"] = (svv > upper).float().mean().item()
        if apply_lower:
            m[f"{p}_seq_fraction_low"] = (svv < lower).float().mean().item()
    else:
        for k in ("mean", "std", "max", "min", "max_deviation", "fraction_high", "fraction_low"):
            m[f"{p}_seq_{k}"] = 0.0
    return m


def v_rejection(log_ratio, mask, rollout_rs, threshold):
    options = []
    for o in (o.strip() for o in rollout_rs.split(",") if o.strip()):
        if o not in options:
            options.append(o)
    specs = [str(threshold)] if isinstance(threshold, (int, float)) else [s.strip() for s in threshold.split(",") if s.strip()]
    if len(specs) == 1:
        specs = specs * len(options)
    bounds = {}
    for o, s in zip(options, specs):
        if o.endswith("k1"):
            lo, hi = s.split("_", 1) if "_" in s else (str(1.0 / float(s)), s)
            bounds[o] = (float(lo), float(hi))
        else:
            bounds[o] = (None, float(s))
    safe = torch.clamp(log_ratio, min=-SAFETY, max=SAFETY)
    tok = {"k1": -safe, "k2": 0.5 * safe**2, "k3": torch.exp(safe) - 1.0 - safe}
    mb = mask.bool()
    seq_valid = mask.sum(dim=-1) > 0
    combined = torch.ones_like(mask, dtype=log_ratio.dtype)
    m = {}

    def seq_max(v):
        mx = v.masked_fill(~mb, float("-inf")).max(dim=-1).values
        return torch.where(mx == float("-inf"), torch.zeros_like(mx), mx)

    for o in options:
        lo, hi = bounds[o]
        k1 = o.endswith("k1")
        lo_log, hi_log = (math.log(lo), math.log(hi)) if k1 else (None, None)
        kind = o[-2:]
        per_seq = None
        if o.startswith("token"):
            stat = tok[kind]
            keep = (stat >= lo_log) & (stat <= hi_log) if k1 else stat <= hi
        else:
            if o.startswith("seq_sum"):
                per_seq = v_masked_sum(tok[kind], mask, axis=-1)
            elif o.startswith("seq_mean"):
                per_seq = v_masked_mean(tok[kind], mask, axis=-1)
            else:
                per_seq = seq_max(tok[kind])
            keep_seq = (per_seq >= lo_log) & (per_seq <= hi_log) if k1 else per_seq <= hi
            keep = keep_seq.unsqueeze(-1).expand_as(mb)
            stat = per_seq.unsqueeze(-1).expand_as(mask)
        level = "token" if o.startswith("token") else "sequence"
        kf = keep.to(log_ratio.dtype)
        combined = combined * kf
        seq_keep = (~((~keep) & mb)).all(dim=-1)
        m.update(v_rs_metrics(o, stat, mask, seq_valid, level, per_seq, hi_log if k1 else hi,
                              lo_log if k1 else 0.0, k1))
        m[f"rollout_rs_{o}_masked_fraction"] = v_masked_mean(1 - kf, mask).item()
        svf = seq_valid.float()
        m[f"rollout_rs_{o}_seq_masked_fraction"] = (
            (((1.0 - seq_keep.to(log_ratio.dtype)) * svf).sum() / svf.sum()).item() if svf.sum() > 0 else 0.0)
    m["rollout_rs_masked_fraction"] = v_masked_mean(1 - combined, mask).item()
    fk = (combined > 0.5) & mb
    m["rollout_rs_seq_masked_fraction"] = (~fk & mb).any(dim=-1).float().mean().item()
    return (mask * combined).to(mask.dtype), m


# --- the comparison --------------------------------------------------------------------------

def batch(seed: int, rows: int = 16, length: int = 24, scale: float = 0.4):
    """Log ratios mostly near 0 with tails far past any bound (|x| up to ~25: the safety clamp),
    rows of different lengths, one row without valid tokens."""
    g = torch.Generator().manual_seed(seed)
    log_ratio = torch.randn(rows, length, generator=g) * scale
    tails = torch.rand(rows, length, generator=g) < 0.05
    log_ratio = torch.where(tails, torch.randn(rows, length, generator=g) * 8.0, log_ratio)
    lengths = torch.randint(1, length + 1, (rows,), generator=g)
    lengths[3] = 0
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    log_ratio[0, 0] = 25.0  # beyond the clamp
    return log_ratio, mask


def same_metrics(ours: dict, verl: dict) -> None:
    assert ours.keys() == verl.keys(), sorted(set(ours) ^ set(verl))
    for key in verl:
        assert ours[key] == pytest.approx(verl[key], rel=1e-5, abs=1e-6), key


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("rollout_is", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [2.0, "2.0", 5, "0.5_2.0", "0.8_1.25"])
@pytest.mark.parametrize("normalize", [False, True])
def test_weights_match_verl(seed, rollout_is, threshold, normalize):
    scale = 0.4 if rollout_is == "token" else 0.05  # a sequence's product stays near 1 sometimes
    log_ratio, mask = batch(seed, scale=scale)
    ours, m = algos.rollout_correction_weights(log_ratio, mask, rollout_is, threshold, normalize)
    ref, vm = v_weights(log_ratio, mask, rollout_is, threshold, normalize)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)
    same_metrics(m, vm)
    assert not ours.requires_grad


OPTIONS = ["token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
           "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3"]
THRESHOLDS = {"k1": ["0.5_2.0", "2.0", 1.5], "k2": ["0.02", 0.5], "k3": ["0.01", 1.0]}


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("seed", [0, 1])
def test_each_rejection_option_matches_verl(option, seed):
    log_ratio, mask = batch(seed)
    for threshold in THRESHOLDS[option[-2:]]:
        ours, m = algos.rollout_rejection_mask(log_ratio, mask, option, threshold)
        ref, vm = v_rejection(log_ratio, mask, option, threshold)
        assert torch.equal(ours, ref), (option, threshold)
        same_metrics(m, vm)


def test_chained_rejection_options_must_all_pass_as_in_verl():
    log_ratio, mask = batch(2)
    for rs, threshold in [("token_k1,seq_mean_k3", "0.5_2.0,0.05"), ("seq_max_k2,token_k3,seq_max_k2", "0.5"),
                          ("seq_sum_k3,seq_mean_k1", "1.0,0.9_1.1")]:
        ours, m = algos.rollout_rejection_mask(log_ratio, mask, rs, threshold)
        ref, vm = v_rejection(log_ratio, mask, rs, threshold)
        assert torch.equal(ours, ref), rs
        same_metrics(m, vm)
    one, _ = algos.rollout_rejection_mask(log_ratio, mask, "token_k1", "0.5_2.0")
    two, _ = algos.rollout_rejection_mask(log_ratio, mask, "seq_mean_k3", "0.05")
    both, _ = algos.rollout_rejection_mask(log_ratio, mask, "token_k1,seq_mean_k3", "0.5_2.0,0.05")
    assert torch.equal(both, one * two)  # AND of the criteria
    assert 0 < both.sum() < mask.sum()


def test_nan_at_padding_reaches_no_weight_or_mask():
    """Where verl's x * mask turns NaN at padding into NaN sums, the masked positions stay out."""
    log_ratio, mask = batch(3)
    poisoned = torch.where(mask.bool(), log_ratio, torch.full_like(log_ratio, float("nan")))
    for level in ("token", "sequence"):
        clean, _ = algos.rollout_correction_weights(log_ratio, mask, level, 2.0)
        weights, _ = algos.rollout_correction_weights(poisoned, mask, level, 2.0)
        torch.testing.assert_close(weights, clean)
    kept, _ = algos.rollout_rejection_mask(poisoned, mask, "seq_sum_k3", 1.0)
    assert torch.equal(kept, algos.rollout_rejection_mask(log_ratio, mask, "seq_sum_k3", 1.0)[0])


@pytest.mark.parametrize("call, message", [
    (lambda lr, m: algos.rollout_correction_weights(lr, m, "tokens"), "rollout_is must be one of token, sequence"),
    (lambda lr, m: algos.rollout_correction_weights(lr, m, "token", "2.0_0.5"), "lower <= upper"),
    (lambda lr, m: algos.rollout_correction_weights(lr, m, "token", True), "a number or a 'lower_upper' string"),
    (lambda lr, m: algos.rollout_correction_weights(lr, m, "token", "two"), "is not a number"),
    (lambda lr, m: algos.rollout_rejection_mask(lr, m, "token_k4", 1.0), "token_k4 unknown; choose from"),
    (lambda lr, m: algos.rollout_rejection_mask(lr, m, "seq_max_k1", 1.0), "seq_max_k1 unknown"),
    (lambda lr, m: algos.rollout_rejection_mask(lr, m, "token_k2"), "rollout_rs_threshold is required"),
    (lambda lr, m: algos.rollout_rejection_mask(lr, m, "token_k2", "0.5_2.0"), "one upper bound"),
    (lambda lr, m: algos.rollout_rejection_mask(lr, m, "token_k1,token_k2", "1,2,3"), "3 entries for 2"),
])
def test_bad_settings_are_clear_errors(call, message):
    log_ratio, mask = batch(0)
    with pytest.raises(AlgoError, match=message):
        call(log_ratio, mask)
