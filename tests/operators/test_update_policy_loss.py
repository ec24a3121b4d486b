"""update's `policy_loss`: validation, and one real optimizer step per loss on the tiny model; the
entropy bonus (`entropy_coef`) raising the policy's entropy; the KL loss (`kl_coef`) pulling it
toward the reference; the ratio clipped at clip_low / clip_high; the logprob node and update at a
temperature other than 1."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
import torch
from pydantic import ValidationError

from dapo_flow import algos
from dapo_flow.core import columns as C
from dapo_flow.core.contract import OpContext
from dapo_flow.graph.spec import ModelSpec
from dapo_flow.operators.update import Params, Update


def test_params_policy_loss_validation():
    assert Params().policy_loss == "vanilla" and Params().clip_c == 10.0
    with pytest.raises(ValidationError, match="policy_loss"):
        Params(policy_loss="ppo")
    for name in ("gspo", "cispo", "gpg"):
        assert Params(policy_loss=name).policy_loss == name  # clip_c's default is vanilla's, not applied
        with pytest.raises(ValidationError, match=r"clip_c \(dual clip\) applies to policy_loss vanilla only.*"
                                                  r"set clip_c: null or remove it"):
            Params(policy_loss=name, clip_c=3.0)
        assert Params(policy_loss=name, clip_c=None).policy_loss == name
    assert Params(policy_loss="vanilla", clip_c=None).clip_c is None


@pytest.fixture(scope="module")
def batch_and_weights(tiny_adder_path):
    """A small batch whose old logprobs are the model's own (ratios start at 1, so even GSPO's
    1e-4-scale clip range lets the first step through), and the initial weights."""
    from dapo_flow.models.hf import HFPolicy

    policy = HFPolicy(tiny_adder_path, trainable=True)
    rows = 6
    prompts = [policy.tokenizer.encode(f"{i}+{i + 1}=") for i in range(rows)]
    responses = [policy.tokenizer.encode(str(2 * i + (i % 2))) + [policy.eos_id] for i in range(rows)]
    with torch.no_grad():
        logp, _, mask = policy.response_logprobs(prompts, responses, temperature=1.0)
    old = [row[: int(m.sum())].tolist() for row, m in zip(logp, mask)]
    batch = pa.table({
        C.PROMPT_IDS: pa.array(prompts, C.TOKENS),
        C.RESPONSE_IDS: pa.array(responses, C.TOKENS),
        C.OLD_LOGP: pa.array(old, C.TOKEN_FLOATS),
        C.ADVANTAGE: pa.array(np.linspace(-1, 1, rows, dtype=np.float32)),
    })
    state = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
    return policy, batch, state


def _run(policy, state, batch, **params):
    policy.model.load_state_dict(state)
    spec = ModelSpec(path="builtin:tiny-adder")
    ctx = OpContext("train", model=SimpleNamespace(policy=policy, spec=spec))
    op = Update(Params(lr=1e-3, mini_batches=2, **params), ctx)
    row = op(batch).to_pylist()[0]
    return row, {k: v.detach().clone() for k, v in policy.model.state_dict().items()}


LOSSES = [
    ("vanilla", {}),
    ("gspo", {"clip_c": None, "clip_low": 3e-4, "clip_high": 4e-4}),
    ("cispo", {"clip_c": None}),
    ("gpg", {"clip_c": None}),
]


@pytest.mark.parametrize(("name", "params"), LOSSES)
def test_each_policy_loss_trains(batch_and_weights, name, params):
    policy, batch, state = batch_and_weights
    row, after = _run(policy, state, batch, policy_loss=name, **params)
    changed = [k for k in state if state[k].is_floating_point() and not torch.equal(state[k], after[k])]
    assert changed, f"{name}: no weight changed"
    assert all(np.isfinite(row[k]) for k in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl"))
    assert row["actor/grad_norm"] > 0 and row["actor/skipped_steps"] == 0.0
    if name == "gpg":
        assert row["actor/clipfrac"] == 0.0 and row["actor/clipfrac_lower"] == 0.0


def test_default_is_the_vanilla_loss_bit_for_bit(batch_and_weights, monkeypatch):
    """The default update calls algos.policy_loss with the same arguments as before the loss
    family existed (clip_c included): the weights after a step are bitwise those of a run whose
    loss is algos.policy_loss called directly."""
    policy, batch, state = batch_and_weights
    _, default = _run(policy, state, batch)
    calls = []

    def direct(old, logp, adv, mask, *, clip_low, clip_high, agg, clip_c, **kw):
        calls.append(clip_c)
        return algos.policy_loss(old, logp, adv, mask, clip_low=clip_low, clip_high=clip_high, clip_c=clip_c,
                                 agg=agg, **kw)

    monkeypatch.setitem(algos.POLICY_LOSSES, "vanilla", direct)
    _, via_direct = _run(policy, state, batch)
    assert calls and set(calls) == {10.0}
    assert all(torch.equal(default[k], via_direct[k]) for k in default)


def test_the_entropy_bonus_raises_the_policys_entropy(batch_and_weights):
    """entropy_coef > 0 subtracts coef x the aggregated entropy from the loss: the same steps on
    the same batch leave the policy measurably less certain than without the bonus."""
    policy, batch, state = batch_and_weights
    prompts = batch.column(C.PROMPT_IDS).to_pylist()
    responses = batch.column(C.RESPONSE_IDS).to_pylist()

    def entropy_after(coef: float) -> float:
        policy.model.load_state_dict(state)
        ctx = OpContext("train", model=SimpleNamespace(policy=policy, spec=ModelSpec(path="builtin:tiny-adder")))
        op = Update(Params(lr=3e-3, mini_batches=1, warmup_steps=0, entropy_coef=coef), ctx)
        rows = [op(batch).to_pylist()[0] for _ in range(6)]
        assert all(r["actor/skipped_steps"] == 0.0 for r in rows)
        with torch.no_grad():
            _, entropy, mask = policy.response_logprobs(prompts, responses, temperature=1.0, with_entropy=True)
        return float(entropy[mask].mean())

    plain, bonus = entropy_after(0.0), entropy_after(0.5)
    assert bonus > plain + 0.05, (plain, bonus)


@pytest.mark.parametrize(("shift", "kl_type", "first"), [
    (0.5, "low_var_kl", math.exp(0.5) - 1.5), (-0.5, "low_var_kl", math.exp(-0.5) - 0.5),  # e^d - d - 1
    (0.5, "mse", 0.125),  # d^2 / 2
], ids=["low_var_kl-up", "low_var_kl-down", "mse-up"])
def test_the_kl_loss_pulls_the_policy_toward_the_reference(batch_and_weights, shift, kl_type, first):
    """kl_coef > 0 adds coef x the KL (of kl_type) to ref_logp to the loss. With zero advantages (no
    policy gradient) and a reference that gives the sampled tokens `shift` more (less) logprob than the
    policy, steps lower the KL and raise (lower) the policy's logprobs of them. (A reference equal to the policy,
    as a run's first step has, gives the KL no gradient: it would not test the term.)"""
    policy, batch, state = batch_and_weights
    prompts = batch.column(C.PROMPT_IDS).to_pylist()
    responses = batch.column(C.RESPONSE_IDS).to_pylist()
    old = batch.column(C.OLD_LOGP).to_pylist()
    batch = batch.set_column(batch.schema.get_field_index(C.ADVANTAGE), C.ADVANTAGE,
                             pa.array(np.zeros(batch.num_rows, np.float32)))
    batch = batch.append_column(C.REF_LOGP, pa.array([[v + shift for v in row] for row in old], C.TOKEN_FLOATS))
    policy.model.load_state_dict(state)
    ctx = OpContext("train", model=SimpleNamespace(policy=policy, spec=ModelSpec(path="builtin:tiny-adder")))
    op = Update(Params(lr=1e-5, kl_coef=1.0, kl_type=kl_type), ctx)
    rows = [op(batch).to_pylist()[0] for _ in range(3)]
    with torch.no_grad():
        logp, _, mask = policy.response_logprobs(prompts, responses, temperature=1.0)
    moved = float(logp[mask].mean()) - float(np.mean(np.concatenate(old)))
    kl = [r["actor/kl_loss"] for r in rows]
    assert kl[0] == pytest.approx(first, rel=1e-4) and kl[0] > kl[1] > kl[2] > 0, kl
    assert all(r["actor/skipped_steps"] == 0.0 for r in rows)
    assert moved * np.sign(shift) > 0.05, moved


