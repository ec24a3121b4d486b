"""Tables through Ray's object store as one Arrow IPC stream each (executors.tables_as_ipc, which
the executor and every stage actor call): equal on the other side, schema metadata and chunks
kept, a slice's rows only; a process that did not call it reads them, and is read, alike."""

from __future__ import annotations

import pyarrow as pa
import pytest

from dapo_flow.runtime.executors import tables_as_ipc


def _table() -> pa.Table:
    first = pa.table({"prompt_id": pa.array(["p", "q"]).dictionary_encode(),
                      "logp": pa.array([[-0.5, -1.25], [-2.0]], pa.list_(pa.float32()))})
    second = pa.table({"prompt_id": pa.array(["r"]).dictionary_encode(),
                       "logp": pa.array([[0.0, -3.5]], pa.list_(pa.float32()))})
    return pa.concat_tables([first, second]).replace_schema_metadata({b"batch_part": b"first"})


@pytest.mark.slow  # a Ray cluster's start-up (5-40 s on 2 busy cores)
@pytest.mark.shared_ray
@pytest.mark.timeout(120)
def test_tables_cross_the_object_store_between_processes_with_and_without_ipc():
    import ray

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
    table = _table()
    ref = ray.put(table)
    assert ray.get(ref).equals(table)
    for ipc in (True, False):
        side = Side.remote(ipc)
        tail = ray.get(side.tail.remote(table))  # in as IPC; out as IPC, or as Ray pickles tables
        assert tail.equals(table.slice(1)) and tail.schema.metadata == {b"batch_part": b"first"}
        assert [c.num_chunks for c in tail.columns] == [2, 2]
        values, metadata = ray.get(side.read.remote([ref]))
        assert values == table.column("logp").to_pylist() and metadata == table.schema.metadata
        ray.kill(side)
