"""The client a `score` node with ``reward: http://HOST:PORT`` uses: rows go in batches of
``server.batch_size`` to ``POST URL/score`` (the wire format: :mod:`.protocol`), up to
``server.concurrency`` batches in flight at once, and each answer is checked before it is
believed: the HTTP status, the JSON's shape, one entry per row, every score a finite number.

A batch whose answer fails any check, or that gets no answer (connection refused or reset, no
reply within ``timeout_s``, HTTP 5xx or 429), is sent again after a pause (``backoff_s``,
doubled each time, at most ``MAX_BACKOFF_S``) up to ``retries`` times; then the node stops the
run with a RunError naming the URL and the last failure (``on_error: fail``), or its rows are
masked (``on_error: mask``). A 4xx other than 408 / 429 is never retried: the server refused the
request itself (a wrong URL, not a reward server, a batch over its limit), which a retry cannot
fix. So a call takes at most about ``(retries + 1) * timeout_s`` plus the pauses: no hang.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal, Sequence
from urllib.parse import urlsplit

from pydantic import BaseModel, Field

from dapo_flow.core.contract import PARAMS_CONFIG
from dapo_flow.data.reward_pool import as_number, short
from dapo_flow.errors import RunError
from dapo_flow.reward_server.protocol import MAX_ROWS, SCORE_PATH

MAX_BACKOFF_S = 10.0
Entry = float | dict[str, Any]  # a row's answer (protocol.ScoreResponse); None: masked


class ServerSettings(BaseModel):
    """How a `score` node talks to its reward server (``reward: http://...``)."""

    model_config = PARAMS_CONFIG

    batch_size: int = Field(256, ge=1, le=MAX_ROWS)
    """Rows per request."""
    concurrency: int = Field(4, ge=1, le=256)
    """Requests in flight at once (a call's batches are sent in parallel)."""
    timeout_s: float = Field(60.0, gt=0, le=3600)
    """Seconds to wait for a request's answer (to connect, and between bytes of the reply)."""
    retries: int = Field(5, ge=0, le=20)
    """Times a failed request is sent again before giving up."""
    backoff_s: float = Field(0.25, ge=0, le=60)
    """Pause before the first retry; doubled before each next one, at most 10 s."""
    on_error: Literal["fail", "mask"] = "fail"
    """After the retries (or a row the function failed on): `fail` stops the run with an error
    naming the URL; `mask` keeps going with those rows masked (each gets its group's mean
    score and acc, so it carries no advantage) and counted in `score/masked`."""


def is_url(reward: str) -> bool:
    """Whether a reward reference is an address (checked by :func:`check_url`), not code."""
    return "://" in reward


def check_url(url: str) -> str:
    """``url`` if it is a usable http(s) address, else ValueError saying what is wrong."""
    example = "e.g. http://127.0.0.1:8000 (where `dapo-flow serve-reward REF --port 8000` listens)"
    if any(c.isspace() for c in url):
        raise ValueError(f"reward URL {url!r} contains whitespace; {example}")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"reward URL {url!r}: a reward server speaks http:// or https://; {example}")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"reward URL {url!r} has a bad port (1-65535); {example}") from None
    if not parts.hostname:
        raise ValueError(f"reward URL {url!r} names no host; {example}")
    if port == 0 or parts.query or parts.fragment:
        raise ValueError(f"reward URL {url!r}: give the server's address only (no query, no port 0); {example}")
    return url


class ServerFailed(RunError):
    """A batch got no usable answer after the retries."""


