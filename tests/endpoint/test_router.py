"""Replicas behind one address: two real endpoints on builtin:tiny-agent behind a router, called
over loopback with a real ``openai`` client. Episodes stick to one replica, requests outside
one spread over both, the router's own token guards it, and a replica that is gone is routed
around (its episodes answered 502, the rest served by the other)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from dapo_flow.endpoint import router as router_module
from dapo_flow.endpoint.router import REPLICA_HEADER, Backend, Router, Routes
from dapo_flow.endpoint.server import Endpoint
from dapo_flow.models.hf import HFPolicy

pytestmark = pytest.mark.models("tiny-agent")


def test_routes_keep_episodes_and_spread_the_rest():
    routes = Routes(3)
    assert [routes.pick(None) for _ in range(4)] == [0, 1, 2, 0]  # idle replicas in turn
    routes.in_flight[:] = [2, 0, 1]
    assert routes.pick("ep-a") == 1  # the least busy
    routes.in_flight[:] = [0, 5, 0]
    assert routes.pick("ep-a") == 1  # an episode stays where it began, however busy
    routes.lost(2)
    assert routes.pick(None, tried={0}) == 1  # 0 already failed this request, 2 is down: 1, busy as it is


def test_routes_leave_out_lost_replicas_and_old_episodes(monkeypatch):
    routes = Routes(2)
    routes.lost(0)
    assert routes.pick(None) == 1 and routes.pick(None, tried={1}) is None
    monkeypatch.setattr(router_module, "MAX_EPISODES", 2)
    for episode in ("a", "b", "c"):
        routes.pick(episode)
    assert list(routes.episodes) == ["b", "c"]  # the oldest dropped
    routes.forget("b")
    assert list(routes.episodes) == ["c"]


@pytest.fixture(scope="module")
def replicas():
    from dapo_flow.models import resolve_model

    path = resolve_model("builtin:tiny-agent", progress=False)
    endpoints = [Endpoint(HFPolicy(path), model_name="policy", call_format="compact").start() for _ in range(2)]
    yield endpoints
    for endpoint in endpoints:
        endpoint.close()


@pytest.fixture()
def routed(replicas):
    with Router([Backend(e.base_url, e.token) for e in replicas], model_name="policy") as router:
        yield router


def _replica(router: Router, **extra) -> int:
    client = openai.OpenAI(base_url=router.base_url, api_key=router.token, max_retries=0)
    raw = client.completions.with_raw_response.create(model="policy", prompt="12*34=", max_tokens=6, **extra)
    assert raw.parse().choices[0].text is not None
    return int(raw.headers[REPLICA_HEADER])


def test_one_address_serves_both_replicas(routed):
    client = openai.OpenAI(base_url=routed.base_url, api_key=routed.token, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["policy"]
    chat = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "12*34="}],
                                          max_tokens=8, logprobs=True)
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].logprobs.content

    first, second = _replica(routed, user="ep-1"), _replica(routed, user="ep-2")
    assert {first, second} == {0, 1}  # two new episodes: one on each
    assert [_replica(routed, user="ep-1") for _ in range(3)] == [first] * 3
    assert _replica(routed, extra_headers={"X-Episode-Id": "ep-2"}) == second  # the header names it too

    async def burst() -> set[int]:
        async with openai.AsyncOpenAI(base_url=routed.base_url, api_key=routed.token, max_retries=0) as aclient:
            replies = await asyncio.gather(*(aclient.completions.with_raw_response.create(
                model="policy", prompt=f"{i}+{i}=", max_tokens=6) for i in range(8)))
        return {int(r.headers[REPLICA_HEADER]) for r in replies}

    assert asyncio.run(burst()) == {0, 1}  # concurrent requests outside episodes use both


def test_the_router_has_its_own_token_and_openai_errors(routed):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=routed.base_url, api_key="guess", max_retries=0).models.list()
    client = openai.OpenAI(base_url=routed.base_url, api_key=routed.token, max_retries=0)
    with pytest.raises(openai.NotFoundError, match="not served here"):  # the replica's own answer, passed on
        client.completions.create(model="other", prompt="1+1=", max_tokens=2)
    reply = httpx.post(routed.base_url + "/completions", content=b"{not json",
                       headers={"authorization": f"Bearer {routed.token}"})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_json"


def test_a_replica_gone_is_routed_around():
    from dapo_flow.models import resolve_model

    path = resolve_model("builtin:tiny-agent", progress=False)
    live, gone = (Endpoint(HFPolicy(path), model_name="policy", call_format="compact").start() for _ in range(2))
    router = Router([Backend(gone.base_url, gone.token), Backend(live.base_url, live.token)], model_name="policy")
    try:
        router.start()
        pinned = _replica(router, user="ep-on-0")
        assert pinned == 0
        gone.close()  # its server stops: connections to it are refused
        client = openai.OpenAI(base_url=router.base_url, api_key=router.token, max_retries=0)
        with pytest.raises(openai.APIStatusError, match="start the episode again") as err:
            client.completions.create(model="policy", prompt="1+1=", max_tokens=2, user="ep-on-0")
        assert err.value.status_code == 502
        assert [_replica(router) for _ in range(3)] == [1, 1, 1]  # the rest go to the live one
        health = httpx.get(router.base_url.removesuffix("/v1") + "/health").json()
        assert health["status"] == "ok" and health["replicas_up"] == 1
        assert health["replicas"][0]["status"] == "unreachable"
        live.close()
        with pytest.raises(openai.APIStatusError, match="no replica can be reached") as err:
            client.completions.create(model="policy", prompt="1+1=", max_tokens=2)
        assert err.value.status_code == 503
    finally:
        router.close()
        live.close()
        gone.close()


def test_non_loopback_router_warns():
    with pytest.warns(UserWarning, match="not loopback"):
        Router([Backend("http://127.0.0.1:1/v1", "t")], model_name="policy", host="0.0.0.0")
