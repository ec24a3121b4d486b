"""Several endpoints (rollout replicas) behind one address.

A harness is given one ``base_url``; the router forwards each request to a replica's endpoint
as it came (the body untouched, the bearer token swapped for the replica's) and answers with the
replica's reply, its number in the ``X-Dapo-Flow-Replica`` header. An episode's requests all go to
the replica that served its first one (the id from the ``X-Episode-Id`` header or the ``user``
field), since that replica's book holds the episode's exact tokens; requests outside an episode
go to the replica with the fewest requests in flight. A replica that cannot be reached is left
out for ``RETRY_S`` seconds: a request outside an episode is retried on another one, an
episode's is answered 502 (its tokens are on the replica that is gone). Multi-turn chats outside
an episode may land on another replica, which then re-tokenizes the assistant turns it did not
sample: name an episode where exact tokens matter (a training run always does).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections import OrderedDict
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response

from dapo_flow.endpoint.app import EPISODE_HEADER, answer_errors_as_openai
from dapo_flow.endpoint.protocol import ApiError, authorize
from dapo_flow.endpoint.server import LOOPBACK, ServerThread, warn_unless_loopback

REPLICA_HEADER = "x-dapo-flow-replica"
RETRY_S = 10.0  # an unreachable replica is tried again after this long
MAX_EPISODES = 65536  # episode -> replica entries kept (the oldest dropped: episodes end)
FORWARD_TIMEOUT_S = 600.0  # a replica's answer may wait behind a long batch


@dataclass(frozen=True)
class Backend:
    """One replica's endpoint: its ``base_url`` (``http://HOST:PORT/v1``) and bearer token."""

    base_url: str
    token: str


class Routes:
    """Which replica serves a request: episodes stick to theirs, others go to the least busy."""

    def __init__(self, replicas: int):
        self.in_flight = [0] * replicas
        self.down_until = [0.0] * replicas
        self.episodes: OrderedDict[str, int] = OrderedDict()
        self._next = 0  # ties between equally busy replicas go round the ring

    def pick(self, episode: str | None, tried: set[int] = frozenset()) -> int | None:
        """The replica for this request, or None when none is left to try."""
        if episode is not None and episode in self.episodes:
            self.episodes.move_to_end(episode)
            return self.episodes[episode]
        now = time.monotonic()
        up = [i for i in range(len(self.in_flight)) if i not in tried and self.down_until[i] <= now]
        if not up:
            return None
        n = len(self.in_flight)
        chosen = min(up, key=lambda i: (self.in_flight[i], (i - self._next) % n))
        self._next = (chosen + 1) % n
        if episode is not None:
            self.episodes[episode] = chosen
            while len(self.episodes) > MAX_EPISODES:
                self.episodes.popitem(last=False)
        return chosen

    def lost(self, replica: int) -> None:
        self.down_until[replica] = time.monotonic() + RETRY_S

    def forget(self, episode: str | None) -> None:
        if episode is not None:
            self.episodes.pop(episode, None)


class Router:
    """One address in front of ``backends`` (same model, same call format). ``start()`` serves on
    ``host:port`` (loopback, a free port by default) with its own bearer token; ``close()`` stops it."""

    def __init__(self, backends: list[Backend], *, model_name: str, host: str = LOOPBACK, port: int = 0,
                 token: str | None = None):
        if not backends:
            raise ValueError("a router needs at least one backend")
        warn_unless_loopback(host, port)
        self.backends, self.model_name = list(backends), model_name
        self.host, self.port = host, port
        self.token = token or secrets.token_urlsafe(24)
        self.routes = Routes(len(self.backends))
        self._thread: ServerThread | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> "Router":
        self._thread = ServerThread(build_router_app(self), self.host, self.port, "endpoint-router", lifespan="on")
        self.port = self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self._thread.close()
            self._thread = None

    def __enter__(self) -> "Router":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()


def build_router_app(router: Router) -> FastAPI:
    clients: list[httpx.AsyncClient] = []

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        # one pooled client per replica, made in the server's own event loop
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        clients.extend(httpx.AsyncClient(base_url=b.base_url.rstrip("/"), timeout=FORWARD_TIMEOUT_S, limits=limits,
                                         trust_env=False, headers={"authorization": f"Bearer {b.token}"})
                       for b in router.backends)
        yield
        await asyncio.gather(*(c.aclose() for c in clients))

    app = FastAPI(title="dapo-flow endpoint router", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    answer_errors_as_openai(app)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        replicas = await asyncio.gather(*(_replica_health(router, clients, i) for i in range(len(clients))))
        up = sum(r.get("status") == "ok" for r in replicas)
        return {"status": "ok" if up else "down", "model": router.model_name, "replicas_up": up,
                "replicas": replicas}

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        authorize(request.headers.get("authorization", ""), router.token)
        return await _forward(router, clients, request, None, b"", "GET")

    @app.post("/v1/chat/completions")
    @app.post("/v1/completions")
    async def sample(request: Request) -> Response:
        authorize(request.headers.get("authorization", ""), router.token)
        raw = await request.body()
        return await _forward(router, clients, request, _episode_of(request, raw), raw, "POST")

    return app


async def _replica_health(router: Router, clients: list[httpx.AsyncClient], i: int) -> dict[str, Any]:
    try:
        root = router.backends[i].base_url.rstrip("/").removesuffix("/v1")
        reply = await clients[i].get(root + "/health", timeout=5.0)
        return {"replica": i, **reply.json()}
    except (httpx.HTTPError, ValueError) as exc:
        return {"replica": i, "status": "unreachable", "error": type(exc).__name__}


async def _forward(router: Router, clients: list[httpx.AsyncClient], request: Request, episode: str | None,
                   raw: bytes, method: str) -> Response:
    """The request answered by a replica: its episode's, else the least busy one that answers."""
    path = request.url.path.removeprefix("/v1")
    headers = {k: v for k, v in request.headers.items() if k in ("content-type", EPISODE_HEADER)}
    tried: set[int] = set()
    while (replica := router.routes.pick(episode, tried)) is not None:
        router.routes.in_flight[replica] += 1
        try:
            reply = await clients[replica].request(method, path, content=raw, headers=headers)
        except httpx.TransportError as exc:
            router.routes.lost(replica)
            if episode is not None:
                router.routes.forget(episode)
                raise ApiError(502, f"replica {replica} ({router.backends[replica].base_url}), which holds episode "
                                    f"{episode!r}, cannot be reached ({type(exc).__name__}); the episode's tokens "
                                    "are there: start the episode again", code="replica_unreachable") from None
            tried.add(replica)
            continue
        finally:
            router.routes.in_flight[replica] -= 1
        return Response(reply.content, status_code=reply.status_code,
                        media_type=reply.headers.get("content-type", "application/json"),
                        headers={REPLICA_HEADER: str(replica)})
    raise ApiError(503, f"no replica can be reached ({len(router.backends)} behind this address); "
                        f"each is tried again {RETRY_S:.0f} s after it failed", code="no_replica")


def _episode_of(request: Request, raw: bytes) -> str | None:
    """The request's episode id: its header, else the body's ``user`` field (a body that does not
    parse has none: the replica answers its 400)."""
    episode = request.headers.get(EPISODE_HEADER)
    if episode:
        return episode
    try:
        user = json.loads(raw).get("user")
    except (ValueError, AttributeError):
        return None
    return user if isinstance(user, str) and user else None
