"""Weight sync by broadcast: a trainer streams its weights to rollout engines in buckets over a
process group of its own (gloo between CPU processes, NCCL between GPUs).

The trainer is rank 0, the engines ranks 1..R. Both sides know the weights' names, shapes and
dtypes up front (the manifest, a few KB through the driver) and cut them into the same buckets
(:func:`bucket_plan`): consecutive weights of one dtype up to ``bucket_bytes``. The trainer
packs a bucket into one flat buffer and broadcasts it; each engine receives it into a buffer of
its own and hands the views to its ``load_weights``, which copies them into the model before
the next bucket comes. So the weights travel in the training dtype, never whole and never
through the driver, disk or object store, with about one bucket of extra memory on each side
(verl's disaggregated sync broadcasts the same way over NCCL).

The group is standalone (its own TCPStore and ``ProcessGroupGloo`` / ``ProcessGroupNCCL``),
so it lives beside a training group's default process group. Pure torch: no Ray here.

A gloo bus can be given up (:func:`abort_bus`, from any process: a key in its store) when one of
its members died: the others' transfer raises :class:`BusAborted` within a wait slice
(:data:`WAIT_SLICE_S`), whether they wait in the rendezvous or in a broadcast. A member killed in
a gloo broadcast leaves the others either failing at once ("Connection closed by peer") or, about
half the time, waiting until the group's timeout; so they wait in slices, looking for the key in
between. A bus given up is left (its group's thread ends at that timeout); the members form a
new one. NCCL's waits are not sliced: a member lost in an NCCL transfer is not given up here.
"""

from __future__ import annotations

import datetime
import math
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

DEFAULT_BUCKET_MB = 256  # verl's default update_weights_bucket_megabytes is 512; engines here are smaller
JOIN_TIMEOUT_S = 300  # every member joins at once: a member that never comes is a RunError, not a hang
WAIT_SLICE_S = 0.5  # a gloo member's waits are cut in slices this long, to see an abort in between
ABORT_KEY = "abort"
ABORT_GRACE_S = 60.0  # a member whose broadcast failed waits this long for the bus to be given up


class BusAborted(RuntimeError):
    """The bus was given up (:func:`abort_bus`) during a transfer: a member died."""


#: the groups of buses given up, kept: one may still run a gloo op (until the group's timeout),
#: and destroying it would wait for that
_GIVEN_UP: list = []


