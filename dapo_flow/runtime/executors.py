"""Executors: where stage workers live. `local` keeps them in this process (debugging,
fast tests); `ray` makes each actor stage a long-lived Ray actor for the whole run.

Each satisfies :class:`Executor`: built with ``(graph, setups, seed, resources, address=None)``,
it has a ``name``, ``read_parquet`` and ``stream_parquet`` (callables, or None: the driver reads),
`call(stage, method, *args) -> handle`, `call_each(stage, method, per_member)` (a call on each of a
stage's workers), `rows(...)` (a row call whose table stays where it is made), `fetch(table)`,
`get(handle)` and `shutdown()`. A local handle is the finished value; a
Ray handle is an ObjectRef, so the driver can queue work on an actor and keep going (streaming). :data:`EXECUTORS` is the
registry `--executor` chooses from: adding one is a class plus one line there.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator, Mapping, Protocol, runtime_checkable

import pyarrow as pa

from dapo_flow.errors import ActorFault, ReplicaLost, RunError
from dapo_flow.runtime import group
from dapo_flow.core.ports import free_port
from dapo_flow.runtime.node import node_address
from dapo_flow.runtime.replicas import HEALS_IN_PLACE, ReplicaHealer, RowCall
from dapo_flow.runtime.tables import TableParts, assemble, table_from_ipc, table_to_ipc
from dapo_flow.runtime.watchdog import StepWatchdog, call_timeout
from dapo_flow.core.contract import contract_of
from dapo_flow.runtime.worker import LIVE_METHODS, GroupMember, Share, StageSetup, StageWorker, resolve_op
from dapo_flow.graph.plan import DRIVER, Cluster
from dapo_flow.graph.spec import GraphSpec

RESUME_HINT = "`dapo-flow run GRAPH --resume` continues from the last checkpoint"
STARTUP_TIMEOUT_S = 900.0  # actors load models (and may wait for resources) before the first call
#: when one call of a group (or of a weight sync's sides) fails, how long the others get to show
#: whether their actor died: a peer killed mid-collective reaches the survivors first, as their
#: own error (gloo's "Connection reset by peer"), before Ray reports the dead actor
PEER_DEATH_GRACE_S = 5.0


@runtime_checkable
class Executor(Protocol):
    """Hosts the actor stages of a run: ``__init__(graph, setups, seed, resources, address=None)``
    builds every stage's :class:`StageWorker` (``resources``: stage -> (cpus, gpus), per worker
    for a training group: a setup with ``sharded`` set, ``workers`` of them, each joining the
    group as its :class:`GroupMember`)."""

    name: str
    #: whether a call returns before it runs, to run in turn after the calls queued on its
    #: worker before it (Ray's actors); False where it runs when made (in-process)
    queues_calls: bool
    #: reads a list of parquet files (or one file) into one table on the executor's side;
    #: None: the driver reads them with pyarrow
    read_parquet: Callable[[Any], pa.Table] | None
    #: ``stream_parquet(files, tokenize)``: tokenized batches of a streamed source, read and
    #: tokenized on the executor's side; None: the driver reads and tokenizes them in turn
    stream_parquet: Callable[[list, Callable], Iterator[pa.Table]] | None
    #: whether its workers are processes of their own (actors), so that a trained model's
    #: weights can reach its rollout actors over a weight bus (a collective); False: every
    #: worker lives in this process, and a weight transfer is a call
    forms_weight_buses: bool
    #: stage -> the node each worker of a multi-worker stage runs on, by rank (what a run says
    #: at start); empty where every worker lives in this process
    group_nodes: Mapping[str, list[str]]

    def call(self, stage: str, method: str, *args: Any) -> Any:
        """Start ``StageWorker.method(*args)`` on ``stage``; a handle for :meth:`get`."""

    def members(self, stage: str) -> int:
        """How many workers serve ``stage`` (a group's workers or replicas; else 1)."""

    def call_each(self, stage: str, method: str, per_member: list[tuple]) -> Any:
        """Start ``method`` on each worker of ``stage`` with its own arguments (rank order); a
        handle whose result is the list of theirs (a weight bus's rendezvous)."""

    def rows(self, stage: str, method: str, *args: Any) -> "Rows":
        """Start a row call (``run_chain`` or ``run_variant``) whose output table stays where
        it is made: its handle passes on to the next call, and :meth:`fetch` reads it."""

    def fetch(self, table: Any) -> pa.Table:
        """The table behind a handle, here in the driver."""

    def get(self, handle: Any) -> Any:
        """The result of a call (raises its error; a RunError when an actor died or hung); of a
        tuple of calls, the tuple of their results, the first failure raised when it happens."""

    def observe_step(self, seconds: float) -> None:
        """A step took ``seconds``: where calls can hang (actors), the hang bound follows
        (:mod:`dapo_flow.runtime.watchdog`)."""

    def roster(self, stage: str) -> int:
        """A number that changes whenever the actors serving ``stage`` change (rollout replicas
        healed in place: :mod:`dapo_flow.runtime.replicas`)."""

    def replacements_due(self, stage: str) -> bool:
        """Whether replacements of lost replicas of ``stage`` are up (or given up): an admission is due."""

    def admit_replacements(self, stage: str) -> list[str]:
        """Let replacement replicas of ``stage`` that are up join it; what happened, a line each."""

    def shutdown(self) -> None:
        """Release every worker (and a cluster the executor started)."""


class LocalExecutor:
    name = "local"
    queues_calls = False
    forms_weight_buses = False  # one process: a weight transfer is a call
    read_parquet = None  # prompts are read with pyarrow in-process
    stream_parquet = None  # and streamed prompts read and tokenized in-process

    def __init__(self, graph: GraphSpec, setups: Mapping[str, StageSetup], seed: int,
                 resources: Mapping[str, tuple[float, float]] | None = None, address: str | None = None):
        # a DDP group is replicas of a model that fits one worker, making the update one worker
        # makes (to float rounding): here it is that one worker; an FSDP2 group is refused
        # below, since its model may need the shards
        setups = {name: replace(s, workers=1, strategy="none") if s.strategy == "ddp" else s
                  for name, s in setups.items()}
        for name, s in setups.items():
            if s.workers > 1:
                what, knob = (("a training group of", "train.workers") if s.grouped
                              else ("rolled out by", "rollout.replicas"))
                raise RunError(f"stage '{name}' is {what} {s.workers} workers, one process each, and "
                               "the local executor runs everything in this process"
                               f"\n    fix: --executor ray, or set the model's {knob}: 1")
        self.workers = {}
        self.group_nodes: dict[str, list[str]] = {}  # no stage spans processes here
        # one call at a time per stage, as an actor takes them: one_step_off's rollout thread
        # and the training calls may both use a stage (the driver stage's operators)
        self.locks = {name: threading.RLock() for name in setups}
        try:
            for name, s in setups.items():  # a group of one: an FSDP2 shard of world size 1
                member = GroupMember(0, 1, "127.0.0.1", free_port()) if s.grouped else None
                self.workers[name] = StageWorker(graph, replace(s, group=member), seed)
        except BaseException:
            self.shutdown()
            raise

    def call(self, stage: str, method: str, *args: Any) -> Any:
        if method in LIVE_METHODS:  # beside the stage's call in flight, as an actor's concurrency group
            return getattr(self.workers[stage], method)(*args)
        with self.locks[stage]:
            return getattr(self.workers[stage], method)(*args)

    def members(self, stage: str) -> int:
        return 1  # a stage is one in-process worker

    def call_each(self, stage: str, method: str, per_member: list[tuple]) -> list:
        if len(per_member) != 1:
            raise ValueError(f"{len(per_member)} argument lists for the one worker of {stage}")
        return [self.call(stage, method, *per_member[0])]

    def rows(self, stage: str, method: str, *args: Any) -> "Rows":
        out = self.call(stage, method, *args)
        return Rows(*out) if method == "run_chain" else Rows(out, None)

    def fetch(self, table: Any) -> pa.Table:
        return assemble(table, list)

    def get(self, handle: Any) -> Any:
        return handle

    def observe_step(self, seconds: float) -> None:
        pass  # calls run in this process: nothing to wait for

    def roster(self, stage: str) -> int:
        return 0  # in-process workers are never lost and replaced

    def replacements_due(self, stage: str) -> bool:
        return False

    def admit_replacements(self, stage: str) -> list[str]:
        return []

    def shutdown(self) -> None:
        for name, worker in self.workers.items():
            with self.locks[name]:  # after a call a rollout thread may be making (one_step_off)
                worker.close()  # a vLLM engine holds its KV cache until closed
        self.workers.clear()


#: The niceness of the driver that started the cluster, which its Ray workers inherit in their
#: environment: the job's own priority (0 unless the user ran it under `nice`).
DRIVER_NICENESS = "DAPO_FLOW_DRIVER_NICENESS"


def job_niceness() -> int:
    """The job's priority: the niceness of the driver that started the cluster, else 0."""
    return int(os.environ.get(DRIVER_NICENESS, "0"))


def normal_priority() -> int:
    """Bring this process back to the job's priority (:func:`job_niceness`) when it runs nicer
    (Ray starts workers at nice 15), as far as the OS lets it (raising priority needs
    CAP_SYS_NICE). Returns the niceness it ends with."""
    target = job_niceness()
    if os.getpriority(os.PRIO_PROCESS, 0) > target:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, target)
        except OSError:
            pass
    return os.getpriority(os.PRIO_PROCESS, 0)


