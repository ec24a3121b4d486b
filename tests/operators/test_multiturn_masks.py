"""`loss_mask` on a hand-built two-turn sample, token by token: a tool's tokens inside a response
are skipped by the advantage estimators (GAE, REINFORCE++: carried through, neither discounted
nor bootstrapped from), the KL penalty and the update's loss, exactly as if they were not there;
overlong filtering keeps them masked."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest

from dapo_flow.core import columns as C
from dapo_flow.core.contract import OpContext
from dapo_flow.graph.registry import OPERATORS

# row 0: turn 1 (3 model tokens, EOS included), a tool's observation (2 tokens), turn 2 (2 tokens)
# row 1: one turn of 2 tokens
FLAGS = [[1, 1, 1, 0, 0, 1, 1], [1, 1]]
RESPONSES = [[10, 11, 2, 20, 21, 12, 2], [13, 2]]


def _op(name: str, **params):
    cls = OPERATORS[name]
    return cls(cls.Params(**params), OpContext(node_id=name))


def _batch(per_token: dict[str, list[list[float]]], flags=FLAGS, responses=RESPONSES) -> pa.Table:
    cols = {
        C.PROMPT_ID: pa.array(["a", "b"]),
        C.PROMPT_IDS: pa.array([[1, 5], [1, 6]], C.TOKENS),
        C.RESPONSE_IDS: pa.array(responses, C.TOKENS),
        C.RESPONSE_LEN: pa.array([len(r) for r in responses], pa.int32()),
        C.TRUNCATED: pa.array([False, False]),
        C.SCORE: pa.array([1.0, -1.0], pa.float32()),
    }
    if flags is not None:
        cols[C.LOSS_MASK] = pa.array(flags, C.TOKEN_FLAGS)
    cols.update({name: pa.array(v, C.TOKEN_FLOATS) for name, v in per_token.items()})
    return pa.table(cols)


def _flat(rows: list[list[float]]) -> list[float]:
    return [v for row in rows for v in row]


def _compact(values: list[list[float]]) -> list[list[float]]:
    """The values of the model's tokens only: the sample as if the tool's tokens were not there."""
    return [[v for v, f in zip(row, flags) if f] for row, flags in zip(values, FLAGS)]


COMPACT_RESPONSES = _compact(RESPONSES)
VALUES = [[0.1, 0.4, -0.2, 9.0, -9.0, 0.3, 0.5], [0.2, -0.1]]  # junk on the tool's tokens


@pytest.mark.parametrize("estimator", ["reinforce_pp", "gae"])
def test_token_level_advantages_skip_the_tool_tokens(estimator):
    op_params = dict(estimator=estimator, gamma=0.9, lam=0.8, reward_column="score")
    with_tool = _op("advantage", **op_params)(_batch({C.VALUES: VALUES}))
    without = _op("advantage", **op_params)(_batch({C.VALUES: _compact(VALUES)}, flags=None,
                                                     responses=COMPACT_RESPONSES))
    adv = with_tool.column(C.TOKEN_ADVANTAGE).to_pylist()
    assert adv[0][3:5] == [0.0, 0.0]  # the tool's tokens get no advantage
    assert _flat(_compact(adv)) == pytest.approx(_flat(without.column(C.TOKEN_ADVANTAGE).to_pylist()))
    if estimator == "gae":  # the critic's targets too: 0 on the tool's tokens
        returns = with_tool.column(C.RETURNS).to_pylist()
        assert returns[0][3:5] == [0.0, 0.0]
        assert _flat(_compact(returns)) == pytest.approx(_flat(without.column(C.RETURNS).to_pylist()))


def test_reinforce_pp_carries_the_return_across_the_tool_tokens():
    out = _op("advantage", estimator="reinforce_pp", gamma=0.5, reward_column="score")(_batch({}))
    # returns-to-go of row 0 over its model tokens: 1 at the end, halved per model token only
    returns = np.array([0.0625, 0.125, 0.25, 0.5, 1.0, -0.5, -1.0])  # row 0's 5, then row 1's 2
    expected = (returns - returns.mean()) / np.sqrt(returns.var(ddof=1) + 1e-8)
    adv = out.column(C.TOKEN_ADVANTAGE).to_pylist()
    assert _flat(_compact(adv)) == pytest.approx(expected.tolist(), rel=1e-5)


def test_kl_penalty_counts_only_the_model_tokens():
    logp = [[-1.0, -2.0, -0.5, -3.0, -0.1, -1.0, -0.2], [-0.5, -1.0]]
    ref = [[-1.5, -1.75, -0.5, -0.1, -4.0, -1.0, -0.3], [-1.5, -1.0]]  # large gaps on the tool's tokens
    with_tool = _op("kl", kind="kl", coef=0.1, reward_column="score")(_batch({C.OLD_LOGP: logp, C.REF_LOGP: ref}))
    without = _op("kl", kind="kl", coef=0.1, reward_column="score")(
        _batch({C.OLD_LOGP: _compact(logp), C.REF_LOGP: _compact(ref)}, flags=None, responses=COMPACT_RESPONSES))
    assert with_tool.column(C.REWARD).to_pylist() == pytest.approx(without.column(C.REWARD).to_pylist())
    assert with_tool.column(C.REWARD).to_pylist()[0] == pytest.approx(1.0 - 0.1 * (0.5 - 0.25 + 0 + 0 + 0.1))


def test_update_trains_on_the_model_tokens_only(tiny_adder_path):
    import torch

    from dapo_flow.graph.spec import ModelSpec
    from dapo_flow.models.hf import HFPolicy

    cls = OPERATORS["update"]
    logp = [[-1.0] * 7, [-1.0] * 2]
    batch = _batch({C.OLD_LOGP: logp}).append_column(C.ADVANTAGE, pa.array([1.0, -1.0], pa.float32()))
    # the mask the loss is taken over (the op's own array builder, on its resolved params)
    use = cls._arrays(SimpleNamespace(params=cls.Params(loss_mask="use")), batch)["mask"]
    assert use.astype(int).tolist() == [[1, 1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 0, 0, 0]]
    ignore = cls._arrays(SimpleNamespace(params=cls.Params(loss_mask="ignore")), batch)["mask"]
    assert ignore.astype(int).tolist() == [[1] * 7, [1, 1, 0, 0, 0, 0, 0]]

    # ... and the loss is: a step on junk old logprobs at the tool's tokens is the step on sane
    # ones, as it is not when the mask is ignored (tokens within tiny-adder's vocabulary)
    policy = HFPolicy(tiny_adder_path, trainable=True)
    state = {k: v.detach().clone() for k, v in policy.model.state_dict().items()}
    responses = [[10, 11, 2, 14, 15, 12, 2], [13, 2]]
    junk = [[-1.0, -1.0, -1.0, -6.0, 3.0, -1.0, -1.0], [-1.0] * 2]

    def step(old_logp, loss_mask):
        policy.model.load_state_dict(state)
        table = _batch({C.OLD_LOGP: old_logp}, responses=responses).append_column(
            C.ADVANTAGE, pa.array([1.0, -1.0], pa.float32()))
        op = cls(cls.Params(lr=1e-3, loss_mask=loss_mask),
                 OpContext("train", model=SimpleNamespace(policy=policy, spec=ModelSpec(path="builtin:tiny-adder"))))
        loss = op(table).to_pylist()[0]["actor/pg_loss"]
        return loss, [p.detach().clone() for p in policy.model.parameters()]

    (sane, w_sane), (masked, w_masked) = step(logp, "use"), step(junk, "use")
    assert masked == sane and all(torch.equal(a, b) for a, b in zip(w_sane, w_masked))
    assert step(junk, "ignore")[0] != step(logp, "ignore")[0]


def test_overlong_filter_keeps_the_tool_tokens_masked_and_drops_truncated_rows():
    batch = _batch({}).set_column(4, C.TRUNCATED, pa.array([False, True]))
    out = _op("overlong-filter")(batch)
    assert out.column(C.LOSS_MASK).to_pylist() == [FLAGS[0], [0, 0]]
