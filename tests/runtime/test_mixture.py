"""Mixtures (data.train.sources): the stratified draw holds every source within one prompt of
its share after any number of prompts, is fixed by the seed, and resumes exactly."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from dapo_flow.core import columns as C
from dapo_flow.runtime.mixture import MixtureSampler, deal


def _table(name: str, n: int) -> pa.Table:
    return pa.table({C.PROMPT_ID: [f"{name}{i}" for i in range(n)], C.PROMPT_TEXT: [f"{name}{i}" for i in range(n)],
                     C.PROMPT_IDS: [[i] for i in range(n)], C.GROUND_TRUTH: ["0"] * n, C.DATA_SOURCE: [name] * n},
                    schema=C.prompt_schema())


@pytest.mark.parametrize("shares,k", [([0.5, 0.5], 3), ([0.7, 0.2, 0.1], 4), ([1 / 3, 2 / 3], 5), ([0.9, 0.1], 1)])
def test_every_source_stays_within_one_prompt_of_its_share(shares, k):
    counts = [0] * len(shares)
    for _ in range(200):
        take = deal(shares, counts, k)
        assert sum(take) == k
        counts = [c + t for c, t in zip(counts, take)]
        n = sum(counts)
        assert all(abs(c - s * n) < 1 for c, s in zip(counts, shares)), (counts, n)


def test_a_batch_draws_each_source_by_its_weight_in_a_seeded_order():
    mix = MixtureSampler([_table("a", 30), _table("b", 7)], [0.75, 0.25], seed=3)
    first = mix.next(8)
    sources = first.column(C.DATA_SOURCE).to_pylist()
    assert sources.count("a") == 6 and sources.count("b") == 2
    assert sources != sorted(sources)  # interleaved, not source after source
    again = MixtureSampler([_table("a", 30), _table("b", 7)], [0.75, 0.25], seed=3).next(8)
    assert again.equals(first)
    other = MixtureSampler([_table("a", 30), _table("b", 7)], [0.75, 0.25], seed=4).next(8)
    assert not other.equals(first)
    # b's 7 prompts run out in the 4th batch: its next epoch begins, with fresh group ids
    ids = [pid for _ in range(3) for pid in mix.next(8).column(C.PROMPT_ID).to_pylist() if pid.startswith("b")]
    assert sum(pid.endswith("@1") for pid in ids) == 1


def test_a_resumed_mixture_draws_what_an_unbroken_one_does():
    def make():
        return MixtureSampler([_table("a", 11), _table("b", 5), _table("c", 3)], [0.5, 0.3, 0.2], seed=1)

    straight, first = make(), make()
    for k in (4, 7, 3):
        straight.next(k)
        first.next(k)
    state = json.loads(json.dumps(first.state()))  # as the checkpoint's driver.json holds it
    resumed = make()
    resumed.load(state)
    for k in (5, 8, 2, 9):
        assert resumed.next(k).equals(straight.next(k))
    with pytest.raises(ValueError, match="3 sources"):
        MixtureSampler([_table("a", 2)], [1.0], seed=0).load(state)
