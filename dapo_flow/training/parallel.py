"""How the workers of a training group share one optimizer step: one worker, DDP or FSDP2.

Every worker of a group runs the same trainer on its share of the rows (whole prompt groups).
What differs by layout is small and lives here, so the trainer has no branch on it: how counts
and statistics add up over the group, whether every worker must make as many forward/backward
passes as the others (FSDP2's passes are collectives), how gradients meet (DDP: one all-reduce
per optimizer step; FSDP2: inside the backward), and where the optimizer's state is saved.
The collectives are :mod:`dapo_flow.models.fsdp`'s (torch.distributed), imported only by a group.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable


@runtime_checkable
class Parallelism(Protocol):
    world_size: int
    equal_passes: bool
    """Every worker runs as many forward/backward passes per optimizer step as the worker that
    needs most, a worker without rows a pass of zero loss (each pass is a collective)."""
    checkpoints_optimizer: bool
    """The optimizer's state goes into the trainer's state (else it is saved with the weights,
    shard by shard)."""

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sums over the group's workers (the values themselves for one worker)."""

    def max(self, values: Sequence[float]) -> list[float]:
        """Element-wise maxima over the group's workers."""

    def reduce_gradients(self) -> None:
        """Make every worker's gradients the group's, after a step's backward passes."""

    def load_optimizer_state(self, optimizer: Any, state: dict) -> None:
        """Load an optimizer ``state_dict()`` a one-worker run checkpointed."""


class SingleWorker:
    """One worker: nothing to add up or to wait for."""

    world_size = 1
    equal_passes = False
    checkpoints_optimizer = True

    def sum(self, values: Sequence[float]) -> list[float]:
        return [float(v) for v in values]

    def max(self, values: Sequence[float]) -> list[float]:
        return [float(v) for v in values]

    def reduce_gradients(self) -> None:
        return None

    def load_optimizer_state(self, optimizer: Any, state: dict) -> None:
        optimizer.load_state_dict(state)


class DataParallel:
    """DDP: every worker holds the whole model and its own optimizer; the policy averages the
    gradients in one flat all-reduce before each optimizer step, so the replicas stay equal and
    each checkpoints the same optimizer state."""

    equal_passes = False  # no collective inside a forward or backward pass
    checkpoints_optimizer = True

    def __init__(self, world_size: int, policy: Any):
        self.world_size = world_size
        self.policy = policy

    def sum(self, values: Sequence[float]) -> list[float]:
        return _group_sum(values)

    def max(self, values: Sequence[float]) -> list[float]:
        return _group_max(values)

    def reduce_gradients(self) -> None:
        self.policy.reduce_gradients()

    def load_optimizer_state(self, optimizer: Any, state: dict) -> None:
        optimizer.load_state_dict(state)


class FullySharded:
    """FSDP2: each worker holds a shard of the weights, gradients and optimizer state; every
    forward and backward pass gathers and reduce-scatters over the group, so every worker makes
    as many as the others. A group of one (a sharded model on one GPU) has nothing to add up."""

    checkpoints_optimizer = False  # saved with the weights, shard by shard (models.fsdp.save_sharded)

    def __init__(self, world_size: int, model: Any, replicas: Any = None):
        """``replicas``: with sequence parallelism, the ranks that hold different rows (one per
        replica of k workers, which hold the same rows): counts and statistics add up over them
        only. ``world_size`` stays the whole group's: FSDP2 averages every worker's gradient,
        and a worker's is its slice's part of its replica's."""
        self.world_size = world_size
        self.equal_passes = world_size > 1
        self.model = model
        self.replicas = replicas

    def sum(self, values: Sequence[float]) -> list[float]:
        return _group_sum(values, self.replicas) if self.world_size > 1 else [float(v) for v in values]

    def max(self, values: Sequence[float]) -> list[float]:
        return _group_max(values, self.replicas) if self.world_size > 1 else [float(v) for v in values]

    def reduce_gradients(self) -> None:
        return None  # reduce-scattered inside the backward

    def load_optimizer_state(self, optimizer: Any, state: dict) -> None:
        """A one-worker run's optimizer state, resumed by a group: each worker keeps its shards."""
        from dapo_flow.models import fsdp

        fsdp.load_full_optimizer_state(self.model, optimizer, state)


def parallelism_of(policy: Any, world_size: int) -> Parallelism:
    """The layout of a policy made a group's FSDP2 shard (``policy.sharded``) or DDP replica, or
    trained alone."""
    if policy.sharded:
        return FullySharded(world_size, policy.model, getattr(policy, "replica_group", None))
    if world_size > 1:
        return DataParallel(world_size, policy)
    return SingleWorker()


def _group_sum(values: Sequence[float], group: Any = None) -> list[float]:
    from dapo_flow.models import fsdp

    return fsdp.all_reduce_sum([float(v) for v in values], group)


def _group_max(values: Sequence[float], group: Any = None) -> list[float]:
    from dapo_flow.models import fsdp

    return fsdp.all_reduce_max([float(v) for v in values], group)
