"""User-facing errors. The CLI prints any DapoFlowError and exits 2, never a traceback."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass


def did_you_mean(word: str, options: Iterable[str]) -> str:
    """The fix for an unknown name: the close matches among ``options``, else all of them."""
    options = sorted(set(options))
    close = difflib.get_close_matches(word, options, n=3, cutoff=0.6)
    if close:
        return "did you mean " + " or ".join(f"'{c}'" for c in close) + "?"
    return "expected one of: " + ", ".join(options)


class DapoFlowError(Exception):
    """Base: a user-facing error; the CLI prints it and exits 2."""


def broken_dependency(package: str, exc: ImportError, needed_by: str = "") -> DapoFlowError:
    """The error for a required dependency that does not import: a broken install, fixed by
    reinstalling (never a silent fallback). ``needed_by``: what needs it, e.g. "builtin:math"."""
    who = f"{needed_by} needs {package}" if needed_by else package
    return DapoFlowError(f"{who}, a dependency of dapo-flow, does not import ({exc}): reinstall dapo-flow "
                         "(`pip install -e .` in its checkout)")


@dataclass(frozen=True, order=True)
class Problem:
    """One problem found in a graph, located as precisely as we can."""

    file: str
    line: int
    node: str  # node id, or "" for graph-level fields
    field: str  # dotted field path, e.g. "params.clip_high"
    message: str
    hint: str = ""
    code: str = ""  # what kind of problem, as Pydantic's error `type` ("missing-column", "extra_forbidden", ...)
    column: str = ""  # the Arrow column it is about, when it is about one

    def render(self) -> str:
        where = f"{self.file}:{self.line}" if self.line else self.file
        who = f" node '{self.node}'" if self.node else ""
        what = f" {self.field}:" if self.field else ""
        fix = f"\n    fix: {self.hint}" if self.hint else ""
        return f"{where}:{who}{what} {self.message}{fix}"


class GraphError(DapoFlowError):
    """The graph is invalid; carries every problem found, sorted by location."""

    def __init__(self, problems: list[Problem]):
        self.problems = sorted(problems)
        n = len(self.problems)
        head = f"{n} problem{'s' if n != 1 else ''} in the graph:"
        super().__init__("\n".join([head, *("  " + p.render() for p in self.problems)]))


class SchemaError(GraphError):
    """An operator's input columns are missing upstream or have the wrong Arrow type."""


class UnknownOperatorError(GraphError):
    """A node names an op that is not in the registry."""


class OperatorContractError(DapoFlowError):
    """A custom operator class does not satisfy the operator contract."""


class ModelError(DapoFlowError):
    """A model path/builtin cannot be resolved or loaded."""


class DataError(DapoFlowError):
    """A prompt data source is missing or has bad rows."""


class RunError(DapoFlowError):
    """The run cannot go on (cap reached with policy 'error', dead actor, timeout...)."""


class ActorFault(RunError):
    """An actor died or stopped answering: a fault a run on Ray recovers from by itself
    (``run.max_failures``, :mod:`dapo_flow.runtime.recovery`). The session that saw it sets
    ``run_id`` (its MLflow run) and ``step`` (the step it was training) on the way out."""

    def __init__(self, message: str, *, hung: bool = False):
        super().__init__(message)
        self.hung = hung
        self.run_id: str | None = None
        self.step: int | None = None


class ReplicaLost(ActorFault):
    """Members of a stage's rollout replicas died during a generation call while others are
    left: the run heals in place (:mod:`dapo_flow.runtime.replicas`): ``call`` is the call's
    handle (the executor's), ``ranks`` the members of it that were lost. Not healed, it is the
    fault a whole run recovers from, as any ActorFault."""

    def __init__(self, message: str, *, call, ranks: list[int]):
        super().__init__(message)
        self.call = call
        self.ranks = ranks


class CheckpointWriteError(RunError):
    """A checkpoint could not be written (a full disk, a read-only or vanished folder); the
    previous one is intact. ``path``: the checkpoint it was writing; ``why``: the cause;
    ``fix``: what to do. A run goes on past a few of them in a row (run.max_failures) and tries
    again at the next checkpoint (:mod:`dapo_flow.runtime.session`)."""

    def __init__(self, message: str, *, path, why: str, fix: str):
        super().__init__(message)
        self.path = path
        self.why = why
        self.fix = fix
