"""On-policy distillation: the per-token advantage against a direct computation, the `advantage`
node's distill estimator and distill_coef, and the logprob node's teacher role."""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa
import pytest
import torch
from pydantic import ValidationError

from dapo_flow import algos
from dapo_flow.core import columns as C
from dapo_flow.core.contract import OpContext, produces, requires
from dapo_flow.operators import advantage, logprob

STUDENT = [[-0.5, -1.25, -2.0], [-0.75], [-0.1, -3.0]]
TEACHER = [[-0.25, -2.0, -0.5], [-0.75], [-1.1, -0.5]]


def _flat(rows: list[list[float]]) -> list[float]:
    return [v for row in rows for v in row]


def _batch(**extra) -> pa.Table:
    return pa.table({
        C.PROMPT_ID: pa.array(["a", "a", "b"]),
        C.RESPONSE_LEN: pa.array([3, 1, 2], pa.int32()),
        C.OLD_LOGP: pa.array(STUDENT, C.TOKEN_FLOATS),
        C.TEACHER_LOGP: pa.array(TEACHER, C.TOKEN_FLOATS),
        **extra,
    })


def test_distill_advantage_is_the_teachers_minus_the_students_logprob_on_valid_tokens():
    student = torch.tensor([[-0.5, -1.25, -2.0], [-0.75, 0.0, float("nan")]])
    teacher = torch.tensor([[-0.25, -2.0, -0.5], [-0.75, 7.0, 1.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    adv = algos.distill_advantages(student, teacher, mask)
    expected = [[0.25, -0.75, 1.5], [0.0, 0.0, 0.0]]  # NaN past the response never leaks
    assert adv.tolist() == expected
    # k1 estimate of KL(student || teacher): mean of log s - log t over the 4 valid tokens
    assert algos.reverse_kl_per_token(student, teacher, mask) == pytest.approx((-0.25 + 0.75 - 1.5 + 0.0) / 4)
    with pytest.raises(algos.AlgoError, match="NaN or inf"):
        algos.distill_advantages(student, teacher, torch.ones(2, 3))


def test_distill_clip_bounds_each_tokens_advantage_and_not_the_reverse_kl():
    student = torch.tensor([[-0.5, -0.1, -2.0]])
    teacher = torch.tensor([[-0.25, -19.0, -0.5]])  # a sharp teacher: one token all but ruled out
    mask = torch.ones(1, 3)
    assert algos.distill_advantages(student, teacher, mask, clip=1.0).tolist() == [[0.25, -1.0, 1.0]]
    op = advantage.Advantage(advantage.Params(estimator="distill", distill_coef=2.0, distill_clip=0.5),
                             OpContext(node_id="adv", seed=0, model=None))
    out = op(_batch()).column(C.TOKEN_ADVANTAGE).to_pylist()
    clipped = [[2 * min(max(t - s, -0.5), 0.5) for s, t in zip(srow, trow)] for srow, trow in zip(STUDENT, TEACHER)]
    assert _flat(out) == pytest.approx(_flat(clipped))
    tokens = [s - t for srow, trow in zip(STUDENT, TEACHER) for s, t in zip(srow, trow)]
    assert op.last_metrics()["distill/reverse_kl"] == pytest.approx(np.mean(tokens))  # the divergence itself
    with pytest.raises(ValidationError, match="greater than 0"):
        advantage.Params(estimator="distill", distill_coef=1.0, distill_clip=0.0)


def test_distill_alone_needs_no_reward_and_gives_each_token_its_own_advantage():
    params = advantage.Params(estimator="distill", distill_coef=2.0)
    assert set(requires(advantage.Advantage, params)) == {C.PROMPT_ID, C.RESPONSE_LEN, C.OLD_LOGP, C.TEACHER_LOGP}
    assert set(produces(advantage.Advantage, params)) == {C.TOKEN_ADVANTAGE}
    op = advantage.Advantage(params, OpContext(node_id="adv", seed=0, model=None))
    out = op(_batch()).column(C.TOKEN_ADVANTAGE).to_pylist()
    assert [len(r) for r in out] == [3, 1, 2]
    expected = [[2 * (t - s) for s, t in zip(srow, trow)] for srow, trow in zip(STUDENT, TEACHER)]
    assert _flat(out) == pytest.approx(_flat(expected))
    tokens = [s - t for srow, trow in zip(STUDENT, TEACHER) for s, t in zip(srow, trow)]
    assert op.last_metrics()["distill/reverse_kl"] == pytest.approx(np.mean(tokens))
    with pytest.raises(ValidationError, match="set distill_coef: 1.0"):
        advantage.Params(estimator="distill")


def test_rl_plus_distillation_adds_the_weighted_term_to_the_broadcast_grpo_advantage():
    params = advantage.Params(estimator="grpo", distill_coef=0.5, reward_column="score")
    assert C.SCORE in requires(advantage.Advantage, params)
    assert set(produces(advantage.Advantage, params)) == {C.TOKEN_ADVANTAGE}  # per token now
    assert set(produces(advantage.Advantage, params.model_copy(update={"distill_coef": 0.0}))) == {C.ADVANTAGE}
    scores = [1.0, -1.0, 1.0]
    op = advantage.Advantage(params, OpContext(node_id="adv", seed=0, model=None))
    out = op(_batch(**{C.SCORE: pa.array(scores, pa.float32())})).column(C.TOKEN_ADVANTAGE).to_pylist()
    # group a: (+-1 - 0) / (unbiased std sqrt(2) + 1e-6); group b alone: 1 / (1 + 1e-6)
    seq = [1 / (math.sqrt(2) + 1e-6), -1 / (math.sqrt(2) + 1e-6), 1 / (1 + 1e-6)]
    expected = [[a + 0.5 * (t - s) for s, t in zip(srow, trow)] for a, srow, trow in zip(seq, STUDENT, TEACHER)]
    assert [len(r) for r in out] == [3, 1, 2]
    assert _flat(out) == pytest.approx(_flat(expected), rel=1e-5)


def test_the_teacher_role_writes_teacher_logp_and_never_takes_the_rollouts():
    assert set(produces(logprob.Logprob, logprob.Params(role="teacher"))) == {C.TEACHER_LOGP}
    with pytest.raises(ValidationError, match="use source: recompute for role teacher"):
        logprob.Params(role="teacher", source="rollout")
