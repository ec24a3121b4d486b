"""harness-generate on builtin:tiny-agent: the calculator harness of graphs/harness.yaml plays
through the endpoint (tool results masked, nothing rewritten), and harnesses that misbehave
(raise, time out, never call the model, rewrite history, call it past the cap, return
nonsense) give masked, counted samples instead of a failed step."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from dapo_flow.core import columns as C
from dapo_flow.core.contract import OpContext
from dapo_flow.data.tool_arith import ToolArithTask
from dapo_flow.graph.spec import ModelSpec
from dapo_flow.models.hf import HFPolicy
from dapo_flow.operators.harness_generate import HarnessGenerate
from dapo_flow.runtime.resources import ModelResource

pytestmark = pytest.mark.models("tiny-agent")
ROOT = Path(__file__).resolve().parents[2]

BAD_HARNESSES = textwrap.dedent('''
    import asyncio

    async def raises(client, task):
        await client.completions.create(model="policy", prompt=task["prompt_text"], max_tokens=4)
        raise RuntimeError("the harness broke")

    async def sleeps(client, task):
        await asyncio.sleep(30)

    def never_calls(client, task):  # a plain function: run in a thread with a sync client
        return 1.0

    async def rewrites(client, task):
        first = await client.completions.create(model="policy", prompt=task["prompt_text"], max_tokens=4)
        await client.completions.create(model="policy", prompt="99*99=", max_tokens=4)
        return 1.0

    async def loops(client, task):  # a well-behaved conversation that never ends
        prompt = task["prompt_text"]
        while True:
            reply = await client.completions.create(model="policy", prompt=prompt, max_tokens=1)
            prompt += reply.choices[0].text

    async def nonsense(client, task):
        await client.completions.create(model="policy", prompt=task["prompt_text"], max_tokens=4)
        return "great"

    def fine(client, task):
        client.completions.create(model="policy", prompt=task["prompt_text"], max_tokens=4)
        return {"score": 0.5}
''')


@pytest.fixture(scope="module")
def model() -> ModelResource:
    from dapo_flow.models import resolve_model

    path = resolve_model("builtin:tiny-agent", progress=False)
    policy = HFPolicy(path)
    return ModelResource("policy", ModelSpec(path="builtin:tiny-agent"), path, policy, policy, policy.tokenizer)


def _prompts(model: ModelResource, count: int) -> pa.Table:
    problems = ToolArithTask().problems("val")[:count]
    return pa.table({C.PROMPT_ID: [str(p.index) for p in problems], C.PROMPT_TEXT: [p.prompt for p in problems],
                     C.PROMPT_IDS: pa.array([model.tokenizer.encode(p.prompt) for p in problems], C.TOKENS),
                     C.GROUND_TRUTH: [p.answer for p in problems]})


def _op(model: ModelResource, workdir: Path, node: str, **params) -> HarnessGenerate:
    return HarnessGenerate(HarnessGenerate.Params(**params),
                           OpContext(node_id=node, seed=0, model=model, models={"policy": model}, workdir=str(workdir)))


def test_the_calculator_harness_trains_on_the_exact_conversation(model):
    op = _op(model, ROOT, "rollout", harness="graphs/harnesses/calculator_agent.py:run", n=8, max_tokens=64,
             max_requests=4, format="compact")
    try:
        out = op(_prompts(model, 4))
    finally:
        op.close()
    metrics = op.last_metrics()
    assert out.num_rows == 32 and set(HarnessGenerate.PRODUCES) <= set(out.column_names)
    assert metrics["harness/masked_frac"] == 0.0  # the harness sends back what it got: nothing rewritten
    assert metrics["harness/engine_calls"] < 32  # the samples' requests share engine calls
    rows = out.to_pylist()
    called = [r for r in rows if r[C.NUM_TOOL_CALLS] > 0]
    assert called, "the warm start calls the calculator in about a fifth of its samples"
    for r in called:  # turn, the <result> the harness sent (masked), turn
        assert "<result>" in r[C.RESPONSE_TEXT] and r[C.NUM_TURNS] == 2
        assert 0 in r[C.LOSS_MASK] and r[C.LOSS_MASK][-1] == 1
    for r in rows:
        assert len(r[C.RESPONSE_IDS]) == len(r[C.ROLLOUT_LOGP]) == len(r[C.LOSS_MASK]) == r[C.RESPONSE_LEN]
        assert r[C.HARNESS_REWARD] in (1.0, -1.0)
        right = r[C.RESPONSE_TEXT].rpartition("</result>")[2].strip() == r[C.GROUND_TRUTH]
        assert (r[C.HARNESS_REWARD] == 1.0) == right


@pytest.mark.parametrize("harness, reason", [
    ("raises", "harness_error"), ("sleeps", "timeout"), ("never_calls", "no_model_call"),
    ("rewrites", "rewritten"), ("loops", "request_cap"), ("nonsense", "harness_error"), ("fine", ""),
])
def test_a_misbehaving_harness_gives_masked_samples(model, tmp_path, harness, reason):
    (tmp_path / "bad.py").write_text(BAD_HARNESSES)
    op = _op(model, tmp_path, f"h-{harness}", harness=f"bad.py:{harness}", n=2, max_requests=3,
             timeout_s=1.0 if harness == "sleeps" else 60.0)
    try:
        out = op(_prompts(model, 1))
    finally:
        op.close()
    metrics = op.last_metrics()
    assert out.num_rows == 2
    masks = out.column(C.LOSS_MASK).to_pylist()
    if reason:
        assert metrics[f"harness/masked_{reason}"] == 1.0 and metrics["harness/masked_frac"] == 1.0
        assert all(sum(m) == 0 for m in masks)  # nothing trained
        assert all(f"[masked: {reason}]" in c for c in out.column(C.CONVERSATION).to_pylist())
    else:
        assert metrics["harness/masked_frac"] == 0.0 and all(sum(m) > 0 for m in masks)
        assert np.allclose(out.column(C.HARNESS_REWARD).to_numpy(), 0.5)