def _forwarding_to_stage_worker(cls: type) -> type:
    """Give an actor class every public method of :class:`StageWorker`, each calling its
    ``worker``'s (Ray calls an actor's methods by name, so they must be on its class)."""
    def forward(name: str):
        def method(self, *args, **kwargs):
            return getattr(self.worker, name)(*args, **kwargs)
        method.__name__ = name
        method.__doc__ = getattr(StageWorker, name).__doc__
        return method

    for name, member in vars(StageWorker).items():
        if callable(member) and not name.startswith("_") and name not in vars(cls):
            setattr(cls, name, forward(name))
    return cls


def _stage_worker_in_actor(graph: GraphSpec, setup: StageSetup, seed: int) -> StageWorker:
    """The stage worker of a Ray actor: at the job's priority (:func:`normal_priority`), its
    tables fetched from the object store (on this node: read in place, not copied)."""
    nice = normal_priority()
    if nice > job_niceness():
        import warnings

        warnings.warn(
            f"this Ray worker runs at nice {nice} and cannot lower it: beside other busy "
            "processes it gets a fraction of a core. Start the cluster with "
            "RAY_worker_niceness=0 (e.g. `RAY_worker_niceness=0 ray start --head`)", stacklevel=3)
    tables_as_ipc()
    return StageWorker(graph, setup, seed, fetch=_fetch_from_object_store)


