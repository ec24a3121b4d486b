"""The rollout-correction operator: IS weights and rejection from old_logp against rollout_logp,
and update's use of the weights (a run with the node inserted: tests/runtime)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
import torch

from dapo_flow import algos
from dapo_flow.data.arrow_utils import ragged_to_padded
from dapo_flow.core import columns as C
from dapo_flow.operators.rollout_correction import Params, RolloutCorrection


def rows(seed: int = 0, n: int = 6, loss_mask: bool = False) -> pa.Table:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 9, n)
    rollout = [rng.normal(-1.0, 0.5, k).astype(np.float32) for k in lengths]
    # the trainer's logprobs: near the engine's, one token far off in row 0
    old = [r + rng.normal(0, 0.05, len(r)).astype(np.float32) for r in rollout]
    old[0][0] += 3.0
    cols = {C.RESPONSE_LEN: pa.array(lengths, pa.int32()),
            C.ROLLOUT_LOGP: pa.array([r.tolist() for r in rollout], C.TOKEN_FLOATS),
            C.OLD_LOGP: pa.array([o.tolist() for o in old], C.TOKEN_FLOATS)}
    if loss_mask:
        cols[C.LOSS_MASK] = pa.array([[1] * (k - 1) + [0] for k in lengths], C.TOKEN_FLAGS)
    return pa.table(cols)


def padded(table: pa.Table, column: str) -> np.ndarray:
    return ragged_to_padded(table.column(column), dtype=np.float32)[0]


def test_weights_and_rejection_are_the_algos_of_the_log_ratio():
    table = rows()
    op = RolloutCorrection(Params(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1",
                                  rollout_rs_threshold="0.5_2.0"), ctx=None)
    out = op(table)
    old, rollout = padded(table, C.OLD_LOGP), padded(table, C.ROLLOUT_LOGP)
    lengths = table.column(C.RESPONSE_LEN).to_numpy()
    mask = torch.from_numpy((np.arange(old.shape[1])[None, :] < lengths[:, None]).astype(np.float32))
    log_ratio = torch.from_numpy(old - rollout)
    weights, wm = algos.rollout_correction_weights(log_ratio, mask, "token", 2.0)
    kept, rm = algos.rollout_rejection_mask(log_ratio, mask, "token_k1", "0.5_2.0")
    np.testing.assert_array_equal(padded(out, C.ROLLOUT_IS_WEIGHT), weights.numpy())
    np.testing.assert_array_equal(padded(out, C.LOSS_MASK), kept.numpy())
    assert padded(out, C.ROLLOUT_IS_WEIGHT)[0, 0] == 2.0  # the far token truncated at the threshold
    assert padded(out, C.LOSS_MASK)[0, 0] == 0.0  # ... and rejected
    metrics = op.last_metrics()
    assert metrics["rollout_corr/rollout_is_mean"] == wm["rollout_is_mean"]
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == rm["rollout_rs_masked_fraction"] > 0
    assert metrics["rollout_corr/kl_k1"] == pytest.approx(float(-(log_ratio * mask).sum() / mask.sum()), rel=1e-5)
    assert metrics["rollout_corr/kl_k3"] > 0


def test_an_upstream_loss_mask_keeps_its_zeros_and_its_tokens_get_no_weight():
    table = rows(1, loss_mask=True)
    out = RolloutCorrection(Params(rollout_rs="seq_mean_k3", rollout_rs_threshold=10.0), ctx=None)(table)
    np.testing.assert_array_equal(padded(out, C.LOSS_MASK), padded(table, C.LOSS_MASK))  # nothing beyond: kept
    out = RolloutCorrection(Params(), ctx=None)(table)
    weights, flags = padded(out, C.ROLLOUT_IS_WEIGHT), padded(table, C.LOSS_MASK)
    assert (weights[flags == 0] == 0).all() and (weights[flags == 1] > 0).all()


@pytest.mark.parametrize("params, message", [
    (dict(rollout_is=None), "set rollout_is"),
    (dict(rollout_is_threshold="2.0_0.5"), "lower <= upper"),
    (dict(rollout_rs="token_k4", rollout_rs_threshold=1.0), "token_k4 unknown"),
    (dict(rollout_rs="token_k2"), "rollout_rs_threshold is required"),
    (dict(rollout_rs="token_k1,seq_mean_k3", rollout_rs_threshold="0.5_2.0,1,2"), "3 entries for 2"),
])
def test_bad_settings_are_validate_errors(params, message):
    with pytest.raises(ValueError, match=message):
        Params(**params)


@pytest.mark.parametrize("loss", sorted(algos.POLICY_LOSSES))
def test_every_policy_loss_scales_each_tokens_loss_by_its_weight(loss):
    """verl's pg_losses * rollout_is_weights before aggregation: weights of 1 change nothing."""
    g = torch.Generator().manual_seed(0)
    old = torch.randn(3, 5, generator=g) * 0.1 - 1.0
    logp = (old + torch.randn(3, 5, generator=g) * 0.1).requires_grad_()
    adv = torch.randn(3, 5, generator=g)
    mask = torch.ones(3, 5)
    mask[1, 3:] = 0
    weights = torch.rand(3, 5, generator=g) * 2
    fn = algos.POLICY_LOSSES[loss]
    kw = dict(clip_low=0.2, clip_high=0.28, agg="token-sum")
    plain, _ = fn(old, logp, adv, mask, **kw)
    ones, _ = fn(old, logp, adv, mask, rollout_is_weights=torch.ones(3, 5), **kw)
    torch.testing.assert_close(ones, plain)
    weighted, _ = fn(old, logp, adv, mask, rollout_is_weights=weights, **kw)
    # each token's loss reaches only its own logp (GSPO's sequence ratio is stop-gradient), so
    # the weighted gradient is the weights times the plain one, token by token
    (grad_w,) = torch.autograd.grad(weighted, logp)
    (grad_plain,) = torch.autograd.grad(plain, logp)
    torch.testing.assert_close(grad_w, weights * mask * grad_plain)
    assert not torch.equal(grad_w, grad_plain)