class RewardClient:
    """Scores rows on the reward server at ``url``; thread-safe, kept for the node's life."""

    def __init__(self, url: str, settings: ServerSettings, node_id: str = "score"):
        import httpx

        self.url, self.settings, self.node_id = url.rstrip("/"), settings, node_id
        self.endpoint = self.url + SCORE_PATH
        limits = httpx.Limits(max_connections=settings.concurrency, max_keepalive_connections=settings.concurrency)
        # trust_env=False: no proxy from the environment between the trainer and its reward server
        self._http = httpx.Client(timeout=settings.timeout_s, limits=limits, trust_env=False)
        self._pool = ThreadPoolExecutor(settings.concurrency, thread_name_prefix="reward-client")
        self._lock = threading.Lock()
        self.retried = 0  # requests sent again, since the client started

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()

    def score(self, rows: Sequence[dict]) -> list[Entry | None]:
        """One entry per row (protocol.ScoreResponse's), in order; None for each row of a batch
        that failed with ``on_error: mask``. Raises ServerFailed with ``on_error: fail``."""
        size = self.settings.batch_size
        batches = [list(rows[i:i + size]) for i in range(0, len(rows), size)]
        results = list(self._pool.map(self._batch, batches))
        return [entry for batch in results for entry in batch]

    def _batch(self, rows: list[dict]) -> list[Entry | None]:
        body = json.dumps({"rows": rows}).encode()
        failure = ""
        for attempt in range(self.settings.retries + 1):
            if attempt:
                with self._lock:
                    self.retried += 1
                time.sleep(min(self.settings.backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S))
            failure = self._post(body, len(rows))
            if isinstance(failure, list):
                return failure
        if self.settings.on_error == "mask":
            return [None] * len(rows)
        raise ServerFailed(
            f"reward server {self.url} (node '{self.node_id}'): no usable answer to a batch of "
            f"{len(rows)} rows after {self.settings.retries + 1} attempts; the last: {failure}\n"
            f"    fix: check that the server runs at that address (`dapo-flow serve-reward REF --port "
            f"{urlsplit(self.url).port or 80}`) and answers within server.timeout_s "
            f"({self.settings.timeout_s:g} s); or raise server.retries, or set server.on_error: mask "
            "to go on without those rows")

    def _post(self, body: bytes, n: int) -> list[Entry] | str:
        """The batch's entries, or why this attempt failed (a retry may help)."""
        import httpx

        try:
            reply = self._http.post(self.endpoint, content=body, headers={"content-type": "application/json"})
        except httpx.TimeoutException:
            return f"no answer within timeout_s={self.settings.timeout_s:g} s"
        except httpx.TransportError as exc:
            return f"could not reach it ({type(exc).__name__}: {exc or 'connection failed'})"
        if 400 <= reply.status_code < 500 and reply.status_code not in (408, 429):
            raise RunError(
                f"reward server {self.url} (node '{self.node_id}') refused the request with HTTP "
                f"{reply.status_code}: {short(reply.text, 300)}\n"
                f"    fix: point reward: at a `dapo-flow serve-reward` server's address (it serves "
                f"POST {SCORE_PATH}), with server.batch_size within what it accepts")
        if reply.status_code != 200:
            return f"HTTP {reply.status_code}: {short(reply.text)}"
        return parse_scores(reply.content, n)


def parse_scores(content: bytes, n: int) -> list[Entry] | str:
    """A reply's entries when it is a well-formed answer for ``n`` rows, else what is wrong."""
    try:
        data = json.loads(content)
    except ValueError:
        return f"the reply is not JSON: {short(content)}"
    scores = data.get("scores") if isinstance(data, dict) else None
    if not isinstance(scores, list):
        return f"the reply has no 'scores' list: {short(data)}"
    if len(scores) != n:
        return f"{len(scores)} scores for {n} rows"
    for i, entry in enumerate(scores):
        if not _well_formed(entry):
            return f"score {i} is {short(entry)}: not a finite number, {{'score': number, ...}} or {{'error': text}}"
    return scores


def _well_formed(entry: Any) -> bool:
    if isinstance(entry, dict):
        if set(entry) == {"error"}:
            return isinstance(entry["error"], str)
        return "score" in entry and all(as_number(v) is not None and not isinstance(v, bool)
                                        for v in entry.values())
    return as_number(entry) is not None and not isinstance(entry, bool)