def tables_as_ipc() -> None:
    """In this process, tables go into Ray's object store as one Arrow IPC stream each, an
    out-of-band buffer that the reader's columns point into (:func:`~dapo_flow.runtime.tables.table_from_ipc`,
    named in each object: a process that did not call this reads them too). Ray's own reducer
    pickles each column's buffers, in Python: for a generation batch of the main job (384 rows)
    a put took 1.9 ms against 1.3 and a read 0.39 ms against 0.18, on every hop of a step."""
    import ray

    ray.util.register_serializer(pa.Table, serializer=_ipc_out_of_band, deserializer=table_from_ipc)


def _ipc_out_of_band(table: pa.Table) -> pickle.PickleBuffer:
    return pickle.PickleBuffer(table_to_ipc(table))


def _fetch_from_object_store(parts: list) -> list[pa.Table]:
    import ray

    return resolve_refs(parts, ray.get)


@_forwarding_to_stage_worker
class ActorStageWorker:
    """A StageWorker as a Ray actor: at normal priority, since it does the run's work. A nice-15
    actor beside one busy nice-0 process got ~3% of a core (a step 25-50x slower)."""

    def __init__(self, graph: GraphSpec, setup: StageSetup, seed: int):
        self.worker = _stage_worker_in_actor(graph, setup, seed)

    def niceness(self) -> int:
        return os.getpriority(os.PRIO_PROCESS, 0)


@_forwarding_to_stage_worker
class LiveRolloutStageWorker:
    """A rollout actor of a run with ``run.partial_rollouts``: its weight loads
    (:data:`~dapo_flow.runtime.worker.LIVE_METHODS`) run in a concurrency group of their own
    (:data:`LIVE_GROUP`), so they reach the engine while a generate call is in flight. Every
    other actor runs one call at a time on its main thread (threaded actors only where needed)."""

    __init__ = ActorStageWorker.__init__  # the same functions, not a subclass
    niceness = ActorStageWorker.niceness


LIVE_GROUP = "weights"  # LiveRolloutStageWorker's concurrency group for its weight loads


def _live_actor_class(ray) -> Any:
    """:class:`LiveRolloutStageWorker` as a Ray actor class, its live methods in :data:`LIVE_GROUP`."""
    for name in LIVE_METHODS:
        ray.method(concurrency_group=LIVE_GROUP)(getattr(LiveRolloutStageWorker, name))
    return ray.remote(concurrency_groups={LIVE_GROUP: 1})(LiveRolloutStageWorker)


def resolve_refs(parts: list, get: Callable[[list], list]) -> list:
    """``parts`` with every ObjectRef replaced by its value (``get`` fetches them at once); a
    part that is already a table (a resumed carry, a resolved top-level argument) as it is."""
    import ray

    refs = [i for i, p in enumerate(parts) if isinstance(p, ray.ObjectRef)]
    out = list(parts)
    for i, value in zip(refs, get([parts[i] for i in refs]) if refs else []):
        out[i] = value
    return out


@_forwarding_to_stage_worker
class DriverStageWorker:
    """The driver stage's model-free operators (score, shaping, filters, advantages) in an
    actor of their own, so the tables they read and write stay in the object store. A class of
    its own so that it shows as such in `ps` and `ray list actors`.

    It asks Ray for no CPU: the placement gives the driver stage its share of the driver's
    node, and with the tables gone from the driver process this actor is what uses it. Asking
    Ray for it would put it beside a worker on some node (on two 1-CPU nodes, a driver stage's
    0.67 and a worker's 0.67 do not fit one node, and the group waited for a node forever). It
    runs on the driver's node where it can."""

    __init__ = ActorStageWorker.__init__  # the same functions, not a subclass
    niceness = ActorStageWorker.niceness


def connect_ray(address: str | None) -> bool:
    """Join the Ray cluster at ``address`` (or $RAY_ADDRESS), else start one in-process, unless
    Ray is already up; returns whether this call started it (then its caller shuts it down)."""
    import ray

    if ray.is_initialized():
        return False
    # token auth (default in Ray 2.60) is pointless for an embedded local cluster
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Ray starts its workers at nice 15 (to keep its own daemons responsive). Our
    # actors ARE the job: at nice 15 beside any nice-0 process (another job, a busy
    # loop) an actor gets ~3% of a core (benchmarks/actor_priority.py: 44.9x slower).
    # The raylet reads this when it starts, so it only applies to a cluster we start.
    os.environ.setdefault("RAY_worker_niceness", "0")
    os.environ[DRIVER_NICENESS] = str(os.getpriority(os.PRIO_PROCESS, 0))  # workers inherit it
    # a cluster of our own unless one is named: Ray would otherwise join the one recorded in
    # /tmp/ray/ray_current_cluster, which outlives a killed cluster and made a run wait ~12
    # minutes for a head that was gone
    address = address or os.environ.get("RAY_ADDRESS") or "local"
    check_head_answers(address)
    ray.init(
        address=address,
        include_dashboard=False,
        log_to_driver=True,
        logging_level="ERROR",
        configure_logging=True,
    )
    return True


#: How long a named Ray head has to accept a connection: ray.init retries an address nothing
#: listens on for minutes, printing GCS timeouts, before it gives up.
HEAD_CONNECT_TIMEOUT_S = 10.0


def check_head_answers(address: str) -> None:
    """RunError unless something accepts a TCP connection at ``address`` ("HOST:PORT", the Ray
    head's GCS); "local", "auto" and "ray://" (Ray Client) addresses are left to Ray."""
    import socket

    host, sep, port = address.rpartition(":")
    if address in ("local", "auto") or "://" in address or not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=HEAD_CONNECT_TIMEOUT_S).close()
    except (OSError, OverflowError) as exc:  # OverflowError: a port past 65535
        raise RunError(f"no Ray head answers at {address!r} ({getattr(exc, 'strerror', None) or exc})\n    fix: start it "
                       "(`ray start --head` on its head node) and pass the address `ray start` printed, "
                       "e.g. --address HEAD_IP:6379; or run without --address (and $RAY_ADDRESS) for a "
                       "Ray of this machine") from None


