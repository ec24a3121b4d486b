"""The RL loop, top to bottom in named phases:

rollout until the group filter has enough groups -> train segment (old/ref logprobs ->
advantages -> update) -> weight sync -> log -> validate -> checkpoint; under
``run.rollout_mode: one_step_off`` the next step's rollout runs beside the train segment
(:class:`Ahead`), under ``async`` in a producer thread of its own (runtime.async_rollout).

Variants are nodes of the graph, never `if` branches here: the loop only knows the
plan's segments (rollout, train), its group filter and its weight syncs.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import pyarrow as pa
import pyarrow.compute as pc

from dapo_flow.core import columns as C
from dapo_flow.errors import ReplicaLost, RunError
from dapo_flow.graph.plan import IN_ACTOR, Call, DynamicSampling, Sync
from dapo_flow.reductions import Max, Min, Seconds
from dapo_flow.runtime.weight_sync import WeightSyncs
from dapo_flow.runtime.metrics import TOKENS_AT_VERSION, MetricAccumulator
from dapo_flow.runtime.tables import ChainInfo, cut, parts_of
from dapo_flow.runtime.validation import ValidationTally
from dapo_flow.runtime.sampler import PromptSampler
from dapo_flow.graph.spec import PROMPTS_SOURCE

@dataclass(frozen=True)
class Kept:
    """Groups kept by dynamic sampling: their table's handle (where it was made) and their
    prompt ids in order, which is all the driver needs to decide with."""

    table: Any
    groups: tuple[str, ...]
    version: int = 0  # the weights' version its generation calls were queued under (Runner.rollout_version)


@dataclass
class Queued:
    """A generation batch's first calls, queued under the weights' ``version``: their handles."""

    version: int
    handles: list


@dataclass
class Prefetched:
    """The next step's generation batch (``prompts``), its first ``part`` queued already."""

    prompts: pa.Table
    part: pa.Table
    queued: Queued


@dataclass
class LoopState:
    step: int = 0  # completed steps
    carry: Kept | None = None  # kept groups beyond prompts_per_step (carry_surplus)
    samples_generated: int = 0
    wall_seconds: float = 0.0
    keep_rate: float | None = None  # gen_prompts_per_batch auto: EMA of kept groups per prompt
    skipped_in_a_row: int = 0  # steps in a row that trained nothing (the group filter kept too little)
    policy_version: int = 0  # updates made so far: the version of the trained weights


@dataclass
class Rollout:
    batch: Any  # the batch's handle (a prompts table without a group filter); None: skip this step
    metrics: dict[str, float] = field(default_factory=dict)
    policy_version: int = 0  # the oldest weights' version its generation batches were queued under


@dataclass
class QueuedUpdate:
    """A train segment queued on the trainer (:meth:`Runner.submit_update`), not read back yet."""

    rollout: Rollout
    calls: list  # (Call, handle, inputs) of each call queued
    version: int  # the policy version it trains (the weights it starts from)
    submitted_at: float


@dataclass
class QueuedSync:
    """The weight syncs to one policy version, queued (:meth:`Runner.submit_sync`)."""

    handles: list  # each sync's (WeightSyncs.seconds reads a transfer's and an in-actor sync's alike)
    version: int
    live: bool  # into a generation in flight (run.partial_rollouts)
    waited: float  # seconds it waited to queue: for a batch's generate calls to be queued


