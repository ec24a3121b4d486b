"""score: verify each response against its ground truth and emit score / acc columns.

Reward functions: ``builtin:addition``, ``builtin:math`` (boxed / final answer, DAPO's
+1 / -1), or user code ``module:fn`` / ``file.py:fn`` taking
``(response_text, ground_truth, extra_info)`` and returning a float or a dict with
``score`` (and optionally ``acc`` plus the declared ``extra_columns``).
``acc`` is 1.0 when the answer is correct, taken before any overlong penalty.

A reward function's value is checked, never trusted: anything but a finite real number (None,
NaN, inf, a string, a list, a dict without ``score``, a value beyond float32) or an exception
raised by the function stops the run with a RunError naming the function, the sample (prompt id
and sample index) and the value. Not skipped: a silently dropped sample would bias the group's
advantages, and a bad value is a bug in the function that the user has to see.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, Field

from dapo_flow.graph import columns as C
from dapo_flow.data.arrow_utils import with_columns
from dapo_flow.graph.contract import OpContext, PARAMS_CONFIG
from dapo_flow.errors import RunError

FLOAT32_MAX = float(np.finfo(np.float32).max)


class Params(BaseModel):
    model_config = PARAMS_CONFIG

    reward: str = Field("builtin:addition", min_length=1)
    """`builtin:addition`, `builtin:math`, `module:fn` or `file.py:fn`."""
    correct: float = Field(1.0, ge=-1e6, le=1e6)
    """Score of a correct answer (built-in verifiers; DAPO uses +1)."""
    wrong: float = Field(-1.0, ge=-1e6, le=1e6)
    """Score of a wrong answer (built-in verifiers; DAPO uses -1, use 0 for 1/0 rewards)."""
    extra_columns: tuple[str, ...] = Field(())
    """Extra float columns a user function returns in its dict (declared for schema checks)."""


def _resolve(params: Params) -> Callable[..., Any]:
    from dapo_flow.data import tasks
    from dapo_flow.graph.imports import load_object

    builtins = {"builtin:addition": tasks.verify_addition, "builtin:math": tasks.verify_math}
    if params.reward in builtins:
        verify = builtins[params.reward]
        return lambda text, truth, _extra: verify(
            text, truth, correct=params.correct, wrong=params.wrong
        )
    fn = load_object(params.reward)
    if not callable(fn):
        raise RunError(f"reward '{params.reward}' is a {type(fn).__name__}, not a function: name a "
                       "function taking (response_text, ground_truth, extra_info)")
    return fn


def as_number(value: Any) -> float | None:
    """``value`` as a finite float32-representable number, or None when it is not one (numpy
    scalars, 0-d arrays and one-element tensors count as their element; strings never do)."""
    if isinstance(value, (np.ndarray, np.generic)) or type(value).__module__.startswith("torch"):
        try:
            value = value.item()
        except (ValueError, RuntimeError):  # more than one element
            return None
    if not isinstance(value, numbers.Real):
        return None
    try:
        x = float(value)
    except OverflowError:  # an int beyond float range
        return None
    return x if math.isfinite(x) and abs(x) <= FLOAT32_MAX else None


class Score:
    """Adds score, acc (and declared extras) to every rollout row."""

    Params = Params
    REQUIRES = C.typed(C.RESPONSE_TEXT, C.GROUND_TRUTH)
    CARDINALITY = "map"
    NEEDS_MODEL = False
    ROLE = "reward"

    @classmethod
    def produces(cls, params: Params) -> dict[str, pa.DataType]:
        return {**C.typed(C.SCORE, C.ACC), **{name: pa.float32() for name in params.extra_columns}}

    def __init__(self, params: Params, ctx: OpContext):
        self.params = params
        self.ctx = ctx
        self.fn = _resolve(params)
        self.builtin = params.reward.startswith("builtin:")
        self._metrics: dict[str, float] = {}

    def __call__(self, batch: pa.Table) -> pa.Table:
        texts = batch.column(C.RESPONSE_TEXT).to_pylist()
        truths = batch.column(C.GROUND_TRUTH).to_pylist()
        extras = {name: np.zeros(len(texts), np.float32) for name in self.params.extra_columns}
        score = np.zeros(len(texts), np.float32)
        acc = np.zeros(len(texts), np.float32)
        for i, (text, truth) in enumerate(zip(texts, truths)):
            try:
                result = self.fn(text, truth, {})
            except Exception as exc:  # user code: report which sample, not a traceback
                raise RunError(self._bad(batch, i, f"raised {exc!r}")) from exc
            if isinstance(result, dict):
                if "score" not in result:
                    raise RunError(self._bad(batch, i, f"returned a dict without 'score': {_short(result)}"))
                score[i] = self._number(batch, i, result["score"], "score")
                acc[i] = self._number(batch, i, result.get("acc", float(score[i] > 0)), "acc")
                for name in extras:
                    extras[name][i] = self._number(batch, i, result.get(name, 0.0), name)
            else:
                score[i] = self._number(batch, i, result, "score")
                acc[i] = float(score[i] == self.params.correct if self.builtin else score[i] > 0)
        self._metrics = {"score/mean": float(score.mean()), "acc/mean": float(acc.mean())}
        return with_columns(batch, {C.SCORE: score, C.ACC: acc, **extras})

    def last_metrics(self) -> dict[str, float]:
        return dict(self._metrics)

    def _number(self, batch: pa.Table, row: int, value: Any, what: str) -> float:
        number = as_number(value)
        if number is None:
            raise RunError(self._bad(batch, row, f"returned {_short(value)} as '{what}'"))
        return number

    def _bad(self, batch: pa.Table, row: int, what: str) -> str:
        """The error text for a bad reward: which function, node and sample, what it did."""
        sample = _sample_name(batch, row)
        response = _short(batch.column(C.RESPONSE_TEXT)[row].as_py())
        return (
            f"reward function '{self.params.reward}' (node '{self.ctx.node_id}') {what} for "
            f"{sample} (response {response})\n"
            "    a reward must be a finite number, or a dict with a finite number under 'score' "
            "(and optionally 'acc' and the declared extra_columns)\n"
            "    fix: make the function return one for every response (e.g. the wrong-answer "
            "score when it cannot parse the response); `dapo-flow run GRAPH --resume` then "
            "continues from the last checkpoint"
        )


def _sample_name(batch: pa.Table, row: int) -> str:
    parts = []
    if C.PROMPT_ID in batch.column_names:
        parts.append(f"prompt id {batch.column(C.PROMPT_ID)[row].as_py()!r}")
    if C.SAMPLE_IDX in batch.column_names:
        parts.append(f"sample {batch.column(C.SAMPLE_IDX)[row].as_py()}")
    return ", ".join(parts) or f"row {row}"


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