def joined_cluster(address: str) -> Cluster:
    """Join the Ray cluster at ``address`` (as the run's executor then finds it joined:
    :func:`connect_ray`) and return what it has free now, to place a graph on it rather than on
    this machine."""
    import ray

    try:
        connect_ray(address)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise RunError(f"could not join the Ray cluster at {address!r}: {_root_cause(exc)}\n    fix: start it "
                       "(`ray start --head` on its head node) and pass the address `ray start` printed, "
                       "e.g. --address HEAD_IP:6379; or run without --address (and $RAY_ADDRESS) for a "
                       "Ray of this machine") from None
    return cluster_of(ray.available_resources(), ray.nodes())


def cluster_of(available: Mapping[str, float], nodes: list[Mapping[str, Any]]) -> Cluster:
    """The :class:`Cluster` a graph is placed on, from a Ray cluster's reports: the CPUs and GPUs
    free now (``ray.available_resources()``) over its live nodes (``ray.nodes()``). Ray does not
    report a GPU's memory, so it is unknown (the fit check needs it: `explain --gpu-mem-gib`)."""
    alive = sum(1 for n in nodes if n.get("Alive"))
    return Cluster(cpus=float(available.get("CPU", 0.0)), gpus=float(available.get("GPU", 0.0)),
                   nodes=max(alive, 1))


