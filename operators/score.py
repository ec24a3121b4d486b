"""score: verify each response against its ground truth and emit score / acc columns.

Reward functions: ``builtin:addition``, ``builtin:math`` (boxed / final answer, DAPO's
+1 / -1), or user code ``module:fn`` / ``file.py:fn`` taking
``(response_text, ground_truth, extra_info)`` and returning a float or a dict with
``score`` (and optionally ``acc`` plus the declared ``extra_columns``).
``acc`` is 1.0 when the answer is correct, taken before any overlong penalty.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from dapo_flow import columns as C
from dapo_flow.arrow_utils import with_columns
from dapo_flow.contract import OpContext


class Params(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    reward: str = Field("builtin:addition", min_length=1)
    """`builtin:addition`, `builtin:math`, `module:fn` or `file.py:fn`."""
    correct: float = Field(1.0, ge=-1e6, le=1e6)
    """Score of a correct answer (built-in verifiers; DAPO uses +1)."""
    wrong: float = Field(-1.0, ge=-1e6, le=1e6)
    """Score of a wrong answer (built-in verifiers; DAPO uses -1, use 0 for 1/0 rewards)."""
    extra_columns: tuple[str, ...] = Field(())
    """Extra float columns a user function returns in its dict (declared for schema checks)."""


def _resolve(params: Params) -> Callable[..., Any]:
    from dapo_flow import tasks
    from dapo_flow.imports import load_object

    builtins = {"builtin:addition": tasks.verify_addition, "builtin:math": tasks.verify_math}
    if params.reward in builtins:
        verify = builtins[params.reward]
        return lambda text, truth, _extra: verify(
            text, truth, correct=params.correct, wrong=params.wrong
        )
    return load_object(params.reward)


class Score:
    """Adds score, acc (and declared extras) to every rollout row."""

    Params = Params
    REQUIRES = C.typed(C.RESPONSE_TEXT, C.GROUND_TRUTH)
    CARDINALITY = "map"
    NEEDS_MODEL = False

    @classmethod
    def produces(cls, params: Params) -> dict[str, pa.DataType]:
        return {**C.typed(C.SCORE, C.ACC), **{name: pa.float32() for name in params.extra_columns}}

    def __init__(self, params: Params, ctx: OpContext):
        self.params = params
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
            result = self.fn(text, truth, {})
            if isinstance(result, dict):
                score[i] = float(result["score"])
                acc[i] = float(result.get("acc", score[i] > 0))
                for name in extras:
                    extras[name][i] = float(result.get(name, 0.0))
            else:
                score[i] = float(result)
                acc[i] = float(score[i] == self.params.correct if self.builtin else score[i] > 0)
        self._metrics = {"score/mean": float(score.mean()), "acc/mean": float(acc.mean())}
        return with_columns(batch, {C.SCORE: score, C.ACC: acc, **extras})

    def last_metrics(self) -> dict[str, float]:
        return dict(self._metrics)