@pytest.mark.parametrize(("ratio", "adv", "clipped"), [
    (1.25, 1.0, False), (1.35, 1.0, True),  # clip-higher: 1.25 is inside 1 + clip_high = 1.28
    (0.85, -1.0, False), (0.75, -1.0, True),  # and the lower clip, 1 - clip_low = 0.8
])
def test_update_clips_the_ratio_at_its_own_bounds(batch_and_weights, ratio, adv, clipped):
    """The clip range update hands its loss is (1 - clip_low, 1 + clip_high): every token's ratio
    set to `ratio` (old logprobs the model's own minus log ratio), between the symmetric bound and
    clip-higher's or past both, is clipped (no gradient, clipfrac 1) or not as that range says.
    (Ratios of 1, as in a step on fresh rollouts, are clipped by no range.)"""
    policy, batch, state = batch_and_weights
    old = [[v - math.log(ratio) for v in row] for row in batch.column(C.OLD_LOGP).to_pylist()]
    batch = batch.set_column(batch.schema.get_field_index(C.OLD_LOGP), C.OLD_LOGP, pa.array(old, C.TOKEN_FLOATS))
    batch = batch.set_column(batch.schema.get_field_index(C.ADVANTAGE), C.ADVANTAGE,
                             pa.array(np.full(batch.num_rows, adv, np.float32)))
    policy.model.load_state_dict(state)
    ctx = OpContext("train", model=SimpleNamespace(policy=policy, spec=ModelSpec(path="builtin:tiny-adder")))
    row = Update(Params(lr=1e-3, clip_low=0.2, clip_high=0.28), ctx)(batch).to_pylist()[0]  # one step: at `ratio`
    assert row["actor/clipfrac"] == pytest.approx(float(clipped))
    assert (row["actor/grad_norm"] == 0.0) == clipped, row["actor/grad_norm"]