class RayExecutor:
    name = "ray"
    queues_calls = True
    forms_weight_buses = True  # actors: a model's trainer and rollout actors join a bus

    def __init__(self, graph: GraphSpec, setups: Mapping[str, StageSetup], seed: int,
                 resources: Mapping[str, tuple[float, float]], address: str | None = None):
        import ray

        self._ray = ray
        self.watchdog = StepWatchdog(graph.run.hang_timeout_s)
        self.owns_cluster = connect_ray(address)
        tables_as_ipc()
        remote_cls = ray.remote(ActorStageWorker)
        driver_cls = ray.remote(DriverStageWorker)
        live_cls = _live_actor_class(ray) if graph.run.partial_rollouts else None
        self.actors = {}
        self.groups: dict[str, WorkerGroup] = {}
        self.placement_groups = []
        self.group_nodes: dict[str, list[str]] = {}  # group stage -> Ray node id of each worker, by rank
        try:
            for name, setup in setups.items():
                cpus, gpus = resources.get(name, (1.0, 0.0))
                # a rollout actor that takes weights mid-generation (never a trainer: validate)
                actor_cls = live_cls if live_cls is not None and setup.generates and not setup.trainable else remote_cls
                if setup.grouped or setup.workers > 1:
                    self.groups[name] = self._start_group(actor_cls, graph, name, setup, seed, cpus, gpus)
                elif name == DRIVER:  # see DriverStageWorker: the driver's CPU share, not Ray's
                    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

                    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
                    self.actors[name] = driver_cls.options(num_cpus=0, max_restarts=0, scheduling_strategy=here
                                                           ).remote(graph, setup, seed)
                else:
                    self.actors[name] = actor_cls.options(
                        num_cpus=cpus, num_gpus=gpus, name=None, max_restarts=0
                    ).remote(graph, setup, seed)
            # surface load errors (bad model path...) now, with the actor's message; a short
            # call timeout (a test's, a fast model's) must not cut model loading short
            startup = max(call_timeout(), STARTUP_TIMEOUT_S)
            self.get([a.ready.remote() for a in self.actors.values()], timeout=startup)
            for name in self.groups:
                self.get(self.call(name, "ready"), timeout=startup)
        except BaseException:
            self.shutdown()  # else the actors and the cluster outlive a failed start in-process
            raise

    def _start_group(self, remote_cls, graph: GraphSpec, stage: str, setup: StageSetup, seed: int,
                     cpus: float, gpus: float) -> "WorkerGroup":
        """A training group: one placement group with a bundle per worker (PACK or SPREAD), an
        actor in each, and the torch.distributed group they form (rank 0's node and a free
        port there as its master address). Rollout replicas: the same without the process group
        (each engine on its own)."""
        ray = self._ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
        pg = placement_group([dict(bundle) for _ in range(setup.workers)], strategy=setup.placement_strategy)
        self.placement_groups.append(pg)
        if not pg.wait(timeout_seconds=int(max(call_timeout(), 1))):
            raise RunError(
                f"the training group of stage '{stage}' ({setup.workers} workers of {cpus:g} CPUs and "
                f"{gpus:g} GPUs each, {setup.placement_strategy}) could not be placed on the Ray "
                f"cluster (it has {_cluster_resources(ray)})\n    fix: lower the model's "
                "train.workers or placement.models resources, or add nodes; `dapo-flow explain "
                "GRAPH --cpus N --gpus N --nodes N` checks a placement before a run")

        from ray.util import placement_group_table

        on_nodes = placement_group_table(pg).get("bundles_to_node_id", {})
        self.group_nodes[stage] = [str(on_nodes.get(rank, "?")) for rank in range(setup.workers)]

        def on(rank: int) -> PlacementGroupSchedulingStrategy:
            return PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank)

        if setup.grouped:
            addr, port = ray.get(ray.remote(node_address).options(num_cpus=0, scheduling_strategy=on(0)).remote(),
                                 timeout=STARTUP_TIMEOUT_S)

        def start(rank: int) -> Any:  # a member in bundle ``rank`` (a lost replica's replacement too)
            member = GroupMember(rank, setup.workers, addr, port) if setup.grouped else None
            return remote_cls.options(num_cpus=cpus, num_gpus=gpus, max_restarts=0, scheduling_strategy=on(rank)
                                      ).remote(graph, replace(setup, group=member), seed)

        members = [start(rank) for rank in range(setup.workers)]
        sinks = {n.id for n in setup.nodes if contract_of(resolve_op(n)).cardinality == "sink"}
        if setup.grouped:
            return WorkerGroup(stage, members, sinks, "worker")
        healer = ReplicaHealer(ray, stage, members, list(range(setup.workers)), start) if (
            graph.run.rollout_mode in HEALS_IN_PLACE) else None
        return WorkerGroup(stage, members, sinks, "replica", healer)

    def call(self, stage: str, method: str, *args: Any) -> Any:
        if method in ROW_CALLS:  # the whole result, as a local worker gives it (tests, tools)
            return self.rows(stage, method, *args)
        # a group's broadcast call passed on (a weight transfer from a training group): its rank
        # 0's result, by reference
        args = tuple(a.refs[0] if isinstance(a, GroupCall) else a for a in args)
        group = self.groups.get(stage)
        if group is not None:
            return group.call(method, *args)
        return getattr(self.actors[stage], method).remote(*args)

    def members(self, stage: str) -> int:
        """How many actors serve ``stage`` (a group's workers or replicas; else 1)."""
        group = self.groups.get(stage)
        return len(group.members) if group is not None else 1

    def call_each(self, stage: str, method: str, per_member: list[tuple], members: list | None = None) -> GroupCall:
        """``method`` on each actor of ``stage`` (or each of ``members``, some of them) with its
        own arguments (rank order); the handle's result is the list of theirs."""
        group = self.groups.get(stage)
        actors = members if members is not None else group.members if group is not None else [self.actors[stage]]
        if len(per_member) != len(actors):
            raise ValueError(f"{len(per_member)} argument lists for the {len(actors)} actor(s) of {stage}")
        refs = [getattr(a, method).remote(*args) for a, args in zip(actors, per_member)]
        if group is not None:
            return GroupCall(stage, refs, member=group.member, kind=group.kind, join=list,
                             actors=list(actors) if group.healer is not None else None)
        return GroupCall(stage, refs, member="actor", kind="stage", join=list)

    def rows(self, stage: str, method: str, *args: Any) -> "Rows":
        """A row call: the output table stays in the object store (a reference, or the
        references of a group's shares in order); only the ChainInfo is for :meth:`get`."""
        head, inputs, *rest = args
        inputs = self._by_reference(inputs)
        group = self.groups.get(stage)
        if group is not None:
            return group.rows(method, head, inputs, *rest)
        fn = getattr(self.actors[stage], method)
        if method == "run_chain":
            return Rows(*fn.options(num_returns=2).remote(head, inputs, *rest))
        return Rows(fn.remote(head, inputs, *rest), None)

    def _by_reference(self, inputs: Any) -> Any:
        """Tables the driver holds (prompts) put in the object store once, however many
        workers read them; handles pass as they are."""
        put = lambda h: self._ray.put(h) if isinstance(h, pa.Table) else h  # noqa: E731
        return [put(h) for h in inputs] if isinstance(inputs, list) else put(inputs)

    def fetch(self, table: Any) -> pa.Table:
        return assemble(table, lambda parts: resolve_refs(parts, self.get))

    def read_parquet(self, files) -> pa.Table:
        """Prompts read by Ray tasks, one per file (a folder's shards in parallel), joined in
        name order so Ray and local runs see the same prompts. The tasks ask for no CPU: the
        run's actors hold the cluster's, and Ray Data's readers, which want a whole free CPU
        for their planning tasks, waited forever beside them (Ray 2.60, reproduced with 0.67
        of 2 CPUs free)."""
        paths = [str(f) for f in files] if isinstance(files, list) else [str(files)]
        read = self._ray.remote(num_cpus=0)(_read_parquet_file)
        return pa.concat_tables(self.get([read.remote(p) for p in paths]))

    def stream_parquet(self, files: list, tokenize: Callable[[pa.Table], pa.Table]) -> Iterator[pa.Table]:
        """Tokenized batches of parquet ``files``, made ahead of the consumer by one streaming
        generator task per file (read a batch, template and tokenize it, yield it), a few
        batches in flight at most, the next file's task started while this one drains. Zero-CPU
        tasks, as :meth:`read_parquet`'s."""
        from dapo_flow.data.stream import tokenized_batches

        task = self._ray.remote(num_cpus=0, num_returns="streaming",
                                _generator_backpressure_num_objects=STREAM_IN_FLIGHT)(tokenized_batches)
        pending = [task.remote(str(files[0]), tokenize)]
        for k in range(len(files)):
            if k + 1 < len(files):
                pending.append(task.remote(str(files[k + 1]), tokenize))
            for ref in pending.pop(0):  # a bad row's DataError comes as itself (_get)
                yield self._get(ref, call_timeout(), who="a task streaming prompts")

    def get(self, handle: Any, timeout: float | None = None) -> Any:
        timeout = self.watchdog.bound() if timeout is None else timeout
        if isinstance(handle, Rows):
            table = self.fetch(handle.table)
            return table if handle.info is None else (table, self.get(handle.info, timeout))
        if isinstance(handle, (GroupCall, tuple)):
            return self._get_all(handle, timeout)
        return self._get(handle, timeout)

    def _get_all(self, handles: "GroupCall | tuple", timeout: float) -> Any:
        """A group's result, or a tuple of handles' (each a reference or a GroupCall: both sides
        of a weight sync), taken as each call finishes: the first that fails, or whose actor
        died, is named at once; the others may be waiting for it in a collective, which would
        end only at its timeout."""
        ray = self._ray
        calls = handles if isinstance(handles, tuple) else (handles,)
        owner = {}  # reference -> (the call it belongs to, the worker's rank in a group or None)
        for call in calls:
            for rank, ref in (enumerate(call.refs) if isinstance(call, GroupCall) else [(None, call)]):
                owner[ref] = (call, rank)
        deadline = time.monotonic() + timeout
        values: dict[Any, Any] = {}
        pending = list(owner)
        lost: list[int] = []  # members of a generation call on replicas that heal in place, dead
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                late = self._late([owner[r] for r in pending])
                raise ActorFault(f"{late} did not answer within {timeout:g} s (hung collective or weight sync? "
                                 "a worker on an unreachable node?); raise DAPO_FLOW_CALL_TIMEOUT (or set "
                                 f"run.hang_timeout_s) if the model is just slow. {RESUME_HINT}", hung=True)
            for ref in ready:
                try:
                    values[ref] = self._get(ref, timeout, who=self._member(*owner[ref]))
                except RunError as failure:
                    call, rank = owner[ref]
                    if getattr(call, "row_call", None) is not None and _died(ray, failure):
                        lost.append(rank)  # the others' shares are still awaited: they may be lost too
                        continue
                    if getattr(call, "actors", None) is not None and _died(ray, failure):
                        # a replica that heals in place died in a weight sync: its peers wait for
                        # it in the bus until the caller gives the bus up (Runner.finish_sync)
                        raise ReplicaLost(f"{self._member(call, rank)} died during a weight sync",
                                          call=call, ranks=[rank]) from failure
                    if not isinstance(failure.__cause__, ray.exceptions.RayTaskError):
                        raise  # the actor died (named), or did not answer
                    dead = self._dead_peer(pending, owner)
                    if dead is not None:
                        raise dead from failure
                    raise
        if lost:
            call = calls[0]  # a row call is waited for alone
            raise ReplicaLost(f"{self._late([(call, r) for r in sorted(lost)])} died during a generation call",
                              call=call, ranks=sorted(lost))
        out = tuple(call.join([values[r] for r in call.refs]) if isinstance(call, GroupCall) else values[call]
                    for call in calls)
        return out if isinstance(handles, tuple) else out[0]

    def reissue(self, rows: "Rows", lost: ReplicaLost) -> tuple["Rows", list[str]]:
        """``rows`` (a generation call on rollout replicas) with the shares of the members
        ``lost`` names run again on survivors (:meth:`ReplicaHealer.reissue`): the same rows, the
        same samples; and what happened, a line for each replica newly lost. ActorFault when
        no replica is left."""
        call: GroupCall = lost.call
        group = self.groups[call.stage]
        record, redone, said = group.healer.reissue(call.row_call, lost.ranks)
        tables, infos = list(rows.table.parts), list(call.refs)
        self.discard(Rows(TableParts(tuple(tables[r] for r in redone)), None))
        for rank, (table, info) in redone.items():
            tables[rank], infos[rank] = table, info
        return Rows(TableParts(tuple(tables)), group.infos(infos, record=record)), said

    def discard(self, rows: "Rows") -> None:
        """Read the results of a row call that failed, or will, because it read a lost
        replica's share (it was queued again), so that Ray does not report their errors as
        unhandled; whatever they hold is dropped."""
        refs = [*_refs_in(rows.table), *(_refs_in(rows.info.refs if isinstance(rows.info, GroupCall) else rows.info))]
        for ref in refs:
            try:
                self._ray.get(ref, timeout=DISCARD_WAIT_S)
            except Exception:  # noqa: BLE001 - the errors are the point: it read a lost share
                pass

    def roster(self, stage: str) -> int:
        """A number that changes whenever the actors serving ``stage`` do (a replica lost or
        replaced): a weight bus formed with them before is stale."""
        group = self.groups.get(stage)
        return group.healer.roster if group is not None and group.healer is not None else 0

    def group_actors(self, stage: str) -> tuple[int, list]:
        """The roster of ``stage``'s actors and the actors, as they are now (a weight bus forms
        with them: another thread may change the group's list)."""
        group = self.groups.get(stage)
        if group is None:
            return 0, [self.actors[stage]]
        return group.healer.snapshot() if group.healer is not None else (0, list(group.members))

    def call_on(self, stage: str, members: list, method: str, *args: Any) -> Any:
        """:meth:`call` on ``members`` of ``stage``'s group alone (a weight bus's receivers)."""
        group = self.groups.get(stage)
        if group is None:
            return self.call(stage, method, *args)
        return group.call(method, *args, members=members)

    def settle(self, handle: tuple) -> list[tuple[Any, int]]:
        """Wait for every call of a weight sync given up (:func:`~dapo_flow.models.weight_bus.
        abort_bus`) to end: they fail with BusAborted, or end as they would have. Returns the
        (actor, rank) of every rollout replica that died in it; any other failure (the trainer's
        death) is raised."""
        from dapo_flow.models.weight_bus import BusAborted

        dead = []
        for call in handle:
            for rank, ref in (enumerate(call.refs) if isinstance(call, GroupCall) else [(None, call)]):
                who = self._member(call, rank) if isinstance(call, GroupCall) else self._who(call)
                try:
                    self._get(ref, self.watchdog.bound(), who=who)
                except BusAborted:
                    pass
                except RunError as failure:
                    if getattr(call, "actors", None) is None or not _died(self._ray, failure):
                        raise
                    dead.append((call.actors[rank], rank))
        return dead

    def lose_replicas(self, stage: str, lost: list[tuple[Any, int]]) -> list[str]:
        """Replicas of ``stage`` that died in a weight sync (actor, rank on the bus) out of the
        group, a replacement starting for each; a line for each newly lost."""
        return self.groups[stage].healer.drop([a for a, _ in lost], [r for _, r in lost])

    def replacements_due(self, stage: str) -> bool:
        group = self.groups.get(stage)
        return group is not None and group.healer is not None and group.healer.due()

    def admit_replacements(self, stage: str) -> list[str]:
        """Replacement replicas of ``stage`` that are up join it now (before a weight sync, with
        nothing queued on the replicas): what happened, a line each."""
        group = self.groups.get(stage)
        if group is None or group.healer is None:
            return []
        return group.healer.admit(lambda actor: self.get(actor.op_states.remote()))

    def _dead_peer(self, pending: list, owner: dict) -> RunError | None:
        """The death of the actor of one of the ``pending`` calls, named, if one shows within
        PEER_DEATH_GRACE_S; else None (the failed call's own error is the one to report)."""
        ray = self._ray
        deadline = time.monotonic() + PEER_DEATH_GRACE_S
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            try:
                self._get(ready[0], 0.0, who=self._member(*owner[ready[0]]))
            except RunError as err:
                if isinstance(err.__cause__, ray.exceptions.RayActorError):
                    return err  # "<who> died: ..."
            except Exception:  # noqa: BLE001 - another failure, after the one being reported
                pass
        return None

    def _late(self, members: list[tuple[Any, int | None]]) -> str:
        """'worker(s) 0, 3 of the training group of stage X; the actor of stage Y', for messages."""
        ranks: dict[int, list] = {}
        for call, rank in members:
            ranks.setdefault(id(call), [call]).append(rank)
        return "; ".join(
            f"{call.member}(s) {', '.join(map(str, rs))} of the {call.kind} of stage '{call.stage}'"
            if isinstance(call, GroupCall) else self._who(call) for call, *rs in ranks.values())

    def _member(self, call: Any, rank: int | None) -> str:
        """Who answers ``call`` (at ``rank`` of a group), for messages."""
        if isinstance(call, GroupCall):
            return f"{call.member} {rank} of the {call.kind} of stage '{call.stage}'"
        return self._who(call)

    def _get(self, handle: Any, timeout: float, who: str | None = None) -> Any:
        ray = self._ray
        try:
            return ray.get(handle, timeout=timeout)
        except ray.exceptions.GetTimeoutError as exc:
            raise ActorFault(
                f"{who or self._who(handle)} did not answer within {timeout:g} s (hung weight sync or "
                "generation? not enough CPUs/GPUs for the actors?); raise DAPO_FLOW_CALL_TIMEOUT (or set "
                f"run.hang_timeout_s) if the model is just slow. {RESUME_HINT}", hung=True
            ) from exc
        except ray.exceptions.RayActorError as exc:
            raise ActorFault(f"{who or self._who(handle)} died: {_root_cause(exc)}. {RESUME_HINT}") from exc
        except _node_lost(ray) as exc:  # a table held on a node that is gone (its actor went with it)
            raise ActorFault(f"the result of {who or self._who(handle)} was lost with its node: "
                             f"{_root_cause(exc)}. {RESUME_HINT}") from exc
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            if isinstance(cause, Exception) and type(cause).__module__.startswith("dapo_flow"):
                raise cause from None
            if isinstance(cause, ray.exceptions.RayActorError):  # it read a table a dead actor made
                raise ActorFault(f"{who or self._who(handle)} lost an actor whose output it read, which died: "
                                 f"{_root_cause(cause)}. {RESUME_HINT}") from exc
            if isinstance(cause, _node_lost(ray)):
                raise ActorFault(f"{who or self._who(handle)} lost a table it read with the node that held it: "
                                 f"{_root_cause(cause)}. {RESUME_HINT}") from exc
            raise RunError(f"an operator failed inside an actor: {_root_cause(exc)}") from exc

    def _who(self, handle: Any) -> str:
        """'the actor of stage X' for a single call's handle, for messages."""
        try:
            actor_id = handle.task_id().actor_id()
            return next(f"the actor of stage '{s}'" for s, a in self.actors.items()
                        if a._actor_id == actor_id)
        except Exception:  # a list of handles, or a private Ray attribute gone: no name
            return "an actor"

    def observe_step(self, seconds: float) -> None:
        self.watchdog.observe(seconds)

    def shutdown(self) -> None:
        for actor in [*self.actors.values(), *(a for g in self.groups.values() for a in g.members)]:
            self._ray.kill(actor)
        for g in self.groups.values():
            if g.healer is not None:
                g.healer.shutdown()
        self.actors.clear()
        self.groups.clear()
        for pg in self.placement_groups:
            self._ray.util.remove_placement_group(pg)
        self.placement_groups.clear()
        if self.owns_cluster:
            self._ray.shutdown()