def abort_bus(addr: str, port: int, timeout_s: float = 30.0) -> None:
    """Give up the bus whose store is at ``addr``:``port`` (its rank 0's): every member's
    transfer, in flight or to come, raises :class:`BusAborted` (within :data:`WAIT_SLICE_S`)."""
    import torch.distributed as dist

    store = dist.TCPStore(addr, port, None, False, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    store.set(ABORT_KEY, b"")


@dataclass(frozen=True)
class WeightEntry:
    """One weight as it travels: its HF name, full (unsharded) shape and dtype name."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32"
    alias_of: str | None = None  # an earlier entry's name whose tensor this is (tied embeddings): not sent twice

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def bucket_plan(manifest: list[WeightEntry], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``manifest`` per bucket, in order: consecutive weights of one dtype while they
    fit ``bucket_bytes`` (a weight bigger than a bucket travels alone)."""
    import torch

    buckets: list[list[int]] = []
    size, dtype = 0, None
    for i, entry in enumerate(manifest):
        if entry.alias_of is not None:
            continue  # travels as its original
        nbytes = entry.numel * getattr(torch, entry.dtype).itemsize
        if not buckets or entry.dtype != dtype or size + nbytes > bucket_bytes:
            buckets.append([])
            size, dtype = 0, entry.dtype
        buckets[-1].append(i)
        size += nbytes
    return buckets


def manifest_of(pairs: Iterable[tuple[str, Any]]) -> list[WeightEntry]:
    """The manifest of (name, tensor) pairs; a DTensor (an FSDP2 shard) gives its full shape. A
    tensor met before under another name (a tied embedding and LM head) is an alias of it."""
    out, first = [], {}
    for name, t in pairs:
        key = _storage_key(t)
        out.append(WeightEntry(name, tuple(int(d) for d in t.shape), str(t.dtype).removeprefix("torch."),
                               alias_of=first.get(key)))
        first.setdefault(key, name)
    return out


def _storage_key(t: Any) -> tuple:
    """What identifies a tensor's memory (a DTensor's by its local shard)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape), str(local.dtype)


class WeightBus:
    """One member of a broadcast group: rank 0 sends (:meth:`send`), the others receive
    (:meth:`receive`). ``backend``: `gloo` (CPU tensors) or `nccl` (CUDA tensors). Joining is a
    rendezvous: every member must construct its bus at about the same time."""

    def __init__(self, addr: str, port: int, rank: int, world_size: int, backend: str = "gloo",
                 timeout_s: float = JOIN_TIMEOUT_S):
        import torch
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.timeout, self.transfers = timeout, 0
        self.store = dist.TCPStore(addr, port, world_size, rank == 0, timeout=timeout)
        if backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
            self.group = dist.ProcessGroupNCCL(self.store, rank, world_size)
        elif backend == "gloo":
            self.device = torch.device("cpu")
            self.group = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)
        else:
            raise ValueError(f"unknown weight bus backend {backend!r}: use gloo or nccl")
        self.peak_buffer_bytes = 0  # the largest bucket buffer this member held (the extra memory)

    def _rendezvous(self) -> None:
        """Before a transfer's first bucket: each member says it is here and waits for every
        other, through the store, not inside the collective. One side may come long before the
        other (a rollout engine's receive queued behind its generation, or a trainer's send
        behind its update: minutes on a big model), and a collective's wait ends at the bus's
        timeout; the store's is taken again as long as it takes (a peer that died fails the
        store's socket, and the run's driver names it)."""
        import torch.distributed as dist

        self.transfers += 1
        here = [f"transfer/{self.transfers}/{r}" for r in range(self.world_size)]
        if self.rank == 0 and self.transfers > 1:  # every member is past the last transfer's
            for r in range(self.world_size):
                self.store.delete_key(f"transfer/{self.transfers - 1}/{r}")
        self.store.set(here[self.rank], b"")
        wait = datetime.timedelta(seconds=WAIT_SLICE_S) if self.backend == "gloo" else self.timeout
        while True:
            try:
                self.store.wait(here, wait)
                return
            except dist.DistStoreError:  # a timeout: the peer is still behind its own work
                self._check_aborted()

    def _check_aborted(self) -> None:
        if self.store.check([ABORT_KEY]):
            _GIVEN_UP.append(self.group)
            raise BusAborted(f"weight bus rank {self.rank}: the bus was given up (a member died)")

    def _broadcast(self, buffer) -> None:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = 0
        work = self.group.broadcast([buffer], options)
        if self.backend != "gloo":
            work.wait()
            return
        start, wait = time.monotonic(), datetime.timedelta(seconds=WAIT_SLICE_S)
        while True:  # sliced (see the module docstring); a timed-out wait leaves the op running
            try:
                work.wait(wait)
                return
            except RuntimeError as exc:
                if time.monotonic() - start > self.timeout.total_seconds():
                    raise
                if "timed out" not in str(exc).lower():
                    self._await_abort(exc)
                self._check_aborted()

    def _await_abort(self, failure: RuntimeError) -> None:
        """A gloo broadcast failed (a peer's socket closed: it died): raise BusAborted once the
        bus is given up, so that each member says the same, or ``failure`` if it is not within
        :data:`ABORT_GRACE_S` (no one saw a death)."""
        deadline = time.monotonic() + ABORT_GRACE_S
        while time.monotonic() < deadline:
            if self.store.check([ABORT_KEY]):
                _GIVEN_UP.append(self.group)
                raise BusAborted(f"weight bus rank {self.rank}: the bus was given up (a member died)") from failure
            time.sleep(WAIT_SLICE_S)
        raise failure

    def _buffer(self, entries: list[WeightEntry]):
        import torch

        dtype = getattr(torch, entries[0].dtype)
        numel = sum(e.numel for e in entries)
        self.peak_buffer_bytes = max(self.peak_buffer_bytes, numel * dtype.itemsize)
        return torch.empty(numel, dtype=dtype, device=self.device)

    def send(self, pairs: Iterable[tuple[str, Any]], manifest: list[WeightEntry], bucket_bytes: int) -> int:
        """Rank 0: broadcast ``pairs`` (in manifest order) bucket by bucket; returns the bytes sent."""
        if self.rank != 0:
            raise RuntimeError("only rank 0 of a weight bus sends")
        stream = iter(pairs)
        at = 0  # the manifest entry the stream is at

        def next_sent(entry: WeightEntry):
            nonlocal at
            while True:  # aliases in the stream are passed over (their original carries them)
                name, tensor = next(stream)
                expected = manifest[at]
                at += 1
                if name != expected.name or tuple(tensor.shape) != expected.shape:
                    raise RuntimeError(f"weight bus: sent {name} {tuple(tensor.shape)} where the manifest "
                                       f"has {expected.name} {expected.shape}")
                if expected is entry:
                    return tensor

        sent = 0
        for k, bucket in enumerate(bucket_plan(manifest, bucket_bytes)):
            entries = [manifest[i] for i in bucket]
            buffer = self._buffer(entries)
            offset = 0
            for entry in entries:
                buffer[offset: offset + entry.numel].copy_(next_sent(entry).reshape(-1))
                offset += entry.numel
            if k == 0:
                self._rendezvous()
            self._broadcast(buffer)
            sent += buffer.numel() * buffer.element_size()
            del buffer
        for _ in stream:  # trailing aliases: a sharded source gathers each, with its whole group
            pass
        return sent

    def receive(self, manifest: list[WeightEntry], bucket_bytes: int) -> Iterator[tuple[str, Any]]:
        """Ranks 1..: the weights as (name, tensor) pairs, a bucket at a time (views of the
        bucket's buffer: the consumer copies each before asking for the next bucket)."""
        aliases: dict[str, list[str]] = {}
        for entry in manifest:
            if entry.alias_of is not None:
                aliases.setdefault(entry.alias_of, []).append(entry.name)
        for k, bucket in enumerate(bucket_plan(manifest, bucket_bytes)):
            entries = [manifest[i] for i in bucket]
            buffer = self._buffer(entries)
            if k == 0:
                self._rendezvous()
            self._broadcast(buffer)
            offset = 0
            for entry in entries:
                view = buffer[offset: offset + entry.numel].view(entry.shape)
                for name in (entry.name, *aliases.get(entry.name, ())):  # an alias right after its original
                    yield name, view
                offset += entry.numel
            del buffer

    def close(self) -> None:
        """Leave the group (its sockets close with the objects)."""
        self.group = None
        self.store = None
