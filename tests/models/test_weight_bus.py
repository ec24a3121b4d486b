"""models.weight_bus: a trainer broadcasts its weights in buckets over a gloo group of its own;
receivers get every weight exactly, in its dtype, holding at most one bucket at a time. (Two
members in two threads of this process: each is a real gloo process group over TCP.)"""

from __future__ import annotations

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
