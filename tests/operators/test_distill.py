"""On-policy distillation: the per-token advantage against a direct computation, the `advantage`
node's distill estimator and distill_coef, and the logprob node's teacher role; top-K
distillation (the forward KL on a teacher's top-K, update's distill_topk_coef) against a direct
computation and on the policy's logprob paths."""

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
from dapo_flow.operators import advantage, logprob, update

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


# --- top-K distillation: the forward KL on the teacher's top-K (update's distill_topk_coef) --------

def test_topk_forward_kl_is_the_full_forward_kl_at_k_vocab_and_its_top_k_terms_below():
    gen = torch.Generator().manual_seed(0)
    t_logits, s_logits = torch.randn(2, 3, 6, generator=gen) * 2, torch.randn(2, 3, 6, generator=gen)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    p_t, log_t, log_s = t_logits.softmax(-1), t_logits.log_softmax(-1), s_logits.log_softmax(-1)
    full = (p_t * (log_t - log_s)).sum(-1) * mask  # KL(teacher || student) per token, over the vocabulary
    ids, teacher = algos.vocab_logprobs(t_logits, top_k=6)
    student = algos.vocab_logprobs(s_logits.requires_grad_(), ids=ids)[1]
    torch.testing.assert_close(algos.topk_forward_kl(student, teacher, mask).detach(), full, atol=1e-6, rtol=0)
    # K = 2: only the teacher's two likeliest tokens, their probabilities not renormalised
    ids2, teacher2 = algos.vocab_logprobs(t_logits, top_k=2)
    assert torch.equal(ids2, ids[..., :2])
    partial = (p_t.gather(-1, ids2) * (log_t.gather(-1, ids2) - log_s.gather(-1, ids2))).sum(-1) * mask
    fkl = algos.topk_forward_kl(algos.vocab_logprobs(s_logits, ids=ids2)[1], teacher2, mask)
    torch.testing.assert_close(fkl.detach(), partial, atol=1e-6, rtol=0)
    # its gradient in the student's logits: the teacher-weighted cross-entropy's, 0 on masked tokens
    fkl.sum().backward()
    top = torch.zeros_like(s_logits).scatter(-1, ids2, p_t.gather(-1, ids2))
    expected = (top.sum(-1, keepdim=True) * s_logits.detach().softmax(-1) - top) * mask[..., None]
    torch.testing.assert_close(s_logits.grad, expected, atol=1e-6, rtol=0)
    with pytest.raises(algos.AlgoError, match="NaN or inf"):
        algos.topk_forward_kl(student, torch.full_like(teacher, float("nan")), mask)
    with pytest.raises(algos.AlgoError, match="exactly one"):
        algos.vocab_logprobs(t_logits)


def test_the_teacher_top_k_columns_are_declared_only_with_the_options():
    teacher = logprob.Params(role="teacher", top_k=4)
    assert set(produces(logprob.Logprob, teacher)) == {C.TEACHER_LOGP, C.TEACHER_TOPK_IDS, C.TEACHER_TOPK_LOGP}
    assert produces(logprob.Logprob, teacher)[C.TEACHER_TOPK_IDS] == pa.list_(pa.list_(pa.int32()))
    with pytest.raises(ValidationError, match="set role: teacher"):
        logprob.Params(role="ref", top_k=4)
    needs = requires(update.Update, update.Params(distill_topk_coef=0.5))
    assert {C.TEACHER_TOPK_IDS, C.TEACHER_TOPK_LOGP} <= set(needs)
    assert "actor/distill_fkl" in produces(update.Update, update.Params(distill_topk_coef=0.5))
    assert C.TEACHER_TOPK_IDS not in requires(update.Update, update.Params())
    assert "actor/distill_fkl" not in produces(update.Update, update.Params())