class Ahead:
    """The next step's rollout phase, run by a thread of the driver while this step trains
    (``run.rollout_mode: one_step_off``). It starts as this step's update is queued (before it
    runs), so it generates with the weights from before it; the caller waits for
    it (:meth:`result`) before the weight sync that follows the update, so no batch mixes two
    versions and a run is as deterministic as a synchronous one. Only this thread touches the
    rollout side of ``state`` (sampler position, carry, keep rate) until :meth:`result` returns.
    ``behind(rollout)``, called in the thread once the batch is complete, queues what follows
    it (:meth:`Runner._queue_behind`); its result is :attr:`queued`."""

    def __init__(self, runner: "Runner", state: LoopState, behind: Callable[[Rollout], Any] | None = None):
        self.started_at = time.perf_counter()
        self.finished_at = 0.0
        self.queued: Any = None
        self._rollout: Rollout | None = None
        self._error: BaseException | None = None
        # a daemon: a run stopped by Ctrl-C or an error does not wait for its generation
        self._thread = threading.Thread(target=self._collect, args=(runner, state, behind), daemon=True,
                                        name="dapo-flow-rollout-ahead")
        self._thread.start()

    def _collect(self, runner: "Runner", state: LoopState, behind: Callable[[Rollout], Any] | None) -> None:
        try:
            self._rollout = runner.collect(state)
            self.finished_at = time.perf_counter()
            if behind is not None:
                self.queued = behind(self._rollout)
        except BaseException as exc:  # noqa: BLE001 - raised again in the driver's thread
            self._error = exc
        finally:
            self.finished_at = self.finished_at or time.perf_counter()

    @property
    def seconds(self) -> float:
        """How long the rollout phase took (once :meth:`result` has returned)."""
        return self.finished_at - self.started_at

    def result(self) -> Rollout:
        """The rollout, once collected; the rollout phase's error, raised here."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._rollout is not None
        return self._rollout


@dataclass
class Output:
    """A call's output: its table's handle and what the call reported (None for a feed)."""

    table: Any
    info: ChainInfo | None = None


@dataclass
class Traffic:
    """Bytes of tables per step: ``driver``, those materialized in the driver (prompts it
    sampled, tables it fetched: validation results, a checkpoint's carry);
    ``made``, those every call produced, which a driver that relays every table would hold;
    ``largest``, the largest table a call produced (about the trained batch)."""

    driver: int = 0
    made: int = 0
    largest: int = 0
    # one_step_off collects in a thread beside the training calls (Ahead)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add_output(self, nbytes: int) -> None:
        with self.lock:
            self.made += nbytes
            self.largest = max(self.largest, nbytes)

    def add_driver(self, nbytes: int) -> None:
        with self.lock:
            self.driver += nbytes

    def take(self) -> dict[str, float]:
        with self.lock:
            out = {"perf/driver_bytes": float(self.driver), "perf/stage_output_bytes": float(self.made),
                   "perf/largest_table_bytes": float(self.largest)}
            self.driver = self.made = self.largest = 0
        return out


class Runner:
    """Executes a placed plan exactly: per phase its calls, in order, each in its stage (an
    executor's worker: under Ray the driver stage too is an actor), then its weight syncs.
    Tables stay where a stage made them and pass on by handle; the driver reads only call
    reports (metrics, sinks' included; row counts, prompt groups) and validation results.
    ``call_log`` records every call and sync made, as (phase, stage, node ids) and
    ("sync", source, target, kind)."""

    def __init__(self, placed, executor, sampler: PromptSampler | None, *,
                 say: Callable[[str], None] = print, rollout_version: int = 0):
        self.placed = placed
        self.plan = placed.plan
        self.run = self.plan.spec.run
        self.ex = executor
        self.sampler = sampler
        self.nodes = {n.id: n for n in self.plan.nodes}
        self.stage_of = dict(placed.node_stage)
        self.chunk = self.run.chunk_prompts
        self.stops_early = placed.generates_in_parts  # run.gen_stop_early, where it applies
        self.prefetched: Prefetched | None = None  # the next generation batch, its first part queued (prefetch)
        if self.stops_early:  # a first part gives each engine of the generating stage its share of 4+ prompts
            self.part_floor = PART_PROMPTS_PER_ENGINE * placed.stage(placed.calls["rollout"][0].stage).workers
        self.call_log: list[tuple[str, str, tuple[str, ...]]] = []
        self.syncs = WeightSyncs(placed, executor)
        self.traffic = Traffic()
        # the version of the weights the rollout actors hold for calls queued now; a weight sync
        # and a generation batch never overlap in queueing (one_step_off and async collect in a
        # thread of their own), so each batch knows the version it was generated with
        self.rollout_version = rollout_version
        self.rollout_lock = threading.Lock()
        self.queued: QueuedUpdate | None = None  # the next step's update, queued on the trainer already
        self.trainer_free_at = 0.0  # when the driver saw the last weight sync done (the trainer's last call)
        self.say = say  # what the run tells its user (the session's console)
        self.healed: list[float] = []  # seconds each call that lost rollout replicas lost, since take_healed()
        self.healed_count = 0  # rollout replicas lost and healed in place by this runner

    @property
    def senders_train_alone(self) -> bool:
        """Whether every weight sync's sender is one worker (no group): while it waits for
        rollout actors busy generating (in the weight bus's store, as long as it takes), no peer
        of its own waits for it in a collective (bounded by fsdp.COLLECTIVE_TIMEOUT_S)."""
        return all(self.placed.stage(sync.source).workers == 1 for sync in self.placed.syncs)

    # --- call execution --------------------------------------------------------
    def _submit(self, phase: str, call: Call, inputs: list):
        self.call_log.append((phase, call.stage, call.nodes))
        return self.ex.rows(call.stage, "run_chain", list(call.nodes), inputs)

    def _finish(self, handle, acc: MetricAccumulator) -> Output:
        info = self.ex.get(handle.info)
        for nid, metrics, seconds in info.report:
            acc.add(metrics)
            acc.add({f"time/{nid}": Seconds(seconds)})
        self.traffic.add_output(info.bytes_out)
        return Output(handle.table, info)

    def fetch(self, table) -> pa.Table:
        """A table read into the driver (counted in ``perf/driver_bytes``)."""
        out = self.ex.fetch(table)
        self.traffic.add_driver(out.nbytes)
        return out

    def sample(self, n: int) -> pa.Table:
        prompts = self.sampler.next(n)
        self.traffic.add_driver(prompts.nbytes)
        return prompts

    def run_calls(self, phase: str, feeds: dict[str, Any], acc: MetricAccumulator,
                  first_done: Any = None) -> dict[str, Output]:
        """Run the phase's calls; returns each call's output under its last node's id (inner
        nodes of a call are not returned). ``feeds``: node id -> table handle. ``first_done``:
        the first call's handle, already submitted (streaming)."""
        return self.finish_calls(self.submit_calls(phase, feeds, first_done), acc)

    def submit_calls(self, phase: str, feeds: dict[str, Any], first_done: Any = None) -> list[tuple[Call, Any, list]]:
        """Queue every call of the phase at once, each reading the handles of the calls before
        it: under Ray a call waits in its actor for its inputs, not for the driver to see its
        predecessor finish. Each entry: (call, its handle, its input handles)."""
        tables = dict(feeds)
        submitted = []
        for k, call in enumerate(self.placed.calls[phase]):
            inputs = [tables[i] for i in self.nodes[call.nodes[0]].inputs]
            handle = first_done if k == 0 and first_done is not None else self._submit(phase, call, inputs)
            tables[call.nodes[-1]] = handle.table
            submitted.append((call, handle, inputs))
        return submitted

    def finish_calls(self, submitted: list[tuple[Call, Any, list]], acc: MetricAccumulator) -> dict[str, Output]:
        """Each queued call's output, read in order (the first failure raised). A generation
        call that lost a rollout replica has its lost share run again (:meth:`_finish_healing`)."""
        submitted, stale = list(submitted), []
        outs = {submitted[k][0].nodes[-1]: self._finish_healing(submitted, k, acc, stale)
                for k in range(len(submitted))}
        for handle in stale:  # failed by now: each was queued before its second try, on the same actors
            self.ex.discard(handle)
        return outs

    def _finish_healing(self, submitted: list[tuple[Call, Any, list]], k: int, acc: MetricAccumulator,
                        stale: list) -> Output:
        """:meth:`_finish` of call ``k``; where it lost rollout replicas (ReplicaLost), their
        share re-issued to the others (:mod:`dapo_flow.runtime.replicas`) and the calls after it
        that read its output queued again on the re-issued rows (their first try fails as it
        reads the lost share, before any operator runs: nothing runs twice). ``submitted`` is
        updated with the calls queued again; ``stale`` gets the first tries, for the executor to
        discard. (Only an executor whose replicas heal in place raises ReplicaLost and has
        ``reissue`` and ``discard``.)"""
        seen = None
        while True:
            call, handle, inputs = submitted[k]
            try:
                out = self._finish(handle, acc)
            except ReplicaLost as lost:
                if lost.call is not handle.info:
                    raise  # another call's loss: its own finish heals it
                seen = seen or time.monotonic()
                redone, said = self.ex.reissue(handle, lost)
                for line in said:  # a line per replica newly lost: one fault each
                    self.say(line)
                self.healed_count += len(said)
                submitted[k] = (call, redone, inputs)
                stale.extend(self._requeue_readers(submitted, k))
                continue
            if seen is not None:
                self.healed.append(time.monotonic() - seen)
            return out

    def _requeue_readers(self, submitted: list[tuple[Call, Any, list]], k: int) -> list:
        """Queue again every call after ``k`` that reads call ``k``'s output (or one queued
        again), on the new handles; the handles they replace. Not in ``call_log``: the plan's
        calls are the same."""
        changed = {submitted[k][0].nodes[-1]: submitted[k][1].table}
        replaced = []
        for j in range(k + 1, len(submitted)):
            call, old, inputs = submitted[j]
            names = self.nodes[call.nodes[0]].inputs
            if not any(n in changed for n in names):
                continue
            inputs = [changed.get(n, h) for n, h in zip(names, inputs)]
            handle = self.ex.rows(call.stage, "run_chain", list(call.nodes), inputs)
            submitted[j] = (call, handle, inputs)
            changed[call.nodes[-1]] = handle.table
            replaced.append(old)
        return replaced

    def take_healed(self) -> list[float]:
        """The seconds each call that lost rollout replicas lost since the last take (from the
        driver seeing the loss until the lost share was generated again)."""
        out, self.healed = self.healed, []
        return out

    # --- phase 1: rollout with dynamic sampling ---------------------------------
    def rollout_batch(self, prompts: pa.Table, acc: MetricAccumulator, queued: "Queued | None" = None) -> Kept:
        """One generation batch through the rollout phase, streamed in chunks: every chunk's
        first call (generation, in its actor) is queued at once (or was: ``queued``, by
        :meth:`prefetch`), and each finished chunk flows on to scoring / shaping / filtering
        while later chunks still generate."""
        head = self.placed.calls["rollout"][0]
        chunks = self._chunks(prompts)
        stream = self.nodes[head.nodes[0]].inputs == (PROMPTS_SOURCE,)
        # A weight sync and the queueing of a batch's generation never interleave, so the batch
        # knows its weights' version: the sync's calls go to the rollout actors after its
        # generate calls (an actor runs calls in turn) and wait for them, not for the scoring and
        # filtering after. Where the first call is not queued at once (it reads another node's
        # output) the sync waits for the whole batch.
        with contextlib.ExitStack() as held:
            if queued is None:
                held.enter_context(self.rollout_lock)
                version = self.rollout_version
                handles = [self._submit("rollout", head, [c]) for c in chunks] if stream else [None] * len(chunks)
                if stream:
                    held.close()  # the generate calls are queued: a sync may follow them now
            else:
                version, handles = queued.version, queued.handles
            tables, groups = [], []
            for chunk, handle in zip(chunks, handles):
                out = self.run_calls("rollout", {PROMPTS_SOURCE: chunk}, acc, first_done=handle)[self.plan.group_filter]
                tables.append(out.table)
                groups.extend(out.info.groups or ())
        return Kept(parts_of(tables), tuple(groups), version)

    def _chunks(self, prompts: pa.Table) -> list[pa.Table]:
        size = self.chunk or prompts.num_rows
        return [prompts.slice(i, size) for i in range(0, prompts.num_rows, size)]

    def can_prefetch(self) -> bool:
        """Whether :meth:`prefetch` applies: the plan allows it (``prefetches_generation``) and
        the executor queues calls."""
        return self.ex.queues_calls and self.placed.prefetches_generation

    def prefetch(self, state: LoopState, version: int) -> None:
        """Queue the next step's first generation call(s) now, behind the update just queued on
        the same actors (:meth:`can_prefetch`): an actor runs its calls in order, so it samples
        with the updated weights (``version``), as it would have queued once the driver saw the
        update done, but the actors go from the update to the generation without waiting for
        the driver. The next :meth:`collect` starts from it (the same prompts, part and seeds)."""
        need = self.run.prompts_per_step
        size = (auto_batch_size(need, state.keep_rate, need) if self.run.gen_prompts_per_batch == "auto"
                else self.run.gen_prompts_per_batch or need)
        prompts = self.sample(size)
        part = self._first_part(prompts, need, state)
        head = self.placed.calls["rollout"][0]
        with self.rollout_lock:
            self.rollout_version = version  # no weight sync: the update's own weights
            handles = [self._submit("rollout", head, [c]) for c in self._chunks(part)]
        self.prefetched = Prefetched(prompts, part, Queued(version, handles))

    def _batch_in_parts(self, prompts: pa.Table, pre: "Prefetched | None", remaining: int, state: LoopState,
                        acc: MetricAccumulator) -> tuple[list[Kept], int]:
        """One generation batch through the rollout phase: whole, or under gen_stop_early a first
        part sized from the keep rate (queued already: ``pre``) and, only where its kept groups
        fall short of the ``remaining`` ones, all the rest (no generate call on a few prompts,
        whose prefill rounds differently: a batch of one prompt does). What each part kept, and
        the prompts generated."""
        first = pre.part if pre is not None else self._first_part(prompts, remaining, state)
        parts = [self.rollout_batch(first, acc, pre.queued if pre is not None else None)]
        done = first.num_rows
        if done < prompts.num_rows and _n_groups(parts) < remaining:
            rest = C.batch_part(prompts.slice(done), continues=True, prompt_width=longest_prompt(prompts))
            parts.append(self.rollout_batch(rest, acc))
            done = prompts.num_rows
        return parts, done

    def _first_part(self, prompts: pa.Table, remaining: int, state: LoopState) -> pa.Table:
        """The first part of a generation batch to generate (all of it unless gen_stop_early)."""
        if not self.stops_early:
            return prompts
        take = part_size(prompts.num_rows, remaining, state.keep_rate, self.part_floor)
        return C.batch_part(prompts.slice(0, take), continues=False, prompt_width=longest_prompt(prompts))

    def collect(self, state: LoopState) -> Rollout:
        """The next training batch: generation batches through the rollout phase until the
        group filter has kept ``prompts_per_step`` groups (or its cap says otherwise). Its
        ``policy_version``: the oldest weights any of its groups was generated with."""
        acc = MetricAccumulator()
        need = self.run.prompts_per_step
        ds = self.plan.dynamic_sampling
        if ds is None:  # no group filter: the train segment generates
            generated = need * self.plan.group_size
            state.samples_generated += generated
            return Rollout(self.sample(need), {"sampling/samples_generated": float(generated)},
                           self.rollout_version)
        auto = self.run.gen_prompts_per_batch == "auto"
        kept = [state.carry] if state.carry is not None else []
        state.carry = None
        groups, batches, generated, ungenerated, empty_in_a_row = _n_groups(kept), 0, 0, 0, 0
        while groups < need:
            if ds.max_gen_batches and batches >= ds.max_gen_batches:
                if ds.on_cap == "error":
                    raise RunError(_capped(ds, groups, need, batches))
                if ds.on_cap == "skip-step" or groups == 0:
                    state.samples_generated += generated  # generated, though none is trained on
                    self._count_skipped(state, ds, groups, batches)
                    return Rollout(None, {**acc.result(), "sampling/gen_batches": batches,
                                          "sampling/samples_generated": float(generated),
                                          "sampling/capped": 1.0, "sampling/skipped": 1.0},
                                   self.rollout_version)
                break
            pre, self.prefetched = self.prefetched, None
            if pre is None:
                size = (auto_batch_size(need - groups, state.keep_rate, need) if auto
                        else self.run.gen_prompts_per_batch or need)
                prompts = self.sample(size)
            else:  # drawn and its first part queued by the last step (prefetch)
                prompts = pre.prompts
            parts, done = self._batch_in_parts(prompts, pre, need - groups, state, acc)
            kept += parts
            # group ids never repeat across generation batches (the sampler suffixes the epoch)
            got = _n_groups(parts)
            groups += got
            generated += done * self.plan.group_size
            ungenerated += prompts.num_rows - done
            batches += 1
            if auto or self.stops_early:
                state.keep_rate = _ema(state.keep_rate, got / max(done, 1))
            empty_in_a_row = 0 if got else empty_in_a_row + 1
            limit = ds.max_skipped_steps
            if not ds.max_gen_batches and limit and empty_in_a_row >= limit:  # else: a hang
                raise RunError(_nothing_kept(
                    ds, f"{empty_in_a_row} generation batches in a row kept no prompt group at "
                    f"group-filter '{ds.node}' (with max_gen_batches: 0 the step "
                    f"would never end; max_skipped_steps={limit})"))
        rollout = self._trained_batch(state, kept, need, groups, batches, generated, acc)
        if self.stops_early:
            rollout.metrics["sampling/prompts_ungenerated"] = float(ungenerated)
        return rollout

    def _trained_batch(self, state: LoopState, kept: list[Kept], need: int, groups: int, batches: int,
                       generated: int, acc: MetricAccumulator) -> Rollout:
        """The batch :meth:`collect` trains on: the first ``need`` of the ``groups`` groups
        ``kept`` holds (the rest carried, under run.carry_surplus), its sampling metrics, and the
        oldest weights' version among them."""
        state.skipped_in_a_row = 0
        # the first `need` whole groups in order of appearance, the rest carried (verl cuts by
        # rows and can split a group; we never do)
        order = [g for k in kept for g in k.groups]
        chosen, surplus = order[:need], order[need:]
        batch = cut([k.table for k in kept], chosen)
        oldest = min(k.version for k in kept)
        if self.run.carry_surplus and surplus:
            state.carry = Kept(cut([k.table for k in kept], surplus), tuple(surplus), oldest)
        state.samples_generated += generated
        metrics = acc.result()
        metrics.update({
            "sampling/gen_batches": float(batches),
            "sampling/kept_groups": float(len(chosen)),
            "sampling/samples_generated": float(generated),
            "sampling/generated_per_trained": float(generated / max(len(chosen) * self.plan.group_size, 1)),
            "sampling/capped": float(groups < need),
        })
        if state.keep_rate is not None:
            metrics["sampling/keep_rate"] = state.keep_rate
        return Rollout(batch, metrics, oldest)

    def _count_skipped(self, state: LoopState, ds: DynamicSampling, groups: int, batches: int) -> None:
        """One more step that trains nothing; max_skipped_steps of them in a row stop the run."""
        state.skipped_in_a_row += 1
        limit = ds.max_skipped_steps
        if limit and state.skipped_in_a_row >= limit:
            raise RunError(_nothing_kept(
                ds, f"{state.skipped_in_a_row} steps in a row were skipped: group-filter "
                f"'{ds.node}' kept too few prompt groups (the last step kept "
                f"{groups}/{self.run.prompts_per_step} after {batches} generation batches; "
                f"max_skipped_steps={limit})"))

    # --- one step: rollout, update, weight sync -------------------------------------
    def step(self, state: LoopState, ahead: Rollout | None, *, collect_next: bool, queue_next: bool = False,
             prefetch: bool = False) -> tuple[dict[str, float], Rollout | None]:
        """Train on ``ahead`` (the batch the last step collected, one_step_off) or on a batch
        collected now; with ``collect_next``, the next step's rollout phase runs beside the
        update (:class:`Ahead`) and is returned, complete, before the weight sync. Returns the
        step's metrics (but for time/step and what follows it) and the batch collected ahead.

        Where the executor queues calls (Ray), the rollout thread, once the next batch is
        complete, queues this step's weight sync behind the update in flight and, with
        ``queue_next`` (no validation, checkpoint or MLflow write between the two steps), the
        next step's update behind the sync: the trainer goes from one to the next without
        waiting for the driver to see each finish. With ``prefetch`` (a synchronous run, nothing
        slow between the two steps), the next step's first generation call is queued behind the
        update where the same actors generate (:meth:`prefetch`). What each actor runs, in what
        order, is the same."""
        start = time.perf_counter()
        rollout = ahead if ahead is not None else self.collect(state)
        collected = time.perf_counter() - start  # 0 where the last step collected it ahead
        update, self.queued = self.queued, None
        assert update is None or update.rollout is rollout, "an update queued for another batch"
        queues = self.ex.queues_calls
        if update is None and queues:  # queued at once; in-process it runs when submitted,
            update = self.submit_update(rollout, state.policy_version)  # so after the thread starts
        behind = None
        if collect_next and queues:
            behind = lambda batch: self._queue_behind(update, batch, queue_next)  # noqa: E731
        next_rollout = Ahead(self, state, behind) if collect_next else None
        if update is None:
            update = self.submit_update(rollout, state.policy_version)
        if prefetch and next_rollout is None and rollout.batch is not None and self.can_prefetch():
            self.prefetch(state, update.version + 1)
        metrics = {**rollout.metrics, **self.finish_update(state, update)}
        trained_at = time.perf_counter()
        metrics["time/rollout_phase"] = collected
        ahead, queued_sync = None, None
        if next_rollout is not None:
            ahead = next_rollout.result()  # before the sync: its batch is of one version
            queued_sync, self.queued = next_rollout.queued or (None, None)
            metrics["time/rollout_phase"] += next_rollout.seconds
            metrics["time/trainer_wait"] = max(next_rollout.finished_at - trained_at, 0.0)
            metrics["time/rollout_idle"] = max(trained_at - next_rollout.finished_at, 0.0)
        if rollout.batch is not None:
            metrics.update(self.finish_sync(queued_sync or self.submit_sync(state.policy_version)))
        return metrics, ahead

    def _queue_behind(self, update: QueuedUpdate, batch: Rollout, queue_next: bool
                      ) -> tuple[QueuedSync | None, QueuedUpdate | None]:
        """In the rollout thread, its batch complete: the weight sync after ``update`` (none
        where it trains nothing) and, with ``queue_next``, the update on ``batch``, queued."""
        trained = update.rollout.batch is not None
        sync = self.submit_sync(update.version + 1) if trained else None
        after = update.version + trained
        return sync, (self.submit_update(batch, after) if queue_next and batch.batch is not None else None)

    # --- phase 2: train segment -------------------------------------------------
    def submit_update(self, rollout: Rollout, version: int) -> QueuedUpdate:
        """Queue the train segment on ``rollout`` for the weights of policy ``version`` (those
        the trainer holds once what is queued before it has run)."""
        calls = []
        if rollout.batch is not None:
            feed = self.plan.group_filter if self.plan.group_filter is not None else PROMPTS_SOURCE
            calls = self.submit_calls(self.plan.phases[-1][0], {feed: rollout.batch})
        return QueuedUpdate(rollout, calls, version, time.perf_counter())

    def finish_update(self, state: LoopState, update: QueuedUpdate) -> dict[str, float]:
        """The queued update's metrics, once it is done (nothing for a step that trains nothing):
        the batch's staleness, what the train segment reports, and ``time/train_phase`` from when
        it could start (queued behind the last step's sync: once the driver saw that done); the
        trained weights are one version on."""
        metrics = {}
        if update.rollout.batch is not None:
            metrics["rollout/staleness"] = float(update.version - update.rollout.policy_version)
            acc = MetricAccumulator()
            self.finish_calls(update.calls, acc)
            metrics.update(acc.result())  # a sink's metrics row and batch/* come with its report (StageWorker.run)
            metrics.update(token_staleness(metrics, update.version))
            state.policy_version = update.version + 1
        metrics["time/train_phase"] = time.perf_counter() - max(update.submitted_at, self.trainer_free_at)
        return metrics

    # --- phase 3: weight sync ---------------------------------------------------
    def sync(self, version: int) -> dict[str, float]:
        """The plan's weight syncs (none where a stage generates with the policy it trains): the
        rollout actors hold ``version`` of the weights after it. It waits for the driver to queue
        the generation batch in flight, and its transfer for those generate calls on the rollout
        actors, unless ``run.partial_rollouts``: then the weights go in between two of their
        tokens, and the batch's tokens record which weights sampled them."""
        return self.finish_sync(self.submit_sync(version))

    def replacements_due(self) -> bool:
        """Whether a replacement of a lost rollout replica is up: the next weight sync admits it
        (an async run pauses its producer for that sync: :meth:`submit_sync`)."""
        return any(self.ex.replacements_due(s.target) for s in self.placed.syncs if s.kind != IN_ACTOR)

    def submit_sync(self, version: int, admit: bool = True) -> QueuedSync:
        """Queue :meth:`sync`'s calls (after the generation batch being queued, if any). With
        ``admit``, replacements of lost rollout replicas that are up join first: only where no
        generation call is queued on the replicas (an async run's producer paused)."""
        asked = time.perf_counter()
        live = self.run.partial_rollouts
        handles = []
        with contextlib.nullcontext() if live else self.rollout_lock:
            waited = time.perf_counter() - asked  # for a batch's generate calls to be queued (overlapped modes)
            for sync in self.placed.syncs:
                self.call_log.append(("sync", sync.source, (sync.target, sync.kind)))
                if sync.kind != IN_ACTOR and admit:  # replacements of lost replicas that are up take these weights
                    for line in self.ex.admit_replacements(sync.target):
                        self.say(line)
                handles.append(self.ex.call(sync.source, "sync_generators") if sync.kind == IN_ACTOR
                               else self.syncs.start(sync, version, live=live))
            if not live:  # a batch queued from now on is generated after the weights arrive
                self.rollout_version = version
        return QueuedSync(handles, version, live, waited)

    def finish_sync(self, queued: QueuedSync) -> dict[str, float]:
        """:meth:`sync`'s metrics, once its transfers are done (:meth:`_finish_transfer`)."""
        seconds = sum(self._finish_transfer(sync, h, queued) for sync, h in zip(self.placed.syncs, queued.handles))
        self.trainer_free_at = time.perf_counter()
        if queued.live:
            # set once every target holds the weights, so a batch queued after reads a version
            # its tokens are at least at (one queued before keeps the older, a lower bound)
            self.rollout_version = queued.version
        return {"time/weight_sync": seconds, "time/sync_wait": queued.waited}

    def _finish_transfer(self, sync: Sync, handle: Any, queued: QueuedSync) -> float:
        """One transfer's seconds. Where a rollout replica that heals in place died in it
        (ReplicaLost, of the transfer's receivers), its bus is given up (the others' calls end:
        models.weight_bus), the replicas dead in it leave the group (a replacement starts for
        each; the generation calls they held fail and are re-issued, :meth:`_finish_healing`),
        and the weights go again to the others on a bus formed with them."""
        seen = None
        while True:
            try:
                seconds = self.syncs.seconds(handle)
            except ReplicaLost as lost:
                if not isinstance(handle, tuple) or lost.call is not handle[-1] or not self.syncs.can_give_up(sync):
                    raise
                seen = seen or time.monotonic()
                self.syncs.abort(sync)
                dead = [(lost.call.actors[r], r) for r in lost.ranks]
                dead += [d for d in self.ex.settle(handle) if d[0] not in [a for a, _ in dead]]
                said = self.ex.lose_replicas(sync.target, dead)
                for line in said:
                    self.say(line)
                self.healed_count += len(said)
                handle = self.syncs.start(sync, queued.version, live=queued.live)
                continue
            if seen is not None:
                self.healed.append(time.monotonic() - seen)
            return seconds

    # --- phase 4: validation ------------------------------------------------------
    def validate(self, val_prompts: pa.Table | None, log_samples: int, *, n: int | None = None,
                 temperature: float | None = None) -> tuple[dict[str, float], list[dict]]:
        """avg@n accuracy (val/acc), score, response length and, for n > 1, unbiased pass@k of
        the generate node on ``val_prompts`` (n, temperature: default run.val_n / val_temperature)."""
        if val_prompts is None:
            return {}, []
        return self.validate_stream([val_prompts], log_samples, n=n, temperature=temperature)

    def validate_stream(self, batches: Iterable[pa.Table], log_samples: int, *, n: int | None = None,
                        temperature: float | None = None,
                        on_batch: Callable[[pa.Table, ValidationTally], None] | None = None
                        ) -> tuple[dict[str, float], list[dict]]:
        """:meth:`validate` over prompt batches, one batch ahead: batch i+1's generation and
        grading are queued before batch i's graded rows are read, so that under Ray the engines
        generate while the driver reads. ``on_batch(graded, tally)`` sees each graded batch."""
        gen, score = self.plan.first("generate"), self.plan.first("reward")
        if gen is None or score is None:
            return {}, []
        start = time.perf_counter()
        n = n or self.run.val_n
        temperature = self.run.val_temperature if temperature is None else temperature
        overrides = {"temperature": temperature, "n": n}
        grade = Call(self.stage_of[score.id], (score.id,))
        tally = ValidationTally(n, log_samples)

        def read(graded) -> None:
            table = self.fetch(self._finish(graded, MetricAccumulator()).table)
            tally.add(table)
            if on_batch is not None:
                on_batch(table, tally)

        pending = None
        for prompts in batches:
            self.call_log.append(("validate", self.stage_of[gen.id], (gen.id,)))
            rolled = self.ex.rows(self.stage_of[gen.id], "run_variant", gen.id, [prompts], overrides)
            queued = self._submit("validate", grade, [rolled.table])
            if pending is not None:
                read(pending)
            pending = queued
        if pending is not None:
            read(pending)
        metrics = tally.result()
        if metrics:
            metrics["time/validate"] = time.perf_counter() - start
        return metrics, tally.samples


VERSION_COUNT = "batch/" + TOKENS_AT_VERSION  # a trained batch's tokens of one policy version


def token_staleness(metrics: dict[str, float], trained_version: int) -> dict[str, float]:
    """The policy versions of the trained batch's tokens, from the per-version token counts its
    sink reported (added over a training group's workers; taken out of ``metrics``, since their
    names grow with the run): ``batch/rollout_version_min`` / ``_mean`` (the token mean), and
    how many versions the tokens lag the weights that train on them: the most, the mean, and the
    histogram ``rollout/token_staleness_frac_S``, the fraction of tokens S versions behind, for S
    from 0 to the most (bounded by max_staleness)."""
    counts = {int(key[len(VERSION_COUNT):]): metrics.pop(key) for key in list(metrics)
              if key.startswith(VERSION_COUNT)}
    tokens = sum(counts.values())
    if not tokens:
        return {}
    oldest, mean = min(counts), sum(v * c for v, c in counts.items()) / tokens
    lags = {trained_version - version: count for version, count in counts.items()}
    return {"batch/rollout_version_min": Min(oldest), "batch/rollout_version_mean": mean,
            "rollout/token_staleness_max": Max(trained_version - oldest),
            "rollout/token_staleness_mean": trained_version - mean,
            **{f"rollout/token_staleness_frac_{lag}": lags.get(lag, 0.0) / tokens for lag in range(max(lags) + 1)}}


def _capped(ds: DynamicSampling, groups: int, need: int, batches: int) -> str:
    """Why a step stops at the group filter's cap of generation batches (on_cap: error)."""
    return (f"dynamic sampling kept {groups}/{need} prompt groups after {batches} "
            f"generation batches (group-filter max_gen_batches={ds.max_gen_batches}). "
            "Fix: raise max_gen_batches or run.gen_prompts_per_batch, lower "
            "run.prompts_per_step, or set on_cap: train-on-what-we-have / skip-step")

def _nothing_kept(ds: DynamicSampling, what: str) -> str:
    """The RunError text when dynamic sampling keeps (almost) nothing, step after step."""
    return (
        f"training is doing nothing: {what}.\n"
        f"    a group is dropped when its '{ds.metric}' is the same for every sample; likely "
        "causes: greedy sampling (generate temperature 0 or top_k 1), a constant reward (a reward "
        "function that always returns the same value, or correct == wrong), a task the model "
        "always or never solves\n"
        "    fix: remove the cause and start a new run; if groups are kept, just too few, raise "
        "max_gen_batches or run.gen_prompts_per_batch (max_skipped_steps: 0 never stops the run)"
    )


KEEP_RATE_MARGIN = 1.15  # ask for 15% more groups than the keep rate predicts: one batch usually does
KEEP_RATE_FLOOR = 0.05  # a run of all-filtered batches must not ask for unbounded batches
_EMA_WEIGHT = 0.3  # weight of the newest batch in the keep-rate average


def auto_batch_size(remaining: int, keep_rate: float | None, need: int) -> int:
    """Prompts for the next generation batch under `gen_prompts_per_batch: auto`: enough to
    keep `remaining` groups at the keep rate seen so far, with a margin; `need` before any
    batch has been seen, at most 8 x `need`."""
    if keep_rate is None:
        return need
    want = math.ceil(remaining * KEEP_RATE_MARGIN / max(keep_rate, KEEP_RATE_FLOOR))
    return max(1, min(want, 8 * need))


def longest_prompt(prompts: pa.Table) -> int:
    """The longest prompt of a generation batch, in tokens."""
    lengths = pc.list_value_length(prompts.column(C.PROMPT_IDS))
    return int(pc.max(lengths).as_py() or 0)


PART_SIGMAS = 2.0  # a first part falls short (and the rest is generated) in ~2% of batches
PART_PROMPTS_PER_ENGINE = 4


def part_size(left: int, remaining: int, keep_rate: float | None, floor: int = 1) -> int:
    """Prompts for the first part of a generation batch under run.gen_stop_early, of the ``left``
    it holds: the fewest (at least ``floor``) whose kept groups, at ``keep_rate`` (kept groups per
    prompt so far), reach ``remaining`` but in about 2% of batches (binomial mean minus
    PART_SIGMAS standard deviations, the rate taken at most 0.98); all of them before any rate
    is known."""
    if keep_rate is None or keep_rate <= 0:
        return left
    p = min(keep_rate, 0.98)
    for size in range(max(remaining, floor, 1), left):
        if size * p - PART_SIGMAS * math.sqrt(size * p * (1 - p)) >= remaining:
            return size
    return left


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - _EMA_WEIGHT) * old + _EMA_WEIGHT * new


def _n_groups(kept: list[Kept]) -> int:
    return sum(len(k.groups) for k in kept)


ProgressFn = Callable[[int, dict[str, float]], None]
