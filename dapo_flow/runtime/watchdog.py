"""How long an actor call may take before its actor counts as hung: the bound comes from the
run's own step times, so a hang is found in minutes on a model whose steps take seconds, and
not mistaken for one on a model whose steps take many minutes.

Until a step has finished (models load, kernels warm up, the first batch is the slowest), a call
waits ``DAPO_FLOW_CALL_TIMEOUT`` (900 s). Afterwards: ``STEP_MULTIPLE`` times the slowest step so
far, at least ``FLOOR_S``, at most ``DAPO_FLOW_CALL_TIMEOUT``, all well under the 30 minutes a
collective waits (gloo's and NCCL's default timeout). ``run.hang_timeout_s`` fixes the bound."""

from __future__ import annotations

import os

DEFAULT_CALL_TIMEOUT_S = 900.0
FLOOR_S = 120.0
STEP_MULTIPLE = 10.0


def call_timeout() -> float:
    """Seconds to wait for one actor call at most: $DAPO_FLOW_CALL_TIMEOUT, read at call time."""
    return float(os.environ.get("DAPO_FLOW_CALL_TIMEOUT", DEFAULT_CALL_TIMEOUT_S))


class StepWatchdog:
    """The hang bound of a run's calls. ``fixed``: run.hang_timeout_s (None: from step times)."""

    def __init__(self, fixed: float | None = None):
        self.fixed = fixed
        self.slowest: float | None = None

    def observe(self, step_seconds: float) -> None:
        """A step finished in ``step_seconds``."""
        self.slowest = step_seconds if self.slowest is None else max(self.slowest, step_seconds)

    def bound(self) -> float:
        """Seconds a call may take now before its actor counts as hung."""
        ceiling = call_timeout()
        if self.fixed is not None:
            return min(self.fixed, ceiling)
        if self.slowest is None:
            return ceiling
        return min(max(FLOOR_S, STEP_MULTIPLE * self.slowest), ceiling)
