"""Rollout replicas that heal in place: one of R > 1 replicas lost does not stop training.

When a generation call on a stage's rollout replicas finds one replica's actor dead, the
executor raises :class:`~dapo_flow.errors.ReplicaLost`; the loop asks it to :meth:`ReplicaHealer.
reissue` the lost share and queues again what read it (:meth:`~dapo_flow.runtime.loop.Runner.
finish_calls`). The re-issue:

- gives the lost member's rows (the same :class:`~dapo_flow.runtime.worker.Share` of the same
  input) to a surviving replica, which runs them with its operators' states as they were before
  that call (``StageWorker.redo_chain``): generate's seeds are per prompt and per call, so the
  samples are the ones the lost replica would have drawn, and the survivor's own call count moves
  on as if nothing happened;
- drops the lost actor from the group (later calls are split among the others) and starts a
  replacement in its bundle of the group's placement group (Ray moves a bundle whose node is gone);
- admits the replacement at the next weight sync once it is up (:meth:`ReplicaHealer.admit`):
  it takes a survivor's operator states, the weight bus is formed again with it, and that sync
  brings it the current weights before any generation is queued on it. One that cannot start is
  dropped with a warning, and training goes on with the others.

A replica that dies in a weight sync (its transfer queued or running) is seen there
(``Runner.finish_sync``): the sync gives up its weight bus (:func:`~dapo_flow.models.weight_bus.
abort_bus`: the trainer and the other replicas wait in it for the dead one), the dead replica
leaves the group (:meth:`ReplicaHealer.drop`, a replacement starting), and the weights go again to
the others on a bus formed with them; its generation calls fail and are re-issued as above.
The weights sent again are the trainer's when they go: in an ``async`` run whose next update
was queued behind the sync (``RolloutProducer.step``'s ``queue_next``), that update's, one
version newer than the sync's number (which their tokens then record); generation calls
queued behind the sync given up run on the weights before it.

Every rollout mode heals in place. A replacement is admitted only where no generation call is
queued on the replicas: under ``sync`` and ``one_step_off`` every weight sync is such a point
(it is queued once the batch being collected is complete, one_step_off's from the rollout
thread); under ``async`` the producer thread keeps generation queued across the driver's syncs,
so the driver pauses it (``RolloutProducer.paused``) for the sync a replacement joins at. Under
``async`` the producer (generation calls, their re-issue) and the driver (weight syncs,
admissions) both call the healer: it holds a lock, and each call goes to the members it
recorded. Every replica lost, or a replica lost in a checkpoint, validation, as its bus forms,
or in an NCCL transfer (whose waits cannot be given up), is a fault the whole run recovers from
(:mod:`dapo_flow.runtime.recovery`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from dapo_flow.errors import ActorFault
from dapo_flow.runtime.worker import Share

#: the rollout modes whose replicas heal in place (see the module docstring)
HEALS_IN_PLACE = ("sync", "one_step_off", "async")

#: how long a replacement may take to start (load its model, wait for resources) before the run
#: gives up on it and goes on without it
REPLACEMENT_START_TIMEOUT_S = 900.0


@dataclass
class RowCall:
    """A generation call on the replicas as it was made, to run a lost member's share again:
    the chain, its input's handles, the members that took it (rank order; a share re-issued:
    the survivor that took it over) and the call's number in the group (each member keeps its
    operators' states from before its recent calls under it)."""

    head: list[str]
    inputs: Any
    actors: list
    number: int


@dataclass
class Replacement:
    """A replica being started in place of a lost one, in placement group bundle ``bundle``."""

    actor: Any
    ready: Any  # the reference of its ``ready`` call
    bundle: int
    started_at: float = field(default_factory=time.monotonic)