def test_the_logprob_node_and_update_score_tokens_at_their_temperature(batch_and_weights):
    """At temperature 0.7 (every graph in the tests samples at 1, where dividing the logits is a
    no-op): the logprob node's old logprobs are the policy's at 0.7, not at 1, and update's first
    ratios against them are 1 (ppo_kl 0), as they are not against logprobs at 1."""
    from dapo_flow.operators.logprob import Logprob, Params as LogprobParams

    policy, batch, state = batch_and_weights
    policy.model.load_state_dict(state)
    ctx = OpContext("old_logp", model=SimpleNamespace(policy=policy, spec=ModelSpec(path="builtin:tiny-adder")))
    scored = Logprob(LogprobParams(temperature=0.7, with_entropy=False), ctx)(batch.drop_columns([C.OLD_LOGP]))
    prompts, responses = batch.column(C.PROMPT_IDS).to_pylist(), batch.column(C.RESPONSE_IDS).to_pylist()
    with torch.no_grad():
        logp, _, mask = policy.response_logprobs(prompts, responses, temperature=0.7)
    at_07 = np.concatenate(scored.column(C.OLD_LOGP).to_pylist())
    np.testing.assert_allclose(at_07, logp[mask].numpy(), atol=1e-6, rtol=0)
    at_1 = np.concatenate(batch.column(C.OLD_LOGP).to_pylist())  # the fixture's: the policy's at 1
    assert np.abs(at_07 - at_1).max() > 0.05

    def first_ratio_kl(table, temperature):
        policy.model.load_state_dict(state)
        ctx = OpContext("train", model=SimpleNamespace(policy=policy, spec=ModelSpec(path="builtin:tiny-adder")))
        return Update(Params(lr=1e-3, temperature=temperature), ctx)(table).to_pylist()[0]["actor/ppo_kl"]

    assert abs(first_ratio_kl(scored, 0.7)) < 1e-6
    assert abs(first_ratio_kl(batch, 0.7)) > 1e-3  # logprobs at 1: ratios off 1


def test_update_steps_on_the_policy_loss_it_names(batch_and_weights):
    """At the fixture's ratios of 1 the four losses take one step (-A x the gradient of logp), so
    training alone cannot tell them apart: with old logprobs shifted token by token their values
    differ, and update's first pg_loss is the named one's of algos on the policy's logprobs."""
    from dapo_flow.data.arrow_utils import ragged_to_padded

    policy, batch, state = batch_and_weights
    rng = np.random.default_rng(0)
    old = [[v + float(rng.uniform(-0.4, 0.4)) for v in row] for row in batch.column(C.OLD_LOGP).to_pylist()]
    batch = batch.set_column(batch.schema.get_field_index(C.OLD_LOGP), C.OLD_LOGP, pa.array(old, C.TOKEN_FLOATS))
    policy.model.load_state_dict(state)
    with torch.no_grad():
        logp, _, mask = policy.response_logprobs(batch.column(C.PROMPT_IDS).to_pylist(),
                                                 batch.column(C.RESPONSE_IDS).to_pylist(), temperature=1.0)
    old_logp = torch.from_numpy(ragged_to_padded(batch.column(C.OLD_LOGP), dtype=np.float32)[0])
    adv = torch.tensor(batch.column(C.ADVANTAGE).to_numpy())[:, None].expand_as(logp)
    losses = {}
    for name, params in LOSSES:
        p = Params(**params)
        extra = {"clip_c": p.clip_c} if name == "vanilla" else {}
        want, _ = algos.POLICY_LOSSES[name](old_logp, logp, adv, mask, clip_low=p.clip_low, clip_high=p.clip_high,
                                            agg="token-mean", **extra)
        policy.model.load_state_dict(state)
        ctx = OpContext("train", model=SimpleNamespace(policy=policy, spec=ModelSpec(path="builtin:tiny-adder")))
        row = Update(Params(lr=1e-3, policy_loss=name, **params), ctx)(batch).to_pylist()[0]
        assert row["actor/pg_loss"] == pytest.approx(float(want), rel=1e-5, abs=1e-7), name
        losses[name] = float(want)
    assert len({round(v, 5) for v in losses.values()}) == len(LOSSES), losses
