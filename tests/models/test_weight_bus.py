"""models.weight_bus: a trainer broadcasts its weights in buckets over a gloo group of its own;
receivers get every weight exactly, in its dtype, holding at most one bucket at a time. (Two
members in two threads of this process: each is a real gloo process group over TCP.)"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from dapo_flow.models.weight_bus import WeightBus, WeightEntry, bucket_plan, manifest_of
from dapo_flow.runtime.executors import free_port


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed": torch.randn(50, 8, generator=g),  # 1600 bytes: bigger than a bucket
            "q": torch.randn(8, 8, generator=g), "k": torch.randn(8, 4, generator=g),
            "norm": torch.randn(8, generator=g).to(torch.bfloat16), "head": torch.randn(3, 8, generator=g)}


def test_buckets_hold_consecutive_weights_of_one_dtype_up_to_the_size():
    manifest = manifest_of(_weights().items())
    assert manifest[0] == WeightEntry("embed", (50, 8), "float32") and manifest[3].dtype == "bfloat16"
    assert bucket_plan(manifest, 512) == [[0], [1, 2], [3], [4]]  # q + k = 384 bytes; norm's dtype differs
    assert bucket_plan(manifest, 10**9) == [[0, 1, 2], [3], [4]]
    assert bucket_plan([], 512) == []
    tied = manifest_of([*_weights().items(), ("lm_head", _weights()["embed"])])
    assert tied[-1].alias_of is None  # a different tensor of equal values is not an alias
    embed = _weights()["embed"]
    tied = manifest_of([("embed", embed), ("q", embed[:8]), ("lm_head", embed)])
    assert [e.alias_of for e in tied] == [None, None, "embed"]  # a view of part of it is its own weight
    assert bucket_plan(tied, 10**9) == [[0, 1]]


@pytest.mark.parametrize("receivers,tied", [(1, False), (2, False), (1, True)])
def test_every_receiver_gets_every_weight_exactly_a_bucket_at_a_time(receivers, tied):
    weights = _weights()
    if tied:  # an LM head tied to the embedding: one tensor under two names, sent once
        weights["lm_head"] = weights["embed"]
    manifest = manifest_of(weights.items())
    port, world, bucket = free_port(), 1 + receivers, 512
    got: dict[int, dict] = {}
    buses: dict[int, WeightBus] = {}
    errors: list[BaseException] = []

    def member(rank: int) -> None:
        try:
            bus = buses[rank] = WeightBus("127.0.0.1", port, rank, world, timeout_s=60)
            for _ in range(2):  # a bus serves every sync of the run
                if rank == 0:
                    assert bus.send(iter(weights.items()), manifest, bucket) == sum(
                        t.numel() * t.element_size() for k, t in weights.items() if k != "lm_head")
                else:
                    got[rank] = {name: t.clone() for name, t in bus.receive(manifest, bucket)}
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for rank in range(1, world):
        assert sorted(got[rank]) == sorted(weights)
        for name, value in weights.items():
            assert got[rank][name].dtype == value.dtype and torch.equal(got[rank][name], value)
        assert buses[rank].peak_buffer_bytes == 1600  # the one weight bigger than a bucket; else <= 512
    assert buses[0].peak_buffer_bytes == 1600


@pytest.mark.parametrize("late", ["sender", "receiver"])
def test_a_side_that_comes_after_the_bus_timeout_still_transfers(late):
    """One side may come long after the other: a rollout engine's receive queued right behind
    its generation waits for the trainer's update to end, a trainer's send for a generation.
    The members meet in the store, waited on again and again, and only then broadcast, whose wait
    ends at the bus's timeout (1 s here; the late side comes 2.5 s after the other)."""
    weights = _weights()
    manifest = manifest_of(weights.items())
    port, got, errors = free_port(), {}, []
    late_rank = 0 if late == "sender" else 1

    def member(rank: int) -> None:
        try:
            bus = WeightBus("127.0.0.1", port, rank, 2, timeout_s=1)
            for sync in range(2):  # the second after the first at once: no stale rendezvous
                if rank == late_rank and sync == 0:
                    time.sleep(2.5)
                if rank == 0:
                    bus.send(iter(weights.items()), manifest, 512)
                else:
                    got[sync] = {name: t.clone() for name, t in bus.receive(manifest, 512)}
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    for sync in range(2):
        assert all(torch.equal(got[sync][name], value) for name, value in weights.items())


