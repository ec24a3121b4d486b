"""Run a user's harness once per sample against the endpoint.

A harness is ``async def run(client, task) -> result`` (called with an ``openai.AsyncOpenAI``)
or a plain ``def run(client, task)`` (called in a thread with an ``openai.OpenAI``); ``client``
points at the endpoint with the run's token and carries the sample's episode id, ``task`` is the
prompt row as a dict. ``result``: a number, a dict with ``score``, or None (no reward: leave it
to the graph's ``score`` node). An exception, a timeout or a result of another kind is an
:class:`Outcome` with a ``masked`` reason, never an exception out of here: the sample is masked
and the run goes on. The clients never retry: a retried request would be a second request of
the episode.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import ssl
import numbers
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

log = logging.getLogger(__name__)
EPISODE_HEADER = "X-Episode-Id"
EPISODES_PER_POOL = 16


@dataclass(frozen=True)
class Outcome:
    reward: float | None
    masked: str = ""  # "", "harness_error" or "timeout"
    error: str = ""


def reward_of(result: Any) -> tuple[float | None, str]:
    """(reward, problem): a finite number, a dict's ``score``, or None; else the problem."""
    value = result.get("score") if isinstance(result, dict) else result
    if value is None and not (isinstance(result, dict) and "score" in result):
        return None, ""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        return None, (f"the harness returned {result!r:.80}: return a finite number, a dict with 'score', "
                      "or None")
    return float(value), ""


def run_episodes(fn: Callable, base_url: str, token: str, jobs: list[tuple[str, dict]], *,
                 timeout_s: float, concurrency: int, on_done: Callable[[str, Outcome], Any]) -> list[Any]:
    """``on_done(episode id, outcome)`` for each (episode id, task) as its call ends (so the
    endpoint stops waiting for its requests), their values in order."""
    return asyncio.run(_run_all(fn, base_url, token, jobs, timeout_s, concurrency, on_done))


async def _run_all(fn: Callable, base_url: str, token: str, jobs: list[tuple[str, dict]],
                   timeout_s: float, concurrency: int, on_done: Callable[[str, Outcome], Any]) -> list[Any]:
    import httpx
    import openai

    is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
    semaphore = asyncio.Semaphore(concurrency)
    pool = None if is_async else ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="harness")
    # a connection pool per EPISODES_PER_POOL episodes: httpcore scans every connection of its pool
    # for each request it places, so one pool of 256 connections costs more than the requests;
    # trust_env off: a proxy from the environment must not carry loopback requests
    size = max(1, min(EPISODES_PER_POOL, concurrency))
    pooled = dict(limits=httpx.Limits(max_connections=size, max_keepalive_connections=size), timeout=timeout_s,
                  verify=_tls_context(), trust_env=False)
    https = [(httpx.AsyncClient if is_async else httpx.Client)(**pooled) for _ in range(math.ceil(len(jobs) / size))]
    client_cls = openai.AsyncOpenAI if is_async else openai.OpenAI
    clients = [client_cls(base_url=base_url, api_key=token, http_client=h, max_retries=0) for h in https]

    async def one(k: int, episode: str, task: dict) -> Any:
        return on_done(episode, await outcome(clients[k // size], episode, task))

    async def outcome(base: Any, episode: str, task: dict) -> Outcome:
        client = base.with_options(default_headers={EPISODE_HEADER: episode})
        async with semaphore:
            try:
                if is_async:
                    result = await asyncio.wait_for(fn(client, task), timeout_s)
                else:
                    call = asyncio.get_running_loop().run_in_executor(pool, fn, client, task)
                    result = await asyncio.wait_for(call, timeout_s)
            except asyncio.TimeoutError:
                return _logged(episode, Outcome(None, "timeout", f"timed out after {timeout_s:g} s (timeout_s)"))
            except Exception as exc:  # noqa: BLE001 - user code: the sample is masked, the run goes on
                return _logged(episode, Outcome(None, "harness_error", f"{type(exc).__name__}: {exc}"))
        reward, problem = reward_of(result)
        return _logged(episode, Outcome(None, "harness_error", problem)) if problem else Outcome(reward)

    try:
        return list(await asyncio.gather(*(one(k, episode, task) for k, (episode, task) in enumerate(jobs))))
    finally:
        if pool is not None:  # a timed-out call's thread is left to finish (its requests get 410)
            pool.shutdown(wait=False, cancel_futures=True)
        for h in https:
            if is_async:
                await h.aclose()
            else:
                h.close()


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One TLS context for every client of the process: never used over the endpoint's http, but
    an httpx client builds one unless given one, and loading the CA bundle costs ~10-100 ms."""
    return ssl.create_default_context()


def _logged(episode: str, outcome: Outcome) -> Outcome:
    log.warning("harness episode %s masked (%s): %s", episode, outcome.masked, outcome.error)
    return outcome
