"""An OpenEnv environment as a tool of ``agent-generate`` (built-in ``impl: openenv``): the model's
calls are the environment's actions, its observations the tool's responses, its rewards the
tool's reward, its ``done`` the end of the sample.

OpenEnv (``pip install 'dapo-flow[openenv]'``, openenv-core 0.3) serves an environment as a
FastAPI app. Its HTTP ``POST /reset`` and ``/step`` build a fresh environment per request, so a
multi-turn episode runs over the app's ``/ws`` session instead (one environment instance per
connection), through openenv's own ``GenericEnvClient``. Per sample (``instance_id``):

- ``create``: open a session and ``reset`` it with ``seed`` (drawn from the sample's id, so a
  rerun replays it), ``episode_id`` (the instance id) and the row's ``ground_truth``,
  ``data_source`` and ``prompt_id`` (the server passes on those its ``reset`` takes);
- each call ``<call>NAME: ARG</call>`` (or hermes ``{"ARG_FIELD": ...}``) is one ``step`` with
  the action ``{action_field: ARG}``; the model sees the observation (its ``observation_field``,
  else the observation as JSON); the step's reward is the call's reward (summed into
  ``tool_reward_<name>``; ``score``'s ``builtin:tool-reward`` makes it the sample's score);
  ``done`` ends the sample (that last observation is not shown);
- ``release``: close the session.

The reset observation is not shown: the prompt comes from the graph's data, as for any tool.

Failures: an unreachable server, or one that refuses a session (its ``max_concurrent_envs``)
through ``connect_timeout_s`` of retries, stops the step with a RunError naming the URL. An
action the environment rejects or a step that raises there is an error observation (the
session goes on); a step past ``timeout_s`` is an error that ends the sample (the session is
closed: its next answer could be the late one). A
session lost mid-episode (the server died) ends the sample, and when the rollout ends the step
stops with a RunError naming the URL: a dead server's samples are not trained on as if they
were wrong answers.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, field_validator, model_validator

from dapo_flow.core.contract import PARAMS_CONFIG
from dapo_flow.tools.base import NAME_PATTERN, ToolError, ToolResult, error_result

INSTALL = "pip install 'dapo-flow[openenv]'"
ROW_FIELDS = ("ground_truth", "data_source", "prompt_id")  # what reset receives of the prompt's row


class Config(BaseModel):
    model_config = PARAMS_CONFIG

    name: str = Field(pattern=NAME_PATTERN)
    """The name the model calls the environment by (the tool entry's `name`, filled in)."""
    timeout_s: float = Field(5.0, gt=0, le=600)
    """One reset or step (the tool entry's `timeout_s`, filled in)."""
    url: str | None = None
    """An OpenEnv server already running, e.g. `http://127.0.0.1:8000`."""
    app: str | None = None
    """Or its app, `pkg.module:app` or `path/to/server.py:app` (openenv's `create_app(...)`):
    served on a loopback port of its own for the run (one server per agent worker)."""
    action_field: str = Field("message", min_length=1)
    """The action's field the call's argument fills (`message` for openenv's echo and
    text-arena environments)."""
    observation_field: str | None = None
    """The observation's field the model sees; unset: the whole observation as JSON."""
    description: str = "Act in the environment: the argument is your action."
    """The tool's description in its schema (what a hermes chat template shows the model)."""
    connect_timeout_s: float = Field(10.0, gt=0, le=600)
    """Opening a session."""
    start_timeout_s: float = Field(120.0, gt=0, le=3600)
    """With `app`: how long its server may take to answer `GET /health`."""

    @model_validator(mode="after")
    def _one_server(self) -> "Config":
        if (self.url is None) == (self.app is None):
            raise ValueError("name the environment server: url: http://HOST:PORT (one running) or app: "
                             "pkg.module:app (dapo-flow serves it on loopback); exactly one of them")
        if self.url is not None and not self.url.startswith(("http://", "https://", "ws://", "wss://")):
            raise ValueError(f"url: {self.url!r} is not an http:// or ws:// URL (e.g. http://127.0.0.1:8000)")
        return self

    @field_validator("app")
    @classmethod
    def _app_found(cls, ref: str | None) -> str | None:
        """Cheap checks only (importing an OpenEnv app takes seconds): the form, the file, the
        module. A file's path is made absolute here, in the driver: the workers that serve the
        app may run elsewhere (as a reward file resolves against the driver's directory)."""
        if ref is None:
            return None
        target, sep, name = ref.rpartition(":")
        if not sep or not target or not name:
            raise ValueError(f"{ref!r} is not a reference: write pkg.module:app or path/to/server.py:app")
        if target.endswith(".py"):
            if not Path(target).is_file():
                raise ValueError(f"file {target} does not exist (resolved: {Path(target).resolve()})")
            return f"{Path(target).resolve()}:{name}"
        if importlib.util.find_spec(target.split(".")[0]) is None:
            raise ValueError(f"no module named {target.split('.')[0]!r}")
        return ref


@dataclass
class _Episode:
    client: Any  # openenv GenericEnvClient, one /ws session
    lock: threading.Lock
    ended: str = ""  # why no more steps go to the server
    lost: str = ""  # the session died with the server: the rollout must stop


class OpenEnvTool:
    """A Tool over one OpenEnv server (see the module docstring)."""

    Config = Config

    def __init__(self, config: Config):
        if importlib.util.find_spec("openenv") is None:
            raise ToolError(f"an OpenEnv environment needs openenv-core: {INSTALL}")
        self.config, self.name = config, config.name
        self.schema = {"type": "function", "function": {
            "name": config.name, "description": config.description,
            "parameters": {"type": "object", "required": [config.action_field], "properties": {
                config.action_field: {"type": "string", "description": "the action"}}}}}
        self._episodes: dict[str, _Episode] = {}
        self._start_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None  # the sessions' WebSockets live on it
        self._server = None
        self.url, self._reached = config.url, False

    # -- the Tool protocol ------------------------------------------------------------------------

    def create(self, instance_id: str, **row: Any) -> None:
        url = self._started()
        from openenv.core.generic_client import GenericEnvClient  # seconds: openenv-core imports gradio

        seed = int.from_bytes(hashlib.blake2b(instance_id.encode(), digest_size=4).digest(), "little") >> 1
        kwargs = {"seed": seed, "episode_id": instance_id, **{k: row[k] for k in ROW_FIELDS if k in row}}
        deadline, delay = time.monotonic() + self.config.connect_timeout_s, 0.05
        while True:  # retried: the sessions a last batch released may still count on the server a moment
            client = GenericEnvClient(base_url=url, connect_timeout_s=self.config.connect_timeout_s,
                                      message_timeout_s=self.config.timeout_s)
            try:
                self._run(client.connect(), self.config.connect_timeout_s)
                self._run(client.reset(**kwargs), self.config.timeout_s)
                break
            except Exception as exc:  # noqa: BLE001 - no episode at all: retried, then the run cannot go on
                self._close(client)
                if time.monotonic() + delay > deadline:
                    raise ToolError(self._no_session(url, exc)) from None
            time.sleep(delay)
            delay = min(2 * delay, 1.0)
        self._episodes[instance_id] = _Episode(client, threading.Lock())

    def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        ep = self._episodes[instance_id]
        with ep.lock:  # one step at a time per session (a turn may hold several calls)
            if ep.ended:
                return error_result(f"the episode is over ({ep.ended})", done=True)
            try:
                result = self._run(ep.client.step({self.config.action_field: arguments[self.config.action_field]}),
                                   self.config.timeout_s)
            except RuntimeError as exc:
                if str(exc).startswith("Server error"):  # the environment rejected the action or raised
                    return error_result(f"the environment: {exc}")
                return self._end(ep, f"{type(exc).__name__}: {exc}")
            except TimeoutError:
                return self._end(ep, f"no answer within {self.config.timeout_s:g} s", timeout=1.0)
            except Exception as exc:  # noqa: BLE001 - the connection: closed, reset, refused
                ep.lost = f"{type(exc).__name__}: {exc}"
                return self._end(ep, f"lost the environment server at {self.url} ({ep.lost})", lost=1.0)
            if result.done:  # a second call of the same turn must not step a finished episode
                ep.ended = "the environment ended it"
        reward = float(result.reward or 0.0)
        return ToolResult(self._text(result.observation), reward=reward,
                          metrics={"error": 0.0, "reward": reward, "done": float(bool(result.done))},
                          done=bool(result.done))

    def calc_reward(self, instance_id: str) -> float:
        ep = self._episodes[instance_id]
        if ep.lost:
            lost = sum(bool(e.lost) for e in self._episodes.values())
            raise ToolError(f"the OpenEnv server at {self.url} went away mid-episode ({lost} episode(s) "
                            f"lost; {ep.lost})\n    fix: check the server (its log, its memory), then "
                            "`dapo-flow run GRAPH --resume` continues from the last checkpoint")
        return 0.0  # the rewards came with the steps

    def release(self, instance_id: str) -> None:
        ep = self._episodes.pop(instance_id, None)
        if ep is not None:
            self._close(ep.client)

    # -- helpers ---------------------------------------------------------------------------------

    def _started(self) -> str:
        """The server's URL; the event loop, and with ``app`` the server, started on first use."""
        with self._start_lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, daemon=True, name=f"openenv-{self.name}").start()
                weakref.finalize(self, loop.call_soon_threadsafe, loop.stop)
                self._loop = loop
            if self.url is None:
                from dapo_flow.envs.serve import LoopbackServer

                async def serve() -> LoopbackServer:  # started from the loop's thread, which lives as
                    # long as this tool: the server's parent-death signal follows the thread that started it
                    return LoopbackServer(self.config.app, self.config.start_timeout_s)

                self._server = asyncio.run_coroutine_threadsafe(serve(), self._loop).result()
                self.url = self._server.url
            elif not self._reached:
                self._reach(self.url)
                self._reached = True
        return self.url

    def _reach(self, url: str) -> None:
        """An OpenEnv server answers ``GET /health``: a wrong or dead URL fails here, at once."""
        import httpx

        health = f"{url.replace('ws', 'http', 1) if url.startswith('ws') else url}/health"
        try:
            status = httpx.get(health, timeout=self.config.connect_timeout_s).status_code
        except httpx.HTTPError as exc:
            raise ToolError(f"cannot reach the OpenEnv server at {url} (GET {health}: {type(exc).__name__}: "
                            f"{exc})\n    fix: start the server (or name its app: in the tool's config) "
                            "and check the url") from None
        if status != 200:
            raise ToolError(f"the server at {url} answered GET {health} with HTTP {status}: is it an "
                            "OpenEnv server? (fix the url)")

    def _run(self, coro: Any, timeout_s: float) -> Any:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout_s + 1.0)  # the client's own timeout fires first
        except TimeoutError:
            future.cancel()
            raise

    def _close(self, client: Any) -> None:
        try:
            self._run(client.close(), 1.0)
        except Exception:  # noqa: BLE001 - closing a dead session must not hide why it died
            pass

    def _end(self, ep: _Episode, why: str, **metrics: float) -> ToolResult:
        ep.ended = why  # its next answer could be the late one: no more steps on it
        asyncio.run_coroutine_threadsafe(ep.client.close(), self._loop)  # not awaited: within the call's time
        return error_result(f"the episode ends: {why}", done=True, **metrics)

    def _text(self, observation: Any) -> str:
        field = self.config.observation_field
        if field is not None and isinstance(observation, dict) and field in observation:
            observation = observation[field]
        return observation if isinstance(observation, str) else json.dumps(observation, ensure_ascii=False)

    def _no_session(self, url: str, exc: Exception) -> str:
        what = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        # a server at capacity answers a new session with CAPACITY_REACHED and closes it, at once
        if "CAPACITY_REACHED" in str(exc) or type(exc).__name__.startswith("ConnectionClosed"):
            return (f"the OpenEnv server at {url} refused a session ({what})\n    fix: a batch runs its "
                    "samples' episodes at once (n x prompts); serve the environment with create_app(..., "
                    "max_concurrent_envs=N) and SUPPORTS_CONCURRENT_SESSIONS = True on its class")
        return (f"cannot start an episode on the OpenEnv server at {url} ({what})\n    fix: start the "
                "server (or name its app: in the tool's config) and check the url")
