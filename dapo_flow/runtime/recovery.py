"""Runs on Ray that heal themselves: an actor that dies or hangs (:class:`~dapo_flow.errors.
ActorFault`) ends the session, which stops what is left of the run's actors (and a cluster it
started); the run then starts them again and resumes from its last intact checkpoint, as
``dapo-flow run --resume RUN_ID`` would, without a person.

Every step reaches MLflow exactly once (a resume's guarantee: metrics are written with the
checkpoint that holds them). The step that failed logs, once trained, ``faults/count`` (faults
recovered from so far), ``faults/seconds_lost`` (from the fault until the run was back at that
step: stopping, restarting, redoing the steps after the checkpoint) and ``faults/steps_redone``.

The run stops with the fault's error when it has recovered ``run.max_failures`` times already,
when the same step fails twice in a row (a deterministic crash: a bad row, an out-of-memory),
or before its first checkpoint (nothing to resume: the error says so). A restart that loses an
actor again before any step (a node that died is not yet known dead to Ray, so an actor went
there) is tried again within the same limit. A local run, in one process, stops at once.

One of several rollout replicas lost in a generation call of a sync run is not such a fault: the
run heals it in place and goes on (:mod:`dapo_flow.runtime.replicas`); the step logs
``faults/*`` alike (:func:`healed_in_place`), with no step redone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from dapo_flow.errors import ActorFault


@dataclass
class Recovered:
    """The fault a session recovers from: ``step`` the step that failed (None: before the first
    step), ``at`` when (time.monotonic()), ``count`` faults recovered from in the run so far;
    ``resumed_at`` the checkpoint's step, set by the session."""

    step: int | None
    at: float
    count: int
    resumed_at: int = 0
    logged: bool = field(default=False, repr=False)

    def metrics(self, step: int) -> dict[str, float]:
        """faults/* for the step about to train: at the step that failed (or the session's
        first, for a fault before any step), once."""
        target = self.step if self.step is not None and self.step > self.resumed_at else self.resumed_at + 1
        if self.logged or step != target:
            return {}
        self.logged = True
        return {"faults/count": float(self.count), "faults/seconds_lost": time.monotonic() - self.at,
                "faults/steps_redone": float(max(0, step - 1 - self.resumed_at))}


def healed_in_place(seconds: list[float], count: int, recovered: dict[str, float]) -> dict[str, float]:
    """faults/* for a step that lost rollout replicas and healed them in place: ``seconds`` what
    each cost (its share generated again), ``count`` the faults of the run so far, these included;
    merged with a recovery's at the same step (``recovered``: :meth:`Recovered.metrics`)."""
    if not seconds:
        return recovered
    return {"faults/count": float(count),
            "faults/seconds_lost": sum(seconds) + recovered.get("faults/seconds_lost", 0.0),
            "faults/steps_redone": recovered.get("faults/steps_redone", 0.0)}


def heal(session: Callable[..., dict], *, max_failures: int, resume: bool | str, say: Callable[[str], None],
         has_checkpoint: Callable[[str], bool], **kwargs) -> dict:
    """``session(resume=..., recovery=..., **kwargs)`` (:func:`~dapo_flow.runtime.session.
    run_session`) until it finishes, resuming it after each :class:`ActorFault` within the
    limits in the module docstring; ``say`` prints what happens; ``has_checkpoint(run_id)``:
    whether the run has one to resume from."""
    recovery: Recovered | None = None
    while True:
        try:
            return session(resume=resume, recovery=recovery, **kwargs)
        except ActorFault as fault:
            count = recovery.count if recovery is not None else 0
            why = _why_not(fault, count, max_failures, recovery, has_checkpoint)
            if why:
                if max_failures:
                    say(f"fault at step {fault.step}; not recovering: {why}")
                raise
            at = time.monotonic()
            say(f"fault at step {fault.step}: {fault}\n  recovering ({count + 1} of at most {max_failures}): "
                f"restarting the actors and resuming run {fault.run_id} from its last checkpoint")
            if recovery is not None and fault.step is None:  # the restart itself lost an actor: the
                # same recovery, tried again (the step it redoes and the time lost count from the first)
                recovery = Recovered(step=recovery.step, at=recovery.at, count=count + 1)
            else:
                recovery = Recovered(step=fault.step, at=at, count=count + 1)
            resume = fault.run_id


def _why_not(fault: ActorFault, count: int, max_failures: int, last: Recovered | None,
             has_checkpoint: Callable[[str], bool]) -> str:
    """Why the run stops at ``fault`` instead of recovering ('' when it recovers)."""
    if count >= max_failures:
        return f"run.max_failures ({max_failures}) faults recovered from already"
    if fault.run_id is None or not has_checkpoint(fault.run_id):
        return "the run has no checkpoint yet to resume from"
    if last is not None and fault.step is not None and fault.step == last.step:
        return f"step {fault.step} failed twice in a row (a crash that repeats is not a lost worker)"
    return ""