def test_a_sender_whose_weights_differ_from_the_manifest_says_so():
    weights = _weights()
    bus = object.__new__(WeightBus)  # no group needed: the check comes before the first broadcast
    bus.rank, bus.device, bus.peak_buffer_bytes = 0, torch.device("cpu"), 0
    manifest = manifest_of(weights.items())
    shuffled = [("q", weights["q"]), *((k, v) for k, v in weights.items() if k != "q")]
    with pytest.raises(RuntimeError, match=r"sent q \(8, 8\) where the manifest has embed \(50, 8\)"):
        bus.send(iter(shuffled), manifest, 512)


def _member_until_aborted(rank: int, ports: tuple[int, int], where: str, out) -> None:
    """A member of a 3-member bus (a process: the test kills rank 2) that transfers again and
    again until the bus is given up; then ranks 0 and 1 form a new bus and transfer once."""
    from dapo_flow.models.weight_bus import BusAborted

    weights = {f"w{k}": torch.full((1 << 18,), float(k)) for k in range(16)}  # 16 buckets of 1 MB
    manifest, bucket = manifest_of(weights.items()), 1 << 20
    try:
        bus = WeightBus("127.0.0.1", ports[0], rank, 3, timeout_s=120)
        out.put(("up", rank, os.getpid()))
        if rank == 2 and where == "rendezvous":  # it never comes to a transfer
            time.sleep(600)
        transfers = 0
        while True:
            if rank == 0:
                bus.send(iter(weights.items()), manifest, bucket)
            else:
                for _ in bus.receive(manifest, bucket):
                    pass
            transfers += 1
            if transfers == 1:
                out.put(("transferred", rank, None))
    except BusAborted as exc:
        out.put(("aborted", rank, str(exc)))
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        out.put(("error", rank, repr(exc)))
        return
    bus = WeightBus("127.0.0.1", ports[1], rank, 2, timeout_s=120)  # the survivors' new bus
    if rank == 0:
        bus.send(iter(weights.items()), manifest, bucket)
        out.put(("again", rank, True))
    else:
        got = {name: t.clone() for name, t in bus.receive(manifest, bucket)}
        out.put(("again", rank, all(torch.equal(got[n], w) for n, w in weights.items())))


@pytest.mark.parametrize("where", ["broadcast", "rendezvous"])
def test_a_bus_given_up_after_a_member_is_killed_frees_the_others_who_form_a_new_one(where):
    """A member killed with SIGKILL in a transfer (or before it comes to one): the others, in a
    gloo broadcast (failing, or waiting until the group's timeout: either happens) or in the
    rendezvous (waiting for it forever), raise BusAborted once the bus is given up (abort_bus, as
    the driver does), and form a new bus that transfers every weight exactly."""
    import multiprocessing
    import os as _os
    import queue
    import signal

    from dapo_flow.models.weight_bus import abort_bus

    # spawned, not forked: a fork of a test process that ran torch, Ray or MLflow before may
    # inherit a lock some thread held and hang before it joins the bus
    ctx = multiprocessing.get_context("spawn")
    # a queue each: a member killed while it puts holds its queue's lock for good
    outs, ports = [ctx.Queue() for _ in range(3)], (free_port(), free_port())
    members = [ctx.Process(target=_member_until_aborted, args=(r, ports, where, outs[r]), daemon=True)
               for r in range(3)]
    for p in members:
        p.start()
    try:
        said: dict[tuple[str, int], object] = {}

        def until(*keys) -> None:
            deadline = time.monotonic() + 120  # a bound on a hang, not a timing
            while not all(k in said for k in keys):
                if time.monotonic() > deadline:
                    raise AssertionError(f"no word from the members; so far {said}")
                for out in outs:
                    try:
                        kind, rank, what = out.get(timeout=0.05)
                    except queue.Empty:
                        continue
                    said[(kind, rank)] = what
                    assert kind != "error", (rank, what)

        until(("up", 0), ("up", 1), ("up", 2))
        if where == "broadcast":
            until(("transferred", 2))  # it is in its transfers now
        _os.kill(said[("up", 2)], signal.SIGKILL)
        members[2].join(timeout=30)
        abort_bus("127.0.0.1", ports[0])
        until(("aborted", 0), ("aborted", 1), ("again", 0), ("again", 1))
        assert "given up" in said[("aborted", 0)] and said[("again", 1)] is True
    finally:
        for p in members:
            p.kill()
