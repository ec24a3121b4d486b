"""CPU operators called directly on Arrow tables: the numbers they write are algos' numbers."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from dapo_flow import algos
from dapo_flow import columns as C
from dapo_flow.contract import OpContext, requires, resolve
from dapo_flow.registry import OPERATORS


def _table(scores, prompt_ids, lengths, acc=None) -> pa.Table:
    cols = {
        C.PROMPT_ID: pa.array(prompt_ids, pa.string()),
        C.SCORE: pa.array(np.asarray(scores, np.float32)),
        C.RESPONSE_LEN: pa.array(np.asarray(lengths, np.int32)),
    }
    if acc is not None:
        cols[C.ACC] = pa.array(np.asarray(acc, np.float32))
    return pa.table(cols)


def _op(name: str, **params):
    cls = OPERATORS[name]
    return cls(cls.Params(**params), OpContext(node_id=name))


BATCH = _table(
    scores=[1.0, -1.0, 1.0, 1.0, -1.0, -1.0, 0.7, 0.7, 2.0],
    prompt_ids=["a", "a", "a", "b", "b", "b", "c", "c", "d"],
    lengths=[3, 8, 5, 2, 7, 7, 4, 6, 1],
    acc=[1, 0, 1, 1, 0, 0, 1, 1, 1],
)


def test_overlong_shape_adds_penalty_to_score():
    out = _op("overlong-shape", max_len=8, buffer_len=4, factor=1.0)(BATCH)
    # expected length 8 - 4 = 4: L=5 -> -0.25, L=6 -> -0.5, L=7 -> -0.75, L=8 -> -1; L<=4 -> 0
    penalty = np.array([0, -1, -0.25, 0, -0.75, -0.75, 0, -0.5, 0], np.float32)
    assert np.array_equal(out.column(C.OVERLONG_PENALTY).to_numpy(), penalty)
    assert np.allclose(out.column(C.REWARD).to_numpy(), BATCH.column(C.SCORE).to_numpy() + penalty)
    assert out.column(C.ACC).equals(BATCH.column(C.ACC))  # acc keeps the score before the penalty


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp_baseline", "grpo_passk", "opo"])
def test_advantage_op_is_sequence_advantages(estimator):
    batch = BATCH.slice(0, 8)  # grpo_passk needs >= 2 per group
    out = _op("advantage", estimator=estimator, reward_column="score")(batch)
    expected = algos.sequence_advantages(
        batch.column(C.SCORE).to_numpy(), batch.column(C.PROMPT_ID).to_pylist(), estimator,
        lengths=batch.column(C.RESPONSE_LEN).to_numpy(),
    )
    assert np.array_equal(out.column(C.ADVANTAGE).to_numpy(), expected)
    assert out.schema.field(C.ADVANTAGE).type == pa.float32()


def test_advantage_reward_column_auto_follows_upstream():
    cls = OPERATORS["advantage"]
    auto = cls.Params()
    assert auto.reward_column == "auto"
    with_shaping = resolve(cls, auto, {C.SCORE: pa.float32(), C.REWARD: pa.float32()})
    without = resolve(cls, auto, {C.SCORE: pa.float32()})
    assert (with_shaping.reward_column, without.reward_column) == ("reward", "score")
    assert C.SCORE in requires(cls, without) and C.REWARD in requires(cls, with_shaping)
    explicit = cls.Params(reward_column="reward")
    assert resolve(cls, explicit, {C.SCORE: pa.float32()}) == explicit  # an explicit choice stays
    # the op reads the resolved column: shaped rewards give different advantages than scores
    shaped = _op("overlong-shape", max_len=8, buffer_len=4)(BATCH)
    adv_reward = cls(with_shaping, OpContext("adv"))(shaped).column(C.ADVANTAGE).to_numpy()
    adv_score = cls(without, OpContext("adv"))(shaped).column(C.ADVANTAGE).to_numpy()
    assert not np.array_equal(adv_reward, adv_score)


def test_group_filter_drops_constant_groups_keeps_singletons():
    out = _op("group-filter", metric="acc")(BATCH)
    # a: acc 1,0,1 kept; b: 1,0,0 kept; c: 1,1 dropped; d: singleton kept
    assert out.column(C.PROMPT_ID).to_pylist() == ["a", "a", "a", "b", "b", "b", "d"]
    shaped = _op("overlong-shape", max_len=8, buffer_len=4)(BATCH)
    # c is all-correct but its members got different penalties: kept on the shaped reward
    kept = _op("group-filter", metric="reward")(shaped).column(C.PROMPT_ID).to_pylist()
    assert kept.count("c") == 2


def _logp_table(scores, logp, ref, truncated=None) -> pa.Table:
    t = pa.table({
        C.PROMPT_ID: pa.array(["a"] * len(scores)),
        C.SCORE: pa.array(np.asarray(scores, np.float32)),
        C.OLD_LOGP: pa.array(logp, C.SCHEMA[C.OLD_LOGP]),
        C.REF_LOGP: pa.array(ref, C.SCHEMA[C.REF_LOGP]),
    })
    if truncated is not None:
        t = t.append_column(C.TRUNCATED, pa.array(truncated, pa.bool_()))
    return t


def test_kl_op_penalizes_the_summed_token_kl():
    # row 0: logp - ref = [0.5, -0.25] -> k1 sum 0.25; row 1: [1.0] -> 1.0 (ragged: one token)
    batch = _logp_table([1.0, -1.0], [[-1.0, -2.0], [-0.5]], [[-1.5, -1.75], [-1.5]])
    op = _op("kl", kind="kl", coef=0.1, reward_column="score")
    out = op(batch)
    assert np.allclose(out.column(C.KL).to_numpy(), [0.25, 1.0])
    assert np.allclose(out.column(C.REWARD).to_numpy(), [1.0 - 0.025, -1.0 - 0.1])
    # verl's controller input: mean over rows of each row's token-mean KL = (0.125 + 1.0) / 2
    assert op.last_metrics() == pytest.approx({"kl/reward_penalty": 0.5625, "kl/coef": 0.1})
    assert op.coef == 0.1  # fixed coefficient without target_kl


def test_kl_op_adaptive_coef_follows_verl_and_is_checkpointed():
    batch = _logp_table([1.0, -1.0], [[-1.0, -2.0], [-0.5]], [[-1.5, -1.75], [-1.5]])
    op = _op("kl", coef=0.1, target_kl=0.25, horizon=10, reward_column="score")
    op(batch)
    # current 0.5625 / target 0.25 - 1 = 1.25 -> clipped to 0.2; x (1 + 0.2 * 2 rows / 10)
    assert op.coef == pytest.approx(0.1 * 1.04)
    assert op.last_metrics()["kl/coef"] == 0.1  # the coefficient this step used
    fresh = _op("kl", coef=0.1, target_kl=0.25, horizon=10, reward_column="score")
    fresh.load_state_dict(op.state_dict())
    assert fresh.coef == op.coef


def test_overlong_filter_masks_truncated_rows_and_ands_upstream_masks():
    batch = _logp_table([1, 1, 1], [[0.0]] * 3, [[0.0]] * 3, truncated=[False, True, False])
    out = _op("overlong-filter")(batch)
    assert out.column(C.LOSS_MASK).to_pylist() == [True, False, True]
    again = _op("overlong-filter")(out.set_column(out.schema.get_field_index(C.LOSS_MASK), C.LOSS_MASK,
                                                   pa.array([False, True, True])))
    assert again.column(C.LOSS_MASK).to_pylist() == [False, False, True]


def test_update_uses_loss_mask_when_upstream_makes_it():
    cls = OPERATORS["update"]
    assert resolve(cls, cls.Params(), {C.LOSS_MASK: pa.bool_()}).loss_mask == "use"
    assert resolve(cls, cls.Params(), {}).loss_mask == "ignore"
    assert C.LOSS_MASK in requires(cls, cls.Params(loss_mask="use"))
    assert C.LOSS_MASK not in requires(cls, cls.Params(loss_mask="ignore"))
