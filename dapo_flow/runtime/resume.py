"""Which checkpoint `dapo-flow run GRAPH --resume [RUN_ID]` continues from.

Each run of a graph has its own checkpoint folder, named after its MLflow run id
(``checkpoints/{graph}-{hash10}/{run id}/step_*``). ``--resume`` continues the newest
*unfinished* run of the graph (MLflow status RUNNING, KILLED or FAILED; newest by its newest
checkpoint), never a finished one or one of another graph; ``--resume RUN_ID`` names the run,
and may train a FINISHED run further when ``--steps`` goes past its last checkpoint.

Within the chosen run, the newest checkpoint whose manifest checks out is used: a damaged one
is reported and moved aside (``damaged_step_*``, its files kept), and the resume falls back to
the one before it. Never to another run's checkpoint: that would mix two runs up.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from filelock import FileLock, Timeout

from dapo_flow.errors import RunError
from dapo_flow.runtime import checkpoint
from dapo_flow.runtime.setup import graph_hash, identity
from dapo_flow.tracking import default_tracking_uri, find_run, runs_dir

FINISHED = "FINISHED"
NEW_RUN = "run without --resume to start a new run"


def owner_lock(run_dir: Path) -> Path:
    """The lock the process training a run holds, for a run folder ``{graph}-{hash}/{run id}``:
    under dapo-flow-runs/locks/, so checkpoint folders hold only checkpoints."""
    return runs_dir() / "locks" / f"{run_dir.parent.name}.{run_dir.name}.lock"


def checkpoint_root(spec) -> Path:
    """Where a graph's checkpoints live: one folder per graph name and hash, holding one
    folder per run (its MLflow run id)."""
    return runs_dir() / "checkpoints" / f"{spec.name}-{graph_hash(spec)[:10]}"


@dataclass(frozen=True)
class RunCheckpoints:
    """A run of the graph that has checkpoints, and its MLflow status (None: not in the store)."""

    run_id: str
    steps: tuple[Path, ...]  # complete checkpoints, oldest first
    status: str | None

    @property
    def last_step(self) -> int:
        return checkpoint.step_of(self.steps[-1])

    @property
    def written_at(self) -> float:
        return max(checkpoint.written_at(p) for p in self.steps)

    def describe(self) -> str:
        return f"{self.run_id} (step {self.last_step}, {self.status or 'not in the MLflow store'})"


def resume_point(spec, resume: bool | str, total: int, warn: Callable[[str], None]) -> Path:
    """The checkpoint a resume starts from: ``resume`` is True (the newest unfinished run) or
    a run id; ``total`` the step count this run trains to. Damaged checkpoints on the way are
    reported through ``warn`` and moved aside. Raises RunError when there is nothing to resume."""
    root = checkpoint_root(spec)
    uri = spec.tracking.uri or default_tracking_uri()
    found = _graph_runs(root, uri)
    if isinstance(resume, str):
        run = _named_run(spec, root, found, resume.strip(), total, uri)
    else:
        run = _newest_unfinished(spec, root, found)
    try:
        checkpoint.adopt_legacy(root, run.run_id)  # its next checkpoints go to its run folder
    except OSError as exc:
        raise RunError(f"cannot resume run {run.run_id}: moving its checkpoints of the older layout "
                       f"into {root / run.run_id} failed ({exc.strerror or exc})\n    fix: make {root} "
                       "writable, then resume again") from None
    return _newest_intact(spec, root, run, warn)


def _graph_runs(root: Path, uri: str) -> dict[str, RunCheckpoints]:
    runs = {}
    for run_id, steps in checkpoint.runs(root).items():
        record = find_run(uri, run_id)
        runs[run_id] = RunCheckpoints(run_id, tuple(steps), record["status"] if record else None)
    return runs


def _newest_unfinished(spec, root: Path, found: dict[str, RunCheckpoints]) -> RunCheckpoints:
    if not found:
        raise RunError(_nothing_to_resume(spec, root))
    open_runs = [r for r in found.values() if r.status not in (None, FINISHED)]
    if open_runs:
        return max(open_runs, key=lambda r: r.written_at)
    listed = "".join(f"\n      {r.describe()}" for r in sorted(found.values(), key=lambda r: r.written_at))
    raise RunError(
        f"nothing to resume: no unfinished run of graph '{spec.name}' has a checkpoint under {root}; "
        f"its runs:{listed}\n    fix: {NEW_RUN}, or `--resume RUN_ID --steps N` to train one of "
        "them further (N past its last step)")


def _named_run(spec, root: Path, found: dict[str, RunCheckpoints], run_id: str, total: int,
               uri: str) -> RunCheckpoints:
    run = found.get(run_id)
    if run is None:
        raise RunError(_not_a_run_of_the_graph(spec, root, run_id, found, uri))
    if run.status is None:
        raise RunError(
            f"cannot resume run {run_id}: its checkpoints are under {root / run_id}, but the MLflow "
            f"store {uri} has no such run (another tracking uri, or a new mlflow.db?)\n    fix: "
            f"resume with the store it was logged to (MLFLOW_TRACKING_URI / tracking.uri), or {NEW_RUN}")
    if run.status == FINISHED and run.last_step >= total:
        raise RunError(
            f"nothing to resume: run {run_id} of graph '{spec.name}' FINISHED at step {run.last_step}, "
            f"and this run trains to step {total}\n    fix: pass --steps N (N > {run.last_step}) to "
            f"train it further, or {NEW_RUN}")
    return run


def _not_a_run_of_the_graph(spec, root: Path, run_id: str, found: dict[str, RunCheckpoints],
                            uri: str) -> str:
    """Why ``run_id`` has no checkpoint of this graph: another graph's (or this one before an
    edit), a run without checkpoints, or no run at all."""
    head = f"nothing to resume: run {run_id} has no checkpoint of graph '{spec.name}' (hash {graph_hash(spec)[:10]})"
    resumable = [r.describe() for r in found.values()]
    these = (f"\n    runs of this graph with checkpoints: {', '.join(resumable)}" if resumable
             else f"\n    this graph has no checkpoint under {root}")
    for other in sorted(root.parent.glob("*-*")) if root.parent.is_dir() else []:
        steps = checkpoint.runs(other).get(run_id) if other != root else None
        if not steps:
            continue
        newest = steps[-1]
        if other.name.rsplit("-", 1)[0] == spec.name:
            return head + _changed_since(spec, newest) + these
        graph = (_recorded_graph(newest) or {}).get("name", other.name)
        return (f"{head}: it is a run of graph '{graph}' (checkpoints under {other / run_id})\n    fix: "
                f"resume it with that graph (`dapo-flow run GRAPH --resume {run_id}`), or {NEW_RUN}{these}")
    record = find_run(uri, run_id)
    if record is not None:
        return (f"{head}: that MLflow run has no checkpoint (run.checkpoint_every: 0, or it stopped "
                f"before its first checkpoint; status {record['status']})\n    fix: {NEW_RUN}{these}")
    return f"{head}: the MLflow store {uri} has no run {run_id}\n    fix: check the id (`dapo-flow ui`), or {NEW_RUN}{these}"


def _newest_intact(spec, root: Path, run: RunCheckpoints, warn: Callable[[str], None]) -> Path:
    """The run's newest checkpoint that verifies; damaged ones are reported and moved aside."""
    path, damaged = checkpoint.newest_intact(checkpoint.runs(root).get(run.run_id, []))
    for bad, problem in damaged:
        try:
            moved = f"moved aside to {checkpoint.move_aside(bad).name}"
        except OSError as exc:  # a read-only folder: the resume can still read the older ones
            moved = f"left in place ({exc.strerror or exc})"
        warn(f"checkpoint {bad} is damaged ({problem}); {moved}, falling back to the checkpoint "
             "before it")
    if path is not None:
        return path
    listed = "".join(f"\n      {bad}: {problem}" for bad, problem in damaged)
    raise RunError(
        f"cannot resume run {run.run_id} of graph '{spec.name}': every checkpoint under "
        f"{root / run.run_id} is damaged:{listed}\n    fix: {NEW_RUN} (the damaged files are kept, "
        "for a look)")


