"""The endpoint as a server thread in the process that holds the rollout engine.

``Endpoint(engine, ...).start()`` binds 127.0.0.1 (a free port unless one is given), makes a
per-run bearer token, and serves from a uvicorn thread; the engine is called from the batcher's
thread only. Another host is an explicit setting and warns: whoever reaches it with the token
samples from the model. :meth:`Endpoint.close` stops both threads.
"""

from __future__ import annotations

import asyncio
import ipaddress
import secrets
import socket
import threading
import time
import warnings
from typing import Any

from dapo_flow.endpoint.app import Served, build_app
from dapo_flow.endpoint.batcher import Batcher
from dapo_flow.endpoint.episodes import EpisodeBook
from dapo_flow.errors import DapoFlowError

LOOPBACK = "127.0.0.1"
START_TIMEOUT_S = 30.0


class EndpointError(DapoFlowError):
    """The endpoint could not start (the port taken, the host not this machine's)."""


def context_length(engine: Any) -> int:
    """The longest sequence the engine's model takes (its config's max_position_embeddings)."""
    for value in (getattr(engine, "max_model_len", None),
                  getattr(getattr(getattr(engine, "model", None), "config", None), "max_position_embeddings", None)):
        if isinstance(value, int) and value > 0:
            return value
    limit = getattr(engine.tokenizer, "model_max_length", None)
    return int(limit) if isinstance(limit, int) and 0 < limit < 10**7 else 4096


def eos_ids(engine: Any) -> set[int]:
    ids = getattr(engine, "eos_ids", None) or [engine.tokenizer.eos_token_id]
    return {int(i) for i in ids if i is not None}


class Endpoint:
    """An OpenAI-compatible server over ``engine`` (a RolloutEngine); ``model_name`` is the id
    clients send as ``model``. ``require_episode``: refuse requests outside a registered episode
    (a training run: the engine is used only while the harness node runs); ``sampling``: the
    (temperature, top_p, top_k) every request samples with, whatever it asks (a training run's);
    ``spare_threads``: torch threads the engine leaves to clients running in this process; with
    ``require_episode`` and ``all_threads_when_waited``, not in a call every open episode waits on
    (no client runs then)."""

    def __init__(self, engine: Any, *, model_name: str, call_format: str = "hermes", host: str = LOOPBACK,
                 port: int = 0, token: str | None = None, require_episode: bool = False,
                 sampling: tuple[float, float, int] | None = None, window_s: float = 0.005,
                 spare_threads: int = 0, all_threads_when_waited: bool = True):
        warn_unless_loopback(host, port)
        self.host, self.port = host, port
        self.token = token or secrets.token_urlsafe(24)
        self.book = EpisodeBook()
        waited = self.book.all_waiting if require_episode and all_threads_when_waited else None
        self.batcher = Batcher(engine, window_s=window_s, expected=self.book.expected if require_episode else None,
                               spare_threads=spare_threads, all_waiting=waited)
        self.served = Served(engine.tokenizer, self.batcher, self.book, model_name, self.token, call_format,
                             context_length(engine), eos_ids(engine), require_episode, sampling)
        self._thread: ServerThread | None = None

    @property
    def base_url(self) -> str:
        """What an ``openai`` client's ``base_url`` is: ``http://HOST:PORT/v1``."""
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> "Endpoint":
        self._thread = ServerThread(build_app(self.served), self.host, self.port, "endpoint-server")
        self.port = self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self._thread.close()
            self._thread = None
        self.batcher.close()

    def __enter__(self) -> "Endpoint":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()


class ServerThread:
    """A uvicorn server for ``app`` on a thread of its own: the socket bound first (a taken port is
    an :class:`EndpointError` now, not a thread dying later), ``start`` returning once it serves."""

    def __init__(self, app: Any, host: str, port: int, name: str, lifespan: str = "off"):
        self.app, self.host, self.port, self.name, self.lifespan = app, host, port, name, lifespan
        self._server: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> int:
        """Serve; the bound port (a free one when ``port`` is 0)."""
        import uvicorn

        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # each response leaves at once: uvicorn writes headers and body apart, and Nagle holding the
        # body for the client's delayed ACK costs ~40 ms a request (inherited by accepted sockets)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            raise EndpointError(f"cannot bind {self.host}:{self.port}: {exc.strerror}\n"
                                "    fix: pick another port (0: a free one) or a host of this machine") from None
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan=self.lifespan,
                                timeout_keep_alive=30)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=lambda: asyncio.run(self._server.serve(sockets=[sock])),
                                        name=self.name, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise EndpointError(f"the server on {self.host}:{self.port} did not start")
            time.sleep(0.01)
        return self.port

    def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            if self._thread is not None:
                self._thread.join(timeout=10)
            self._server = None


def warn_unless_loopback(host: str, port: int) -> None:
    if not _is_loopback(host):
        warnings.warn(f"the endpoint binds {host}, not loopback: anyone who reaches {host}:{port or '<port>'} "
                      "with the token samples from the model", stacklevel=3)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
