"""Tables by handle (dapo_flow.runtime.tables): joining parts, dynamic sampling's cut by prompt
group, the ChainInfo a call reports, a group member's share of a whole input, and a table as one
Arrow IPC stream between processes (Ray's object store)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from dapo_flow.reductions import Seconds
from dapo_flow.runtime import group
from dapo_flow.runtime.tables import (ChainInfo, TableParts, assemble, cut, groups_of, info_of,
                                      merge_inputs, parts_of, table_from_ipc, table_to_ipc)
from dapo_flow.runtime.worker import Share


def _batch(ids: list[str], start: int = 0) -> pa.Table:
    return pa.table({"prompt_id": ids, "x": list(range(start, start + len(ids)))})


def _same(handle) -> pa.Table:
    return assemble(handle, list)


def test_parts_join_in_order_and_flatten():
    a, b, c = _batch(["p", "p"]), _batch(["q"], 2), _batch(["r", "r"], 3)
    joined = _same(parts_of([a, parts_of([b, c]), None]))
    assert joined.column("x").to_pylist() == [0, 1, 2, 3, 4]
    assert _same(a) is a  # a plain table is its own handle


def test_cut_keeps_whole_groups_in_row_order_even_across_a_carried_cut():
    first = _batch(["a", "b", "a", "c", "b", "c"])
    second = _batch(["d", "e", "d", "e"], 6)
    # a step keeps a and b; c is carried (a cut of `first`), and the next step adds `second`
    batch = cut([first], ["a", "b"])
    assert _same(batch).column("x").to_pylist() == [0, 1, 2, 4]
    carry = cut([first], ["c"])
    nxt = cut([carry, second], ["c", "d"])  # the carry's dropped groups (a, b) are not kept
    assert _same(nxt).column("x").to_pylist() == [3, 5, 6, 8]
    assert _same(cut([first], [])).num_rows == 0


def test_a_cut_cannot_be_flattened_as_if_whole():
    with pytest.raises(ValueError, match="cut"):
        parts_of([cut([_batch(["a"])], ["a"])])


def test_assemble_resolves_references_through_the_given_resolver():
    store = {"r1": _batch(["a"]), "r2": _batch(["b"], 1)}
    handle = TableParts(("r1", "r2"), keep=("b",))
    assert assemble(handle, lambda refs: [store[r] for r in refs]).column("x").to_pylist() == [1]
    assert assemble("r1", lambda refs: [store[r] for r in refs]).num_rows == 1


def test_info_reports_groups_in_order_of_first_appearance():
    table = _batch(["z", "z", "a", "m", "a"])
    info = info_of([("n", {"k": 1.0}, 0.5)], 3, table)
    assert info == ChainInfo([("n", {"k": 1.0}, 0.5)], 3, 5, table.nbytes, ("z", "a", "m"))
    assert groups_of(pa.table({"x": [1]})) is None
    assert groups_of(_batch([])) == ()


def test_merge_inputs_adds_the_columns_the_first_lacks():
    a = pa.table({"prompt_id": ["p"], "x": [1]})
    b = pa.table({"prompt_id": ["p"], "x": [9], "y": [2.0]})
    merged = merge_inputs(None, None, [a, b])
    assert merged.column_names == ["prompt_id", "x", "y"] and merged.column("x").to_pylist() == [1]


def test_a_members_share_is_its_part_of_the_groups_split():
    table = pa.table({"prompt_id": [f"p{i // 3}" for i in range(12)], "x": list(range(12)),
                      "response_ids": [[1] * (i % 5 + 1) for i in range(12)]})
    for members in (1, 2, 3):
        contiguous = group.split(table, members)
        update = group.split_for_update(table, members)
        for rank in range(members):
            assert Share(rank, members).of(table).equals(contiguous[rank])
            assert Share(rank, members, for_update=True).of(table).equals(update[rank])


def test_a_groups_info_joins_rows_and_groups_in_rank_order():
    a = ChainInfo([("n", {"m": 1.0, "time/x": Seconds(1.0)}, 1.0)], 2, 4, 40, ("p", "q"))
    b = ChainInfo([("n", {"m": 3.0, "time/x": Seconds(2.0)}, 3.0)], 6, 2, 20, ("r",))
    joined = group.join_infos([a, b], sink=False)
    assert (joined.rows_in, joined.rows_out, joined.bytes_out, joined.groups) == (8, 6, 60, ("p", "q", "r"))
    assert joined.report == [("n", {"m": 2.5, "time/x": 2.0}, 3.0)]  # mean weighted by rows taken; a time the slowest
    sink = group.join_infos([a, b], sink=True)
    assert (sink.rows_out, sink.bytes_out) == (4, 40)


# --- tables between processes: one Arrow IPC stream each (tables_as_ipc) --------------------


def _varied() -> pa.Table:
    """Two chunks, a dictionary column whose chunks have different dictionaries, list columns,
    schema metadata (a generation part's marks travel there)."""
    first = pa.table({"prompt_id": pa.array(["p", "q"]).dictionary_encode(),
                      "ids": pa.array([[1, 2], [3]], pa.list_(pa.int32())),
                      "logp": pa.array([[-0.5, -1.25], [-2.0]], pa.list_(pa.float32()))})
    second = pa.table({"prompt_id": pa.array(["r"]).dictionary_encode(),
                       "ids": pa.array([[4, 5, 6]], pa.list_(pa.int32())),
                       "logp": pa.array([[0.0, -0.125, -3.5]], pa.list_(pa.float32()))})
    return pa.concat_tables([first, second]).replace_schema_metadata({b"batch_part": b"first"})


def test_a_table_crosses_as_one_ipc_stream_and_comes_back_as_it_was():
    table = _varied()
    back = table_from_ipc(table_to_ipc(table))
    assert back.equals(table) and back.schema.metadata == table.schema.metadata
    assert [c.num_chunks for c in back.columns] == [c.num_chunks for c in table.columns]
    empty = table.slice(0, 0)
    assert table_from_ipc(table_to_ipc(empty)).equals(empty)


def test_a_slice_crosses_with_its_rows_only_and_is_read_in_place():
    big = pa.table({"x": pa.array(np.arange(100_000, dtype=np.int64))})
    part = big.slice(10, 5)
    buffer = table_to_ipc(part)
    assert buffer.size < 2_000  # not the 800 kB the slice's column points into
    back = table_from_ipc(buffer)
    assert back.column("x").to_pylist() == list(range(10, 15))
    data = back.column("x").chunk(0).buffers()[1]
    assert buffer.address <= data.address < buffer.address + buffer.size  # a view of the stream, not a copy


@pytest.mark.slow  # a Ray cluster's start-up (5-40 s on 2 busy cores)
@pytest.mark.shared_ray
@pytest.mark.timeout(120)
def test_tables_cross_the_object_store_between_processes_with_and_without_ipc():
    """Through Ray's object store (executors.tables_as_ipc, which the executor and every stage
    actor call): equal on the other side, schema metadata and chunks kept, a slice's rows only; a
    process that did not call it reads them, and is read, alike."""
    import ray

    from dapo_flow.runtime.executors import tables_as_ipc

    @ray.remote(num_cpus=0)
    class Side:
        def __init__(self, ipc: bool):
            if ipc:
                tables_as_ipc()

        def tail(self, table: pa.Table) -> pa.Table:
            return table.slice(1)

        def read(self, refs: list) -> tuple[list, dict]:
            table = ray.get(refs[0])
            return table.column("logp").to_pylist(), table.schema.metadata

    tables_as_ipc()  # this process, as the executor does
    table = _varied()
    ref = ray.put(table)
    assert ray.get(ref).equals(table)
    for ipc in (True, False):
        side = Side.remote(ipc)
        tail = ray.get(side.tail.remote(table))  # in as IPC; out as IPC, or as Ray pickles tables
        assert tail.equals(table.slice(1)) and tail.schema.metadata == {b"batch_part": b"first"}
        assert [c.num_chunks for c in tail.columns] == [2, 2, 2]
        values, metadata = ray.get(side.read.remote([ref]))
        assert values == table.column("logp").to_pylist() and metadata == table.schema.metadata
        ray.kill(side)