@dataclass
class GroupCall:
    """A call made on every worker of a group: their results, joined by ``join``."""

    stage: str
    refs: list
    join: Callable[[list], Any]
    member: str = "worker"
    kind: str = "training group"
    #: a generation call on rollout replicas that heal in place: how it was made (a lost
    #: member's share is run again from it: :meth:`RayExecutor.reissue`)
    row_call: "RowCall | None" = None
    #: the actors of a call on rollout replicas that heal in place, rank order (a weight sync's:
    #: a member that died in it is dropped: Runner.finish_sync)
    actors: list | None = None


@dataclass
class WorkerGroup:
    """The actors of one training group, rank order. Row calls (``run_chain``, ``run_variant``)
    give each worker its share of the table (dapo_flow.runtime.group); every other call goes to
    all of them alike (weight syncs and checkpoints are collectives) and answers with rank 0's
    result."""

    stage: str
    members: list
    sinks: set[str]  # node ids whose output is one row of group-reduced metrics
    member: str = "worker"  # what a member is called in messages: "worker" (of a training group), "replica"
    healer: ReplicaHealer | None = None  # rollout replicas that heal in place (its members are ours)

    @property
    def kind(self) -> str:
        return "training group" if self.member == "worker" else "rollout replicas"

    def call(self, method: str, *args: Any, members: list | None = None) -> GroupCall:
        """A call every member (or every one of ``members``) makes alike (weight syncs,
        checkpoints: collectives), answered with rank 0's result."""
        members = list(self.members if members is None else members)
        refs = [getattr(m, method).remote(*args) for m in members]
        return GroupCall(self.stage, refs, member=self.member, kind=self.kind, join=lambda out: out[0],
                         actors=members if self.healer is not None else None)

    def rows(self, method: str, head: Any, inputs: Any, *rest: Any) -> "Rows":
        """A row call: every member gets the whole input by reference and takes its own share
        (:class:`~dapo_flow.runtime.worker.Share`): a training group's update prompt groups
        dealt out with their batch positions, every other call contiguous runs, whose outputs
        in rank order are in the order of the input. The output: the members' tables by
        reference, in rank order (a sink's: rank 0's one row of metrics, which the workers
        reduced together)."""
        sink = method == "run_chain" and head[-1] in self.sinks
        record = (self.healer.next_call(head, inputs)
                  if self.healer is not None and method == "run_chain" and not sink else None)
        # the members as the healer recorded them, or a copy: an async run's producer thread
        # may change the list (a replica lost) while the driver calls
        members, number = (list(self.members), ()) if record is None else (record.actors, (record.number,))
        shares = [Share(rank, len(members), for_update=sink and self.member == "worker")
                  for rank in range(len(members))]
        if method == "run_variant":
            refs = [m.run_variant.remote(head, inputs, *rest, share) for m, share in zip(members, shares)]
            return Rows(TableParts(tuple(refs)), None)
        pairs = [m.run_chain.options(num_returns=2).remote(head, inputs, share, *number)
                 for m, share in zip(members, shares)]
        tables, infos = [t for t, _ in pairs], [i for _, i in pairs]
        table = tables[0] if sink else TableParts(tuple(tables))
        return Rows(table, self.infos(infos, sink, record))

    def infos(self, refs: list, sink: bool = False, record: "RowCall | None" = None) -> GroupCall:
        """The handle of a row call's reports (joined into one ChainInfo)."""
        return GroupCall(self.stage, refs, member=self.member, kind=self.kind,
                         join=lambda out: group.join_infos(out, sink), row_call=record)


