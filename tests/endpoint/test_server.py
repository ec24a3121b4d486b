"""The endpoint over loopback with a real ``openai`` client, on builtin:tiny-agent: the routes,
n > 1, logprobs, stop strings, tool calls parsed back, each bad request's error, batching of
concurrent requests into few engine calls, and token-exact episodes (the recorded ids are the
engine's, and their logprobs are the policy's teacher-forced ones)."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import numpy as np
import openai
import pytest

from dapo_flow.endpoint.server import Endpoint
from dapo_flow.models.hf import HFPolicy
from dapo_flow.tools.calculator import SCHEMA

pytestmark = pytest.mark.models("tiny-agent")


class CountingEngine:
    """The real engine, its generate calls counted and their rollouts kept."""

    def __init__(self, engine: HFPolicy):
        self.engine, self.calls = engine, []
        self.tokenizer, self.eos_ids, self.model = engine.tokenizer, engine.eos_ids, engine.model

    @property
    def weights_version(self) -> int:
        return self.engine.weights_version

    def generate(self, prompt_ids, cfg):
        out = self.engine.generate(prompt_ids, cfg)
        self.calls.append((prompt_ids, out))
        return out


@pytest.fixture(scope="module")
def policy() -> HFPolicy:
    from dapo_flow.models import resolve_model

    return HFPolicy(resolve_model("builtin:tiny-agent", progress=False))


@pytest.fixture(scope="module")
def served(policy):
    engine = CountingEngine(policy)
    with Endpoint(engine, model_name="policy", call_format="compact") as endpoint:
        yield endpoint, engine


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    endpoint, _ = served
    return openai.OpenAI(base_url=endpoint.base_url, api_key=endpoint.token, max_retries=0)


def test_models_health_completions_and_chat(served, client):
    endpoint, _ = served
    assert [m.id for m in client.models.list().data] == ["policy"]
    health = httpx.get(endpoint.base_url.removesuffix("/v1") + "/health")  # no token needed
    assert health.status_code == 200 and health.json()["status"] == "ok"

    done = client.completions.create(model="policy", prompt="12*34=", n=3, max_tokens=40, logprobs=1, seed=1)
    assert len(done.choices) == 3
    for c in done.choices:
        assert "".join(c.logprobs.tokens).replace("</s>", "") == c.text  # the tokens are the text (and EOS)
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs) and c.finish_reason == "stop"
    assert done.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in done.choices)

    chat = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "12*34="}],
                                          tools=[SCHEMA], n=32, max_tokens=40, logprobs=True, seed=3)
    calls = [c for c in chat.choices if c.message.tool_calls]
    assert calls, "the warm start calls the calculator in about a fifth of its samples"
    for c in calls:  # <call>calculator: 12*34</call> comes back as an OpenAI tool call
        (call,) = c.message.tool_calls
        assert c.finish_reason == "tool_calls" and call.function.name == "calculator"
        # the arguments are what the sampled text put between "calculator:" and "</call>" (whatever this
        # CPU's build of the model copied: a sample may garble the copy)
        sampled = "".join(t.token for t in c.logprobs.content)
        written = re.search(r"<call>calculator:\s*(.*?)</call>", sampled)
        assert written and json.loads(call.function.arguments) == {"expression": written.group(1).strip()}, sampled
    for c in chat.choices:
        assert c.logprobs.content and all(t.logprob <= 0 for t in c.logprobs.content)


def test_stop_strings_cut_the_text_and_the_tokens(client):
    done = client.completions.create(model="policy", prompt="12*34=", n=32, max_tokens=40, stop=[":"],
                                     logprobs=1, seed=5)
    cut = [c for c in done.choices if c.text.startswith("<call>")]
    assert cut, "some samples call the calculator"
    for c in cut:
        assert c.text == "<call>calculator" and c.finish_reason == "stop"
        assert "".join(c.logprobs.tokens) == c.text  # the tokens kept are exactly the text returned


def _post(endpoint, path: str, body, token: str | None = "ok") -> httpx.Response:
    headers = {"Authorization": f"Bearer {endpoint.token if token == 'ok' else token}"} if token else {}
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(endpoint.base_url + path, content=content, headers={**headers, "Content-Type": "application/json"})


def test_bad_requests_get_clear_errors_in_openais_shape(served):
    endpoint, engine = served
    before = len(engine.calls)
    chat = {"model": "policy", "messages": [{"role": "user", "content": "12*34="}]}
    bad_tool = {"type": "function", "function": {"name": "calc", "parameters": {"type": "string"}}}
    cases = [
        ("/chat/completions", "{not json", "ok", 400, "not valid JSON"),
        ("/chat/completions", {**chat, "temprature": 0.5}, "ok", 422, "temprature"),
        ("/chat/completions", {**chat, "n": "many"}, "ok", 422, "n:"),
        ("/completions", {"model": "policy", "prompt": "1" * 200}, "ok", 413, "context is 128"),
        ("/chat/completions", {**chat, "tools": [bad_tool]}, "ok", 400, "tools[0]: function.parameters"),
        ("/chat/completions", {**chat, "tool_choice": "required"}, "ok", 400, "tool_choice"),
        ("/chat/completions", chat, None, 401, "bearer token"),
        ("/chat/completions", chat, "wrong", 401, "bearer token"),
        ("/chat/completions", {**chat, "model": "gpt-4"}, "ok", 404, "serves 'policy'"),
        ("/embeddings", chat, "ok", 404, "no route"),
        ("/completions", {"model": "policy", "prompt": "1" * (9 << 20)}, "ok", 413, "byte limit"),
    ]
    for path, body, token, status, words in cases:
        response = _post(endpoint, path, body, token)
        error = response.json()["error"]
        assert (response.status_code, words in error["message"]) == (status, True), (path, body, error)
        assert set(error) == {"message", "type", "param", "code"}
    assert len(engine.calls) == before  # none reached the engine
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=endpoint.base_url, api_key="nope", max_retries=0).models.list()


def test_64_concurrent_requests_cost_a_few_engine_calls(served):
    endpoint, engine = served
    before = len(engine.calls)

    async def many() -> list:
        client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.token, max_retries=0)
        return await asyncio.gather(*(client.completions.create(model="policy", prompt=f"{10 + i}*11=",
                                                                max_tokens=8, seed=i) for i in range(64)))

    answers = asyncio.run(many())
    # one choice each, at least the EOS sampled (a sample may stop at once: an empty text)
    assert len(answers) == 64 and all(len(a.choices) == 1 and a.usage.completion_tokens >= 1 for a in answers)
    calls = engine.calls[before:]
    assert sum(len(prompts) for prompts, _ in calls) == 64
    assert len(calls) <= 8, [len(prompts) for prompts, _ in calls]  # batched, not one call a request


def test_a_two_request_episode_is_the_exact_tokens_sampled(served, client, policy):
    endpoint, engine = served
    tok = policy.tokenizer
    endpoint.book.register("ep-1", seed=11, max_requests=4, budget=100)
    headers = {"X-Episode-Id": "ep-1"}
    first = client.completions.create(model="policy", prompt="12*34=", max_tokens=40, extra_headers=headers)
    prompt1, rolled1 = engine.calls[-1]
    inserted = "<result>408</result>"
    second = client.completions.create(model="policy", prompt="12*34=" + first.choices[0].text + inserted,
                                       max_tokens=40, extra_headers=headers)
    prompt2, rolled2 = engine.calls[-1]
    record = endpoint.book.finish("ep-1")

    sampled1, sampled2 = rolled1.response_ids[0], rolled2.response_ids[0]
    assert sampled1[-1] == tok.eos_token_id  # the sampled EOS, which the text left out, is in the sequence
    between = tok.encode(inserted, add_special_tokens=False)
    assert prompt1 == [tok.encode("12*34=")] and record.prompt_ids == prompt1[0]
    assert prompt2 == [prompt1[0] + sampled1 + between]  # what the engine was fed the second time
    assert record.response_ids == sampled1 + between + sampled2
    assert record.loss_mask == [1] * len(sampled1) + [0] * len(between) + [1] * len(sampled2)
    assert record.masked == "" and record.completions == 2
    assert second.choices[0].text == tok.decode(sampled2, skip_special_tokens=True)

    # the recorded logprobs are the policy's teacher-forced ones over the whole sequence
    logp, _, mask = policy.response_logprobs([record.prompt_ids], [record.response_ids])
    recomputed = logp[0][mask[0]].numpy()
    model_tokens = np.asarray(record.loss_mask, dtype=bool)
    np.testing.assert_allclose(np.asarray(record.logprobs, np.float32)[model_tokens], recomputed[model_tokens],
                               atol=1e-5, rtol=0)
    np.testing.assert_allclose(record.logprobs[: len(sampled1)], rolled1.logprobs[0], atol=0, rtol=0)


def test_a_chat_episode_continues_the_tool_call_it_got_back(served, client, policy):
    """n=32 choices, the harness goes on with one that called the calculator: the episode is that
    choice's sampled tokens, the tool message rendered as the model's format (<result>..., masked)."""
    endpoint, engine = served
    endpoint.book.register("ep-chat", seed=5, max_requests=4, budget=100)
    headers = {"X-Episode-Id": "ep-chat"}
    messages = [{"role": "user", "content": "12*34="}]
    first = client.chat.completions.create(model="policy", messages=messages, tools=[SCHEMA], n=32, max_tokens=40,
                                           extra_headers=headers)
    _, rolled1 = engine.calls[-1]
    k, choice = next((i, c) for i, c in enumerate(first.choices) if c.message.tool_calls)
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": choice.message.tool_calls[0].id, "content": "408"}]
    client.chat.completions.create(model="policy", messages=messages, tools=[SCHEMA], max_tokens=40,
                                   extra_headers=headers)
    _, rolled2 = engine.calls[-1]
    record = endpoint.book.finish("ep-chat")
    between = policy.tokenizer.encode("<result>408</result>", add_special_tokens=False)
    assert record.masked == ""
    assert record.response_ids == rolled1.response_ids[k] + between + rolled2.response_ids[0]
    assert record.loss_mask == [1] * len(rolled1.response_ids[k]) + [0] * len(between) + [1] * len(rolled2.response_ids[0])


def test_another_host_than_loopback_warns(served):
    _, engine = served
    with pytest.warns(UserWarning, match="binds 0.0.0.0, not loopback"):
        endpoint = Endpoint(engine, model_name="policy", host="0.0.0.0")  # not started: nothing listens
    endpoint.close()
    default = Endpoint(engine, model_name="policy")
    default.close()
    assert default.host == "127.0.0.1"


def test_a_training_endpoint_takes_every_thread_for_waited_calls_unless_fixed(served):
    """harness-generate's `engine_threads`: adaptive (the default) gives the batcher the episode
    book's all_waiting; fixed keeps the spare thread on every call (bit-reproducible logprobs)."""
    from dapo_flow.operators.harness_generate import Params

    _, engine = served
    assert Params().engine_threads == "adaptive"
    for fixed, rule in ((False, True), (True, False)):
        endpoint = Endpoint(engine, model_name="policy", require_episode=True, spare_threads=1,
                            all_threads_when_waited=not fixed)  # not started: nothing listens
        endpoint.close()
        assert (endpoint.batcher.all_waiting is not None) is rule
