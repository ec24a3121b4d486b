"""The reward server's wire format, shared by the server (`dapo-flow serve-reward`) and the
client (`score` with `reward: http://...`). One place, so the two cannot drift.

``POST /score`` with a JSON body ``{"rows": [ROW, ...]}`` (1 to ``MAX_ROWS`` rows), each ROW::

    {"prompt": "What is 2+3?", "response": "Answer: 5", "ground_truth": "5",
     "data_source": "addition", "extra_info": {}}

answers ``200`` with ``{"scores": [SCORE, ...]}``, one SCORE per row, in order, each one of:

- a number: the score (``acc`` is then ``score > 0``, as for an in-process function);
- an object with a number under ``"score"`` and optionally ``"acc"`` and more numbers (extra
  metrics, read by a ``score`` node that declares them in ``extra_columns``);
- ``{"error": "TEXT"}``: the reward function failed on that row (raised, or returned something
  that is not a finite number); the client stops the run naming the sample, or masks the row.

Bad requests get a 4xx with ``{"detail": "TEXT"}``: 400 malformed JSON, 422 a missing or
mistyped field, 413 more than ``MAX_ROWS`` rows or a body over ``MAX_BODY_BYTES``.
``GET /health`` answers ``{"status": "ok", "reward": REF, "rows_scored": N}``.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

MAX_ROWS = 4096  # rows per request: bounds a request's memory and its time in the pool
MAX_BODY_BYTES = 256 * 1024 * 1024  # 4096 rows of ~64 KB responses
SCORE_PATH = "/score"
HEALTH_PATH = "/health"


class ScoreRow(BaseModel):
    """One response to score."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = ""
    """The prompt's text (reward functions of dapo-flow's signature do not read it; a judge may)."""
    response: str
    """The model's response text."""
    ground_truth: str
    """The reference answer."""
    data_source: str | None = None
    """The prompt's data source (verl's `data_source`), when the data carries one."""
    extra_info: dict[str, Any] = Field(default_factory=dict)
    """More about the row, handed to the function as its extra_info."""


class ScoreRequest(BaseModel):
    """A batch: ``rows`` in, as many scores out."""

    model_config = ConfigDict(extra="forbid")

    rows: list[ScoreRow] = Field(min_length=1)


class ScoreResponse(BaseModel):
    """One entry per request row, in order: a number, ``{"score": x, ...}`` or ``{"error": "..."}``."""

    scores: list[float | dict[str, Any]]
