"""How a training group's call shares a table among its workers (pure, no Ray): contiguous runs
cut between prompt groups for row operators, prompt groups dealt out with their batch positions
for an update, so that every mini-batch one worker would cut is split about evenly."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from dapo_flow.core import columns as C
from dapo_flow.runtime import group


def _table(group_sizes: list[int], response_len: int = 4) -> pa.Table:
    rows = sum(group_sizes)
    return pa.table({
        C.PROMPT_ID: [f"g{g}" for g, size in enumerate(group_sizes) for _ in range(size)],
        C.PROMPT_IDS: pa.array([[5, 6, 7]] * rows, C.TOKENS),
        C.RESPONSE_IDS: pa.array([[8] * response_len] * rows, C.TOKENS),
        "x": np.arange(rows, dtype=np.int64),
    })


def test_contiguous_shares_join_in_input_order():
    table = _table([4, 4, 4, 4])
    parts = group.split(table, 2)
    assert [p.num_rows for p in parts] == [8, 8]
    # the members' outputs, joined in rank order (TableParts), are in input order
    assert pa.concat_tables(parts).column("x").to_pylist() == list(range(16))


def test_update_shares_keep_whole_groups_and_every_row_once_with_its_position():
    table = _table([3, 1, 2, 5, 2, 3])
    parts = group.split_for_update(table, 2)
    rows = np.concatenate([p.column(C.BATCH_ROW).to_numpy() for p in parts])
    assert sorted(rows.tolist()) == list(range(table.num_rows))
    for part in parts:  # each row is the input row its position names
        assert part.column("x").to_pylist() == part.column(C.BATCH_ROW).to_pylist()
        ids = part.column(C.PROMPT_ID).to_pylist()
        for gid in set(ids):  # a group is whole on one worker
            assert ids.count(gid) == table.column(C.PROMPT_ID).to_pylist().count(gid)


def test_each_half_of_the_batch_is_shared_evenly():
    """The first and second half (two mini-batches as one worker cuts them in order) each go
    half to each worker: with contiguous shares each would sit on one worker, the other idle."""
    table = _table([8] * 32)
    parts = group.split_for_update(table, 2)
    for part in parts:
        pos = part.column(C.BATCH_ROW).to_numpy()
        assert (pos < 128).sum() == 64 and (pos >= 128).sum() == 64


def test_more_workers_than_groups_leaves_some_without_rows():
    parts = group.split_for_update(_table([2, 2]), 3)
    assert sorted(p.num_rows for p in parts) == [0, 2, 2]
    assert all(C.BATCH_ROW in p.column_names for p in parts)
