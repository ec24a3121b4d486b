"""The request bodies the endpoint takes (OpenAI's, the fields it serves; an unknown field is a
422, not silently ignored) and OpenAI's error shape."""

from __future__ import annotations

import secrets
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

_STRICT = ConfigDict(extra="forbid")
MAX_N = 64  # completions per request
MAX_STOPS = 4  # OpenAI's limit


class ApiError(Exception):
    """An HTTP error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             409: "conflict_error", 410: "invalid_request_error", 413: "invalid_request_error",
             422: "invalid_request_error", 429: "rate_limit_error", 503: "server_error"}

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def authorize(header: str, token: str) -> None:
    """Refuse (401) an ``Authorization`` header that is not ``Bearer TOKEN``."""
    scheme, _, sent = header.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(sent.strip().encode(), token.encode()):
        raise ApiError(401, "missing or wrong bearer token: send 'Authorization: Bearer TOKEN' with the token "
                       "the run printed (an openai client's api_key)", code="invalid_api_key")


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI's JSON string (a dict from some clients)


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    """A chat message; the fields an ``openai`` client's own message objects carry when dumped
    (``refusal``, ``annotations``, ...) are taken and ignored."""

    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any = None
    function_call: Any = None

    def text(self) -> str:
        """The content as text (text parts joined; other parts are refused upstream)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(str(part.get("text", "")) for part in self.content)


class _Sampling(BaseModel):
    model_config = _STRICT
    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = Field(1.0, ge=0.0, le=10.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    user: str | None = None  # the episode id when the X-Episode-Id header is absent
    seed: int | None = None  # requests outside an episode: their seed (an episode seeds its own)
    stream: Literal[False] = False
    frequency_penalty: Literal[0, 0.0] = 0.0
    presence_penalty: Literal[0, 0.0] = 0.0

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS or any(not s for s in stops):
            raise ApiError(400, f"stop takes at most {MAX_STOPS} non-empty strings", param="stop")
        return stops


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Literal[0] | None = None  # the sampled token's logprob only
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    prompt: str | list[int] = Field(min_length=1)
    max_tokens: int = Field(16, ge=1)  # OpenAI's default
    logprobs: int | None = Field(None, ge=0, le=5)  # the sampled token's logprob (no alternatives)
    echo: Literal[False] = False

    def limit(self) -> int:
        return self.max_tokens
