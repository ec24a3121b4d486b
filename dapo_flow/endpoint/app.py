"""The routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models`` (bearer token) and
``GET /health`` (none). Errors come in OpenAI's shape: 400 malformed JSON or an unsupported
value, 401 no or a wrong token, 404 an unknown route or model, 409/410 an episode busy or
ended, 413 a body or prompt over the limits, 422 unknown or mistyped fields, 429 an episode
over its request cap, 503 a full queue."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from dapo_flow.agent.rollout import request_seed
from dapo_flow.endpoint.batcher import Batcher, QueueFull, SamplingKey
from dapo_flow.endpoint.episodes import EpisodeBook, EpisodeError, Sampled
from dapo_flow.endpoint.protocol import ApiError, ChatRequest, CompletionRequest, authorize
from dapo_flow.endpoint.render import (SampledTurns, assistant_message, chat_prompt, completion_prompt,
                                       tool_schemas)

EPISODE_HEADER = "x-episode-id"
MAX_BODY_BYTES = 8 << 20


@dataclass
class Served:
    """What the routes share: the engine behind its batcher and the episodes being recorded."""

    tokenizer: Any
    batcher: Batcher
    book: EpisodeBook
    model_name: str
    token: str
    call_format: str
    max_model_len: int
    eos_ids: set[int]
    require_episode: bool  # in a training run: a request outside a registered episode is refused
    # in a training run, the harness node's (temperature, top_p, top_k) for every request: rollout
    # logprobs are then those of the distribution the trainer recomputes; None: the request's own
    sampling: tuple[float, float, int] | None = None
    turns: SampledTurns = field(default_factory=SampledTurns)

    def key(self, body: Any) -> SamplingKey:
        if self.sampling is None:
            return SamplingKey(body.n, body.temperature, body.top_p)
        return SamplingKey(body.n, *self.sampling)

    def decode(self, ids: list[int], special: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=not special)


def build_app(served: Served) -> FastAPI:
    app = FastAPI(title="dapo-flow endpoint", docs_url=None, redoc_url=None, openapi_url=None)
    answer_errors_as_openai(app)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": served.model_name, "weights_version": served.batcher.engine.weights_version}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        _authorize(served, request)
        return {"object": "list", "data": [{"id": served.model_name, "object": "model", "created": 0,
                                            "owned_by": "dapo-flow", "max_model_len": served.max_model_len}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, Any]:
        body = await _parse(served, request, ChatRequest)
        schemas = tool_schemas(body)
        prompt = chat_prompt(served.tokenizer, body, served.call_format, min(served.eos_ids), served.turns)
        fed, choices = await _sample(served, request, body, prompt, body.limit())
        out = []
        for i, s in enumerate(choices):
            text = served.decode(s.ids, special=False)
            message, calls = assistant_message(text, served.call_format, schemas, parse=body.tool_choice != "none")
            served.turns.add(message, text)
            out.append({"index": i, "message": message, "finish_reason": "tool_calls" if calls else _finish(s),
                        "logprobs": {"content": _chat_logprobs(served, s)} if body.logprobs else None})
        return _response(served, "chat.completion", "chatcmpl", out, fed, choices)

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict[str, Any]:
        body = await _parse(served, request, CompletionRequest)
        prompt = completion_prompt(served.tokenizer, body)
        fed, choices = await _sample(served, request, body, prompt, body.limit())
        out = [{"index": i, "text": served.decode(s.ids, special=False), "finish_reason": _finish(s),
                "logprobs": _completion_logprobs(served, s) if body.logprobs is not None else None}
               for i, s in enumerate(choices)]
        return _response(served, "text_completion", "cmpl", out, fed, choices)

    return app


def answer_errors_as_openai(app: FastAPI) -> None:
    """Errors in OpenAI's shape: an :class:`ApiError` as it says, an unknown route a 404 naming the routes."""

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
        message = (f"no route {request.method} {request.url.path}; routes: POST /v1/chat/completions, "
                   "POST /v1/completions, GET /v1/models, GET /health") if exc.status_code in (404, 405) else str(exc.detail)
        return JSONResponse(ApiError(exc.status_code, message).body(), status_code=exc.status_code)


def _authorize(served: Served, request: Request) -> None:
    authorize(request.headers.get("authorization", ""), served.token)


