"""`dapo-flow serve-reward REF`: any reward function over HTTP (FastAPI on uvicorn).

REF is what a `score` node's ``reward:`` takes: ``builtin:NAME``, ``module:fn`` or
``file.py:fn`` (a verl reward file's ``compute_score`` included, called with verl's arguments).
The wire format is in :mod:`dapo_flow.reward_server.protocol`. A request's rows run in a thread
pool of ``concurrency`` threads shared by all requests (the function is called from several
threads at once when concurrency > 1: an I/O-bound judge gains, pure-Python CPU work does not,
the GIL being what it is). The server holds at most ``max_pending`` requests at a time and
answers 503 past that (the client backs off and retries).
"""

from __future__ import annotations

import asyncio
import ipaddress
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from dapo_flow.data.reward_pool import RewardSpec, as_number, resolve_reward, short
from dapo_flow.errors import DapoFlowError
from dapo_flow.reward_server.protocol import (
    HEALTH_PATH, MAX_BODY_BYTES, MAX_ROWS, SCORE_PATH, ScoreRequest, ScoreRow,
)

ScoreEntry = float | dict[str, Any]
BUILTINS = ("builtin:addition", "builtin:chain", "builtin:tool-arith", "builtin:math")


def score_row(fn: Callable[[str, str, dict], Any], spec: RewardSpec, row: ScoreRow) -> ScoreEntry:
    """The wire entry for one row: a number, ``{"score": x, "acc"?: a, ...numbers}`` or
    ``{"error": text}``. A builtin's verdict goes as ``acc`` (it compares with ``correct``);
    a dict's entries that are not numbers (a verl function's predicted text) are left out."""
    extra = {**row.extra_info, **({"data_source": row.data_source} if row.data_source is not None else {})}
    try:
        result = fn(row.response, row.ground_truth, extra)
    except Exception as exc:  # the function's failure is the row's answer, not the server's
        return {"error": f"raised {exc!r}"}
    if isinstance(result, dict):
        if "score" not in result:
            return {"error": f"returned a dict without 'score': {short(result)}"}
        numbers = {key: as_number(value) for key, value in result.items()}
        if numbers["score"] is None:
            return {"error": f"returned {short(result['score'])} as 'score'"}
        if "acc" in result and numbers["acc"] is None:
            return {"error": f"returned {short(result['acc'])} as 'acc'"}
        return {key: value for key, value in numbers.items() if value is not None}
    score = as_number(result)
    if score is None:
        return {"error": f"returned {short(result)} as 'score'"}
    return {"score": score, "acc": float(score == spec.correct)} if spec.builtin else score


def host_warning(host: str) -> str | None:
    """A warning when the server would listen beyond this machine, None for loopback."""
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:
        if host == "localhost":
            return None
    return (f"serving on {host}: anyone who can reach it can run the reward function on any text "
            "and read its scores (there is no login). Leave --host at 127.0.0.1 and reach it over "
            "ssh -L instead, where you can")


def make_app(reward: str, *, concurrency: int = 4, base_dir: str | None = None) -> FastAPI:
    """The FastAPI app serving ``reward``; raises (an ImportSpecError / RunError) when it
    does not resolve, before anything listens."""
    spec = RewardSpec(reward, base_dir=base_dir or os.getcwd())
    fn = _resolved(spec)
    pool = ThreadPoolExecutor(concurrency, thread_name_prefix="reward")
    scored = [0]
    lock = threading.Lock()

    def run_chunk(rows: list[ScoreRow]) -> list[ScoreEntry]:
        out = [score_row(fn, spec, row) for row in rows]
        with lock:
            scored[0] += len(rows)
        return out

    app = FastAPI(title="dapo-flow reward server", docs_url=None, redoc_url=None)

    @app.get(HEALTH_PATH)
    async def health() -> dict:
        return {"status": "ok", "reward": reward, "rows_scored": scored[0]}

    @app.post(SCORE_PATH)
    async def score(request: Request):
        body = await _body(request)
        if isinstance(body, JSONResponse):
            return body
        try:
            parsed = ScoreRequest.model_validate_json(body)
        except ValidationError as exc:
            return _validation_error(exc)
        rows = parsed.rows
        if len(rows) > MAX_ROWS:
            return _detail(413, f"{len(rows)} rows in one request; at most {MAX_ROWS}: send smaller batches")
        # a batch's rows spread over the pool's threads, in order
        size = math.ceil(len(rows) / concurrency)
        loop = asyncio.get_running_loop()
        parts = await asyncio.gather(*(loop.run_in_executor(pool, run_chunk, rows[i:i + size])
                                       for i in range(0, len(rows), size)))
        return JSONResponse({"scores": [entry for part in parts for entry in part]})

    async def _body(request: Request) -> bytes | JSONResponse:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            return _detail(413, f"request body of {declared} bytes; at most {MAX_BODY_BYTES}")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                return _detail(413, f"request body over {MAX_BODY_BYTES} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    app.state.pool = pool
    return app


def _resolved(spec: RewardSpec) -> Callable[[str, str, dict], Any]:
    """The function, or a DapoFlowError saying what REF should be."""
    from dapo_flow.core.imports import ImportSpecError
    from dapo_flow.reward_server.client import is_url

    if is_url(spec.reward):
        raise DapoFlowError(f"'{spec.reward}' is an address: serve-reward serves a function "
                            "(file.py:fn, module:fn, builtin:NAME), which a score node then reaches at that address")
    try:
        return resolve_reward(spec)
    except ImportSpecError as exc:
        if spec.builtin:
            raise DapoFlowError(f"'{spec.reward}' is not a built-in reward: use {', '.join(BUILTINS)}") from None
        raise DapoFlowError(f"{exc}\n    fix: name a function as file.py:fn or package.module:fn "
                            "(a verl reward file: file.py:compute_score)") from None


def _detail(status: int, text: str) -> JSONResponse:
    return JSONResponse({"detail": text}, status_code=status)


def _validation_error(exc: ValidationError) -> JSONResponse:
    """400 for a body that is not JSON, 422 for JSON of the wrong shape; the first few problems
    spelled out (where, what)."""
    errors = exc.errors(include_url=False)
    if any(e["type"] == "json_invalid" for e in errors):
        return _detail(400, f"the body is not valid JSON: {errors[0]['msg']}; send "
                            '{"rows": [{"response": ..., "ground_truth": ...}, ...]}')
    problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in errors[:5])
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return _detail(422, f"bad request: {problems}{more}")


def serve(reward: str, *, host: str = "127.0.0.1", port: int = 8000, concurrency: int = 4,
          max_pending: int = 256, announce: Callable[[str], None] = print) -> None:
    """Serve ``reward`` until interrupted. The reward is resolved before the port is bound, so
    a bad reference fails at once (the CLI checks that the port is free first)."""
    import uvicorn

    app = make_app(reward, concurrency=concurrency)
    shown = f"[{host}]" if ":" in host else host
    announce(f"reward server for {reward} on http://{shown}:{port}  "
             f"(POST {SCORE_PATH}, GET {HEALTH_PATH}; {concurrency} threads)")
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning", limit_concurrency=max_pending,
                    timeout_graceful_shutdown=5)
    finally:
        app.state.pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["host_warning", "make_app", "score_row", "serve"]