@dataclass
class ReplicaHealer:
    """The in-place healing of one stage's rollout replicas (see the module docstring).
    ``members`` and ``bundles`` are the group's own lists (its live actors, the placement group
    bundle of each), changed here; ``start(bundle)`` starts a new replica actor there."""

    ray: Any
    stage: str
    members: list
    bundles: list[int]
    start: Callable[[int], Any]
    calls: int = 0  # row calls made so far: the next one's number
    roster: int = 0  # changes whenever ``members`` does (a weight bus formed before is stale)
    replacements: list[Replacement] = field(default_factory=list)
    # an async run's producer thread (generation calls, their re-issue) and its driver (weight
    # syncs, admissions) both call in
    lock: Any = field(default_factory=threading.RLock)

    def next_call(self, head: list[str], inputs: Any) -> RowCall:
        """The record of the generation call about to be made on every member (``actors``: the
        members it goes to, as they are now)."""
        with self.lock:
            self.calls += 1
            return RowCall(list(head), inputs, list(self.members), self.calls - 1)

    def snapshot(self) -> tuple[int, list]:
        """The roster and the members, as they are now (a weight bus forms with these)."""
        with self.lock:
            return self.roster, list(self.members)

    def drop(self, actors: list, ranks: list[int]) -> list[str]:
        """Members ``actors`` (at ``ranks`` of the weight bus) died in a weight sync: out of the
        group, a replacement starting for each; what happened, a line for each newly lost. Their
        generation calls fail and are re-issued as any (:meth:`reissue`). ActorFault when no
        member is left."""
        with self.lock:
            said = [f"rollout replica {rank} of stage '{self.stage}' died during a weight sync: the weights go "
                    "again to the replicas left, its generation calls are re-issued to them (the same seeds: the "
                    "same samples) and a replacement is starting (it joins at a weight sync); training goes on "
                    f"with {len(self.members)} replica(s)"
                    for actor, rank in zip(actors, ranks) if self._lose(actor)]
            if not self.members:
                raise ActorFault(f"every rollout replica of stage '{self.stage}' was lost")
            return said

    def due(self) -> bool:
        """Whether a replacement is up (or given up): the next admission has something to do."""
        with self.lock:
            return any(rep.ready is None or self.ray.wait([rep.ready], timeout=0)[0] for rep in self.replacements)

    def reissue(self, call: RowCall, ranks: list[int]
                ) -> tuple[RowCall, dict[int, tuple[Any, Any]], list[str]]:
        """Run the shares of ``call`` that members ``ranks`` (dead) held on survivors, each as
        the lost member would have (``redo_chain``); the lost actors leave the group and a
        replacement starts for each. Returns the call as it now stands (who holds each share),
        per rank the (table, info) references of its share, and what happened (a line for each
        replica newly lost: its later calls are lost too, and re-issued alike). ActorFault when
        no member of the call is left to take them."""
        with self.lock:
            return self._reissue(call, ranks)

    def _reissue(self, call: RowCall, ranks: list[int]
                 ) -> tuple[RowCall, dict[int, tuple[Any, Any]], list[str]]:
        said = []
        for rank in ranks:
            if self._lose(call.actors[rank]):
                said.append(f"rollout replica {rank} of stage '{self.stage}' died during a generation call: its "
                            "rows are re-issued to the replicas left (the same seeds: the same samples) and a "
                            f"replacement is starting (it joins at a weight sync); training goes on with "
                            f"{len(self.members)} replica(s)")
        survivors = [a for k, a in enumerate(call.actors) if k not in ranks and a in self.members]
        if not survivors:
            raise ActorFault(f"every rollout replica of stage '{self.stage}' that took a generation call was "
                             "lost: nothing to re-issue its rows to")
        actors, out = list(call.actors), {}
        for k, rank in enumerate(ranks):
            survivor = survivors[k % len(survivors)]
            share = Share(rank, len(call.actors))
            out[rank] = tuple(survivor.redo_chain.options(num_returns=2).remote(
                call.head, call.inputs, share, call.number))
            actors[rank] = survivor
        return RowCall(call.head, call.inputs, actors, call.number), out, said

    def _lose(self, actor: Any) -> bool:
        """``actor`` is dead: out of the group, and a replacement starting in its bundle; False
        where it was out already (its later calls fail too)."""
        if actor not in self.members:
            return False
        k = self.members.index(actor)
        bundle = self.bundles.pop(k)
        del self.members[k]
        self.roster += 1
        self.ray.kill(actor)  # were it only unreachable, it must not come back beside its replacement
        try:
            new = self.start(bundle)
            self.replacements.append(Replacement(new, new.ready.remote(), bundle))
        except Exception:  # noqa: BLE001 - reported at the next admission, the run goes on
            self.replacements.append(Replacement(None, None, bundle))
        return True

    def admit(self, survivor_states: Callable[[Any], dict]) -> list[str]:
        """Replacements that are up join the group (the last members), each with a survivor's
        operator states (``survivor_states(actor)``); one that failed to start or took too long
        is dropped. Call it only where no call is queued on the replicas (before a weight sync,
        the batch being collected complete). Returns what happened, one line each (a warning starts with 'warning:')."""
        with self.lock:
            return self._admit(survivor_states)

    def _admit(self, survivor_states: Callable[[Any], dict]) -> list[str]:
        said, waiting = [], []
        for rep in self.replacements:
            error = None if rep.ready is not None else "it could not be created"
            if error is None:
                done, _ = self.ray.wait([rep.ready], timeout=0)
                if not done:
                    if time.monotonic() - rep.started_at < REPLACEMENT_START_TIMEOUT_S:
                        waiting.append(rep)
                        continue
                    error = f"it did not start within {REPLACEMENT_START_TIMEOUT_S:g} s"
                else:
                    try:
                        self.ray.get(rep.ready)
                        if self.members:
                            self.ray.get(rep.actor.load_op_states.remote(survivor_states(self.members[0])))
                    except Exception as exc:  # noqa: BLE001 - any failure to start: go on without it
                        error = f"it failed to start: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc}"
            if error is not None:
                if rep.actor is not None:
                    self.ray.kill(rep.actor)
                said.append(f"warning: the replacement of a lost rollout replica of stage '{self.stage}' is given "
                            f"up ({error}); training goes on with {len(self.members)} replica(s)")
                continue
            self.members.append(rep.actor)
            self.bundles.append(rep.bundle)
            self.roster += 1
            said.append(f"a replacement rollout replica of stage '{self.stage}' joined; it takes this weight "
                        f"sync's weights before any generation ({len(self.members)} replicas)")
        self.replacements = waiting
        return said

    def shutdown(self) -> None:
        """Stop replacements still starting."""
        for rep in self.replacements:
            if rep.actor is not None:
                self.ray.kill(rep.actor)
        self.replacements.clear()