def test_top_k_logprobs_agree_on_the_padded_packed_and_shared_prompt_paths(tiny_adder_path):
    """The teacher's top-K (no gradient, micro-batched) and a student's logprobs at those ids
    (gradient pass) are log_softmax's values at them on every logprob path that keeps logits."""
    from dapo_flow.errors import ModelError
    from dapo_flow.models.hf import HFPolicy

    prompts, responses = [[1, 5, 6, 7], [1, 5, 6, 7], [1, 8, 9]], [[3, 4, 2], [5], [6, 7]]
    teacher = HFPolicy(tiny_adder_path)
    logp, _, mask, (ids, top) = teacher.response_logprobs(prompts, responses, top_k=5, micro_batch_size=2)
    assert ids.shape == top.shape == (3, 3, 5) and bool((top[mask][:, :-1] >= top[mask][:, 1:]).all())
    assert bool((ids[~mask] == 0).all() and (top[~mask] == 0).all())
    vocab = teacher.model.get_output_embeddings().weight.shape[0]
    every = teacher.response_logprobs(prompts, responses, top_k=vocab)[3]
    torch.testing.assert_close(torch.logsumexp(every[1], -1)[mask], torch.zeros(int(mask.sum())), atol=1e-5, rtol=0)
    tokens = torch.tensor([r + [-1] * (3 - len(r)) for r in responses])  # (3, 3): each sampled token's id
    at_sampled = (every[1] * (every[0] == tokens[..., None])).sum(-1)  # its logprob among all vocab ids
    torch.testing.assert_close(at_sampled[mask], logp[mask], atol=1e-5, rtol=0)
    for kw in ({}, {"pack": True}, {"share_prompts": True}):
        student = HFPolicy(tiny_adder_path, trainable=True, **kw)
        s_logp, _, s_mask, (s_ids, at) = student.response_logprobs(prompts, responses, grad=True, at_ids=ids)
        assert torch.equal(s_ids, ids) and torch.equal(s_mask, mask), kw
        # the same weights as the teacher: its values at its own top-K
        torch.testing.assert_close(at.detach(), top, atol=1e-5, rtol=0, msg=str(kw))
        torch.testing.assert_close(s_logp.detach(), logp, atol=1e-5, rtol=0, msg=str(kw))
        algos.topk_forward_kl(at, top - 0.1, mask).sum().backward()  # reaches the weights
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in student.model.parameters()), kw
    chunked = HFPolicy(tiny_adder_path, trainable=True, logprob_chunk_tokens=4)
    with pytest.raises(ModelError, match="logprob_chunk_tokens: null"):
        chunked.response_logprobs(prompts, responses, grad=True, at_ids=ids)


def test_an_update_with_top_k_distillation_refuses_the_logprob_paths_that_keep_no_logits():
    from types import SimpleNamespace

    from dapo_flow.errors import ModelError
    from dapo_flow.graph.spec import ModelSpec

    for train, named in (({"logprob_chunk_tokens": 64}, "train.logprob_chunk_tokens: null"),
                         ({"strategy": "fsdp2", "workers": 2, "sequence_parallel": 2}, "train.sequence_parallel: 1")):
        model = SimpleNamespace(policy=None, spec=ModelSpec(path="x", train=train))
        with pytest.raises(ModelError, match=f"update 'train': distill_topk_coef .* set {named}"):
            update.Update(update.Params(distill_topk_coef=1.0), OpContext(node_id="train", seed=0, model=model))


def test_teacher_agreement_counts_the_sampled_tokens_that_are_the_teachers_top_1():
    from dapo_flow.operators.logprob import _top1_agreement

    top = torch.tensor([[[3, 1], [2, 0], [0, 0]], [[5, 4], [7, 1], [9, 2]]])  # (B=2, R=3, K=2)
    responses = [[3, 1], [5, 7, 8]]  # row 0: 2 tokens (the third position is padding)
    valid = np.array([[True, True, False], [True, False, True]])  # row 1's second token a tool's
    assert _top1_agreement(top, responses, valid) == pytest.approx(2 / 4)  # 3 and 5 agree; 1 and 8 do not
    assert _top1_agreement(top, responses, np.zeros((2, 3), bool)) == 0.0
