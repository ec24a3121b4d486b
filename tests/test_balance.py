"""Cutting a batch by tokens: balanced parts for a training group's ranks, micro-batches under a
token budget (properties over random lengths, and the greedy bound)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dapo_flow.algos import AlgoError
from dapo_flow.algos.balance import balanced_partitions, token_budget_micro_batches

lengths_st = st.lists(st.integers(1, 4096), min_size=1, max_size=200).map(np.array)


@settings(max_examples=200, deadline=None)
@given(lengths=lengths_st, k=st.integers(1, 8))
def test_partitions_cover_every_row_once_and_stay_within_the_greedy_bound(lengths, k):
    parts = balanced_partitions(lengths, k)
    assert len(parts) == k
    assert sorted(np.concatenate(parts).tolist()) == list(range(len(lengths)))
    assert all(np.all(np.diff(p) > 0) for p in parts)  # sorted, no repeats
    sums = [int(lengths[p].sum()) for p in parts]
    # LPT: the heaviest part exceeds the mean by at most the longest row
    assert max(sums) <= lengths.sum() / k + lengths.max()
    assert balanced_partitions(lengths, k)[0].tolist() == parts[0].tolist()  # deterministic


@settings(max_examples=100, deadline=None)
@given(lengths=lengths_st, k=st.integers(1, 4))
def test_equal_size_parts_have_the_same_row_count(lengths, k):
    lengths = lengths[: len(lengths) - len(lengths) % k] if len(lengths) >= k else np.ones(k, np.int64)
    parts = balanced_partitions(lengths, k, equal_size=True)
    assert {len(p) for p in parts} == {len(lengths) // k}
    assert sorted(np.concatenate(parts).tolist()) == list(range(len(lengths)))


def test_balancing_beats_contiguous_halves_on_a_skewed_batch():
    lengths = np.array([100, 90, 80, 70, 10, 10, 10, 10])
    sums = sorted(int(lengths[p].sum()) for p in balanced_partitions(lengths, 2))
    assert sums == [190, 190]  # contiguous halves would be 340 / 40


@settings(max_examples=200, deadline=None)
@given(lengths=lengths_st, budget=st.integers(1, 8192))
def test_micro_batches_are_consecutive_and_within_the_budget(lengths, budget):
    micro = token_budget_micro_batches(lengths, budget)
    assert np.concatenate(micro).tolist() == list(range(len(lengths)))
    for m in micro:
        assert len(m) == 1 or lengths[m].sum() <= budget  # a row over the budget stands alone
    for a, b in zip(micro, micro[1:]):  # greedy: the next row did not fit
        assert lengths[a].sum() + lengths[b[0]] > budget


def test_bad_arguments_are_algo_errors():
    with pytest.raises(AlgoError, match="k must be >= 1"):
        balanced_partitions(np.array([1, 2]), 0)
    with pytest.raises(AlgoError, match="divide by k=2"):
        balanced_partitions(np.array([1, 2, 3]), 2, equal_size=True)
    with pytest.raises(AlgoError, match="max_tokens must be >= 1"):
        token_budget_micro_batches(np.array([1]), 0)