def _nothing_to_resume(spec, ckpt_root: Path) -> str:
    """Why --resume found no checkpoint; if the same graph name has checkpoints under another
    hash, what changed since the newest of them (checkpoints record their graph)."""
    head = f"nothing to resume: no checkpoint of graph '{spec.name}' (hash {graph_hash(spec)[:10]}) under {ckpt_root}"
    others = [last for d in ckpt_root.parent.glob(f"{spec.name}-*")
              if d != ckpt_root and (last := _newest(d)) is not None]
    if not others:
        return f"{head}; {NEW_RUN}"
    return head + _changed_since(spec, max(others, key=checkpoint.written_at))


def _newest(graph_root: Path) -> Path | None:
    found = checkpoint.all_checkpoints(graph_root)
    return found[-1] if found else None


def _changed_since(spec, newest: Path) -> str:
    """What changed in the graph since checkpoint ``newest`` of the same graph name, and the fix."""
    from dapo_flow.graph.diff import diff_graphs

    old_graph = _recorded_graph(newest)
    if old_graph is None:
        return (f"\n    graph '{spec.name}' was changed since its checkpoint {newest}\n    fix: undo "
                "the change (or pass the same --set edits) to resume it, or run without --resume")
    changes = diff_graphs(identity(old_graph), identity(spec.model_dump(mode="json")))
    if not changes:  # same graph, other hash: written by a dapo-flow that hashed graphs differently
        return (f"\n    the same graph has a checkpoint under another hash: {newest} (written by "
                "another dapo-flow version?)\n    fix: resume with that version, or run without --resume")
    listed = "".join(f"\n      {c.render()}" for c in changes[:12])
    more = f"\n      ... and {len(changes) - 12} more" if len(changes) > 12 else ""
    return (f"\n    graph '{spec.name}' changed since its checkpoint {newest}:{listed}{more}\n"
            "    fix: undo these changes (or pass the same --set edits) to resume that run, or run "
            "without --resume to start a new one")


def _recorded_graph(path: Path) -> dict | None:
    """The graph a checkpoint recorded (None: older checkpoints did not, or it is unreadable)."""
    try:
        return checkpoint.load_driver(path).graph
    except (OSError, ValueError):
        return None


def claim(run_dir: Path) -> FileLock:
    """Hold ``run_dir`` for this process while it trains that run: a second process resuming
    the same run at once would interleave checkpoints and metrics of the two. An OS file lock,
    so a killed process releases it; the caller releases it when the run ends."""
    path = owner_lock(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise RunError(f"run {run_dir.name} is being trained by another dapo-flow process right now "
                       f"(it holds {path})\n    fix: wait for it to end (or stop it), "
                       "or resume another run with --resume RUN_ID") from None
    return lock
