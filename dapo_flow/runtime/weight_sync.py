"""The weight syncs between actors (disaggregated placement): the trainer's new weights into
rollout actors of their own.

``broadcast`` (``rollout.weight_sync``, the default under Ray): at the first sync the trainer
(rank 0 of its group) and every rollout actor of the model join a weight bus of their own
(:mod:`dapo_flow.models.weight_bus`: gloo, or NCCL where each side holds whole GPUs, :func:`bus_backend`); each sync then
streams the weights over it in buckets, in the training dtype, while the driver only waits.
``object-store`` (and every local run): the trainer exports the whole model as float32 arrays and
each target imports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dapo_flow.graph.plan import Stage, Sync

if TYPE_CHECKING:
    from dapo_flow.runtime.executors import Executor

MB = 1 << 20


@dataclass(frozen=True)
class _Bus:
    """A model's weight bus as it formed: with which actors (their roster then), where its store
    is (rank 0's), its backend, and the weights' manifest."""

    roster: int
    targets: list
    store: tuple[str, int]
    backend: str
    manifest: list


@dataclass
class WeightSyncs:
    """Runs transfer syncs for a :class:`~dapo_flow.runtime.loop.Runner`; remembers each
    model's bus (joined once, again when its targets change or it was given up)."""

    placed: Any
    ex: "Executor"
    buses: dict[str, _Bus] = field(default_factory=dict)  # model -> its bus

    def broadcasts(self, sync: Sync) -> bool:
        """Whether ``sync`` goes over a weight bus: its setting says so and the executor has
        actors to form one (local runs transfer in-process)."""
        spec = self.placed.plan.spec.models[sync.model].rollout
        return spec.weight_sync == "broadcast" and self.ex.forms_weight_buses

    def start(self, sync: Sync, version: int, *, live: bool = False) -> Any:
        """Queue one transfer sync of the weights of policy ``version`` (each side's call runs
        after those queued on its actor before it); a handle for :meth:`seconds`. ``live``
        (run.partial_rollouts): the targets take them beside a generate call in flight (the
        `_live` methods: a concurrency group of their own), between two tokens."""
        suffix = "_live" if live else ""
        if not self.broadcasts(sync):
            weights = self.ex.call(sync.source, "export_weights", sync.model)
            return self.ex.call(sync.target, "import_weights" + suffix, sync.model, weights, version)
        bus = self.buses.get(sync.model)
        if bus is None or bus.roster != self.ex.roster(sync.target):
            bus = self._join(sync)  # first, or again: a rollout replica was lost or replaced since
        bucket = int(self.placed.plan.spec.models[sync.model].rollout.sync_bucket_mb * MB)
        send = self.ex.call(sync.source, "send_weights", sync.model, bus.manifest, bucket)
        # to the bus's members, whatever the group holds now (an async run's producer thread may
        # have dropped a lost replica since): one of them dead is seen in this sync (Runner.finish_sync)
        receive = self.ex.call_on(sync.target, bus.targets, "receive_weights" + suffix,
                                  sync.model, bus.manifest, bucket, version)
        return send, receive

    def can_give_up(self, sync: Sync) -> bool:
        """Whether ``sync``'s bus can be given up mid-transfer (gloo: its waits are sliced)."""
        bus = self.buses.get(sync.model)
        return bus is not None and bus.backend == "gloo"

    def abort(self, sync: Sync) -> None:
        """Give up ``sync.model``'s bus (a member died in a transfer): every member's transfer
        ends (BusAborted); the next :meth:`start` forms it again."""
        from dapo_flow.models.weight_bus import abort_bus

        abort_bus(*self.buses.pop(sync.model).store)

    def seconds(self, handle: Any) -> float:
        """Wait for a transfer :meth:`start` queued (or an in-actor sync's one call); its
        seconds, as the side that came to it last timed them (the other side's wait for it,
        behind an update or a generation queued before, is not the transfer's). Both sides at
        once: a side that dies is named now, not when its peer's collective times out."""
        got = self.ex.get(handle)
        return min(got) if isinstance(handle, tuple) else got

    def _join(self, sync: Sync) -> _Bus:
        """The trainer and every rollout actor of ``sync.model`` form its bus (one rendezvous;
        each leaves the bus it was on)."""
        roster, actors = self.ex.group_actors(sync.target)
        addr, port = self.ex.get(self.ex.call(sync.source, "weight_bus_address"))
        backend = bus_backend(self.placed.stage(sync.source), self.placed.stage(sync.target))
        world = 1 + len(actors)
        sender = self.ex.call(sync.source, "join_weight_bus", sync.model, addr, port, 0, world, backend)
        receivers = self.ex.call_each(sync.target, "join_weight_bus",
                                      [(sync.model, addr, port, 1 + i, world, backend) for i in range(len(actors))],
                                      members=actors)
        self.ex.get((sender, receivers))
        manifest = self.ex.get(self.ex.call(sync.source, "weight_manifest", sync.model))
        self.buses[sync.model] = _Bus(roster, actors, (addr, port), backend, manifest)
        return self.buses[sync.model]

def bus_backend(source: Stage, target: Stage) -> str:
    """`nccl` where the trainer's and the rollout actors' workers each hold whole GPUs (so each
    member of the bus has a device of its own), else `gloo` (host buffers): actors on shares of
    GPUs may sit on one device, where NCCL refuses two members of one group."""
    return "nccl" if source.num_gpus >= 1 and target.num_gpus >= 1 else "gloo"