@dataclass
class Rows:
    """A row call's handles: its output ``table`` (where it was made) and its ``info``
    (:class:`~dapo_flow.runtime.tables.ChainInfo`; None for ``run_variant``)."""

    table: Any
    info: Any


#: the StageWorker methods whose input and output are tables
ROW_CALLS = ("run_chain", "run_variant")


STREAM_IN_FLIGHT = 4  # tokenized batches a streaming task may run ahead of the consumer


def _read_parquet_file(path: str) -> pa.Table:
    import pyarrow.parquet as pq

    return pq.read_table(path)


#: how long :meth:`RayExecutor.discard` waits for a call that read a lost share to fail (it has, by
#: the time the call queued again after it on the same actor is done)
DISCARD_WAIT_S = 5.0


def _refs_in(handle: Any) -> list:
    """The object references in a handle (a reference, a list of them, TableParts; else none)."""
    if isinstance(handle, TableParts):
        return [r for p in handle.parts for r in _refs_in(p)]
    if isinstance(handle, (list, tuple)):
        return [r for h in handle for r in _refs_in(h)]
    import ray

    return [handle] if isinstance(handle, ray.ObjectRef) else []


def _died(ray, failure: RunError) -> bool:
    """Whether ``failure`` (of :meth:`RayExecutor._get`) is the death of the called actor itself,
    not an error of its operators nor a hang."""
    return isinstance(failure, ActorFault) and isinstance(failure.__cause__, ray.exceptions.RayActorError)


def _node_lost(ray) -> tuple[type, ...]:
    """Ray's errors for objects (tables) and tasks lost with a node: faults, as a dead actor is."""
    return (ray.exceptions.ObjectLostError, ray.exceptions.NodeDiedError)


def _cluster_resources(ray) -> str:
    total = ray.cluster_resources()
    nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    return f"{total.get('CPU', 0):g} CPUs, {total.get('GPU', 0):g} GPUs on {nodes} node(s)"


def _root_cause(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__


#: `--executor` choices: name -> class satisfying :class:`Executor`
EXECUTORS: dict[str, type] = {"local": LocalExecutor, "ray": RayExecutor}


def executor_class(name: str) -> type:
    """The registered executor ``name``; a clear error listing the choices otherwise."""
    try:
        return EXECUTORS[name]
    except KeyError:
        raise RunError(f"unknown executor '{name}': use one of {', '.join(EXECUTORS)}") from None
