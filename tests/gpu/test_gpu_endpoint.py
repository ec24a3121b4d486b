"""The endpoint on CUDA: a two-request episode through a real ``openai`` client is the exact
tokens the engine sampled on the device, and their logprobs are the policy's teacher-forced ones
(the CPU twin: tests/endpoint/test_server.py)."""

from __future__ import annotations

import numpy as np
import openai
import pytest

from dapo_flow.endpoint.server import Endpoint
from dapo_flow.models.hf import HFPolicy

pytestmark = pytest.mark.gpu


def test_a_two_request_episode_on_the_device(device, builtin):
    policy = HFPolicy(builtin("tiny-agent"), device=str(device), seed=0)
    tok = policy.tokenizer
    with Endpoint(policy, model_name="policy", call_format="compact") as endpoint:
        client = openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.token, max_retries=0)
        endpoint.book.register("ep", seed=3, max_requests=4, budget=100)
        headers = {"X-Episode-Id": "ep"}
        first = client.completions.create(model="policy", prompt="12*34=", max_tokens=40, extra_headers=headers)
        client.completions.create(model="policy", prompt="12*34=" + first.choices[0].text + "<result>408</result>",
                                  max_tokens=40, extra_headers=headers)
        record = endpoint.book.finish("ep")
    between = tok.encode("<result>408</result>", add_special_tokens=False)
    assert record.masked == "" and record.completions == 2
    assert record.loss_mask.count(0) == len(between)
    logp, _, mask = policy.response_logprobs([record.prompt_ids], [record.response_ids])
    model_tokens = np.asarray(record.loss_mask, dtype=bool)
    np.testing.assert_allclose(np.asarray(record.logprobs, np.float32)[model_tokens],
                               logp[0][mask[0]].cpu().numpy()[model_tokens], atol=1e-4, rtol=0)