def test_update_uses_the_weights_when_they_reach_it():
    from dapo_flow.operators.update import Params as UpdateParams, Update

    available = {**C.typed(C.ROLLOUT_IS_WEIGHT, C.OLD_LOGP)}
    assert Update.resolve(UpdateParams(), available).rollout_is_weights == "use"
    assert C.ROLLOUT_IS_WEIGHT in Update.requires(Update.resolve(UpdateParams(), available))
    assert Update.resolve(UpdateParams(), {}).rollout_is_weights == "ignore"
    assert Update.resolve(UpdateParams(rollout_is_weights="ignore"), available).rollout_is_weights == "ignore"


def test_update_trains_on_each_rows_weight_as_on_its_advantage_times_it(tiny_adder_path):
    """update applies the weights it is given (the check above is only of its resolved params;
    a run's weights are ~1, which change nothing): a weight w on every token of a row trains as
    that row's advantage times w (a positive factor commutes with the clip and the dual clip), and
    unlike the unweighted batch."""
    from types import SimpleNamespace

    from dapo_flow.core.contract import OpContext
    from dapo_flow.graph.spec import ModelSpec
    from dapo_flow.models.hf import HFPolicy
    from dapo_flow.operators.update import Params as UpdateParams, Update

    policy = HFPolicy(tiny_adder_path, trainable=True)
    state = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
    prompts = [policy.tokenizer.encode(f"{i}+{i + 3}=") for i in range(4)]
    responses = [policy.tokenizer.encode(str(2 * i + 3)) + [policy.eos_id] for i in range(4)]
    adv, row_weights = np.array([1.0, -0.5, 0.8, -1.2], np.float32), np.array([2.0, 0.25, 0.5, 3.0], np.float32)
    base = {C.PROMPT_IDS: pa.array(prompts, C.TOKENS), C.RESPONSE_IDS: pa.array(responses, C.TOKENS),
            C.OLD_LOGP: pa.array([[-1.0] * len(r) for r in responses], C.TOKEN_FLOATS)}
    weighted = pa.table({**base, C.ADVANTAGE: pa.array(adv), C.ROLLOUT_IS_WEIGHT: pa.array(
        [[float(w)] * len(r) for w, r in zip(row_weights, responses)], C.TOKEN_FLOATS)})
    scaled = pa.table({**base, C.ADVANTAGE: pa.array(adv * row_weights)})
    plain = pa.table({**base, C.ADVANTAGE: pa.array(adv)})

    def train(batch):
        policy.model.load_state_dict(state)
        ctx = OpContext("train", model=SimpleNamespace(policy=policy, spec=ModelSpec(path="builtin:tiny-adder")))
        op = Update(Update.resolve(UpdateParams(lr=1e-3), dict(zip(batch.column_names, batch.schema.types))), ctx)
        row = op(batch).to_pylist()[0]
        return row["actor/pg_loss"], {k: v.detach().clone() for k, v in policy.model.state_dict().items()}

    (loss_w, w), (loss_s, s), (loss_p, _) = train(weighted), train(scaled), train(plain)
    assert loss_w == pytest.approx(loss_s, rel=1e-5) and abs(loss_w - loss_p) > 1e-3, (loss_w, loss_s, loss_p)
    for name in w:
        torch.testing.assert_close(w[name], s[name], atol=1e-6, rtol=0, msg=name)