async def _parse(served: Served, request: Request, model: type) -> Any:
    _authorize(served, request)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:  # refused before it is read
        raise ApiError(413, f"request body of {declared} bytes is over the {MAX_BODY_BYTES}-byte limit")
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"request body of {len(raw)} bytes is over the {MAX_BODY_BYTES}-byte limit")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        problems = [f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors()]
        raise ApiError(422, "; ".join(problems), param=".".join(map(str, exc.errors()[0]["loc"])),
                       code="invalid_fields") from None
    if body.model != served.model_name:
        raise ApiError(404, f"model '{body.model}' is not served here; this endpoint serves '{served.model_name}'",
                       param="model", code="model_not_found")
    return body


async def _sample(served: Served, request: Request, body: Any, prompt: list[int],
                  limit: int | None) -> tuple[list[int], list[Sampled]]:
    """The request's completions, sampled in a batch, cut at its stop strings, recorded in its episode."""
    stops = body.stops()
    if len(prompt) >= served.max_model_len:
        raise ApiError(413, f"the prompt has {len(prompt)} tokens; the model's context is {served.max_model_len}",
                       param="messages" if isinstance(body, ChatRequest) else "prompt", code="context_length_exceeded")
    episode = request.headers.get(EPISODE_HEADER) or body.user
    try:
        admitted = served.book.admit(episode, prompt, served.eos_ids, served.decode, request_seed)
    except EpisodeError as exc:
        raise ApiError(exc.status, exc.message, code=exc.code) from None
    if admitted is None and served.require_episode:
        raise ApiError(400, "name the episode: the X-Episode-Id header (or the user field) of the client the "
                       "harness was given", param="user", code="no_episode")
    fed = admitted.fed if admitted else prompt
    seed = admitted.seed if admitted else (body.seed if body.seed is not None else secrets.randbits(62))
    room = min(served.max_model_len - len(fed), admitted.max_tokens if admitted else served.max_model_len)
    recorded = bool(admitted and admitted.recorded)
    if room < 1:
        if recorded:
            served.book.fail(episode, spent=True)
        raise ApiError(413, f"the episode's context holds {len(fed)} tokens; the model's context is "
                       f"{served.max_model_len}", code="context_length_exceeded")
    try:
        future = served.batcher.submit(fed, served.key(body),
                                       min(limit or room, room), seed)
        choices = await asyncio.wrap_future(future)
    except QueueFull as exc:
        if recorded:
            served.book.fail(episode)
        raise ApiError(503, str(exc)) from None
    except BaseException:
        if recorded:
            served.book.fail(episode)
        raise
    choices = [_stopped(served, s, stops) for s in choices] if stops else choices
    if recorded:
        served.book.record(episode, fed, choices)
    return fed, choices


def _stopped(served: Served, s: Sampled, stops: list[str]) -> Sampled:
    """``s`` cut before its first stop string: its tokens whose text comes before it (a token
    straddling it is dropped: the tokens kept are exactly the text returned)."""
    for k in range(1, len(s.ids) + 1):
        text = served.decode(s.ids[:k], special=False)
        at = min((i for i in (text.find(stop) for stop in stops) if i >= 0), default=-1)
        if at >= 0:
            keep = next(j for j in range(k, -1, -1) if len(served.decode(s.ids[:j], special=False)) <= at)
            return Sampled(s.ids[:keep], s.logprobs[:keep], s.versions[:keep], truncated=False)
    return s


def _finish(s: Sampled) -> str:
    return "length" if s.truncated else "stop"


def _chat_logprobs(served: Served, s: Sampled) -> list[dict[str, Any]]:
    tokens = [served.decode([t]) for t in s.ids]
    return [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(tokens, s.logprobs)]


def _completion_logprobs(served: Served, s: Sampled) -> dict[str, Any]:
    tokens = [served.decode([t]) for t in s.ids]
    offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    return {"tokens": tokens, "token_logprobs": s.logprobs,
            "top_logprobs": [{t: lp} for t, lp in zip(tokens, s.logprobs)], "text_offset": offsets}


def _response(served: Served, kind: str, prefix: str, choices: list[dict], fed: list[int],
              sampled: list[Sampled]) -> dict[str, Any]:
    completion = sum(len(s.ids) for s in sampled)
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
            "model": served.model_name, "choices": choices,
            "usage": {"prompt_tokens": len(fed), "completion_tokens": completion,
                      "total_tokens": len(fed) + completion}}
