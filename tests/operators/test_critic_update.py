"""critic-update: one real step of the value model against old values the clip binds on (the
clipped loss of algos.value_loss, hand-worked on the zero head; a run's first step has none), and
with a tool's tokens masked out of the loss."""

from __future__ import annotations

from types import SimpleNamespace

import pyarrow as pa
import pytest

from dapo_flow.core import columns as C
from dapo_flow.core.contract import OpContext
from dapo_flow.graph.spec import ModelSpec
from dapo_flow.operators.critic_update import CriticUpdate, Params


@pytest.mark.parametrize(("old", "clipped"), [(-2.0, True), (0.3, False)])
def test_the_value_clip_is_around_the_values_the_batch_was_scored_with(tiny_adder_path, old, clipped):
    """A zero head predicts V = 0 against returns R = 1. Old values -2 clip V into [-2.5, -1.5]:
    the clipped loss (-1.5 - 1)^2 = 6.25 beats (0 - 1)^2 = 1, so every token is clipped and has no
    gradient; old values 0.3 leave V = 0 unclipped: loss 1, a gradient. (Old values equal to the
    critic's, as on a run's first step, make the clip a no-op: it passed with the clip taken
    around the critic's own prediction.)"""
    from dapo_flow.models.hf import HFPolicy

    critic = HFPolicy(tiny_adder_path, head="value", trainable=True)
    tok = critic.tokenizer
    prompts = [tok.encode(p) for p in ("1+2=", "10+32=", "7+7=")]
    responses = [tok.encode(r)[1:] for r in ("3", "42", "14")]  # no BOS inside a response
    batch = pa.table({
        C.PROMPT_IDS: pa.array(prompts, C.TOKENS),
        C.RESPONSE_IDS: pa.array(responses, C.TOKENS),
        C.VALUES: pa.array([[old] * len(r) for r in responses], C.TOKEN_FLOATS),
        C.RETURNS: pa.array([[1.0] * len(r) for r in responses], C.TOKEN_FLOATS),
    })
    ctx = OpContext("critic_train", model=SimpleNamespace(policy=critic, spec=ModelSpec(path="builtin:tiny-adder")))
    row = CriticUpdate(Params(lr=1e-3), ctx)(batch).to_pylist()[0]
    assert row["critic/vpred_mean"] == 0.0  # the zero head, before the step
    assert row["critic/vf_loss"] == pytest.approx(0.5 * (6.25 if clipped else 1.0))
    assert row["critic/vf_clipfrac"] == float(clipped)
    assert (row["critic/grad_norm"] == 0.0) == clipped, row["critic/grad_norm"]


def test_the_critic_learns_nothing_at_a_tools_tokens(tiny_adder_path):
    """`loss_mask` 0 (a tool's tokens) takes a token out of the value loss: junk old values and
    returns there (a clipped loss of 0.5 x (-1.5 - 5)^2 each) leave the hand-worked loss of the
    model's tokens, 0.5 x (0 - 1)^2."""
    from dapo_flow.models.hf import HFPolicy

    critic = HFPolicy(tiny_adder_path, head="value", trainable=True)
    tok = critic.tokenizer
    prompts = [tok.encode(p) for p in ("1+2=", "10+32=", "7+7=")]
    responses = [tok.encode(r)[1:] for r in ("3", "42", "14")]
    flags = [[1], [1, 0], [0, 1]]
    batch = pa.table({
        C.PROMPT_IDS: pa.array(prompts, C.TOKENS),
        C.RESPONSE_IDS: pa.array(responses, C.TOKENS),
        C.VALUES: pa.array([[0.3 if f else -2.0 for f in row] for row in flags], C.TOKEN_FLOATS),
        C.RETURNS: pa.array([[1.0 if f else 5.0 for f in row] for row in flags], C.TOKEN_FLOATS),
        C.LOSS_MASK: pa.array(flags, C.TOKEN_FLAGS),
    })
    ctx = OpContext("critic_train", model=SimpleNamespace(policy=critic, spec=ModelSpec(path="builtin:tiny-adder")))
    row = CriticUpdate(Params(lr=1e-3), ctx)(batch).to_pylist()[0]
    assert row["critic/vf_loss"] == pytest.approx(0.5) and row["critic/vf_clipfrac"] == 0.0
