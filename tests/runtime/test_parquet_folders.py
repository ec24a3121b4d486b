"""A folder of parquet shards is a data source on both executors, read in shard-name order, so
a Ray run and a local run see the same prompts (it was "does not exist" before); a corrupt
or empty file read by Ray Data is a DataError too."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dapo_flow.core import columns as C
from dapo_flow.graph.compiler import compile_graph
from dapo_flow.data.prompts import load_prompts
from dapo_flow.errors import DataError
from dapo_flow.models.tokenizer import build_char_tokenizer
from dapo_flow.graph.plan import Cluster


def _shards(folder, rows_per_shard: int = 40):
    folder.mkdir()
    for shard in (2, 0, 1):  # written out of name order, several row groups each
        prompts = [f"{shard}{j:02d}+1=" for j in range(rows_per_shard)]
        table = pa.table({"prompt": prompts, "answer": ["1"] * rows_per_shard})
        pq.write_table(table, folder / f"part-{shard:05d}.parquet", row_group_size=10)
    return [f"{s}{j:02d}+1=" for s in range(3) for j in range(rows_per_shard)]


@pytest.mark.shared_ray
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ray_data_reads_a_folder_of_shards_in_name_order(tmp_path, small_graph):
    from dapo_flow.runtime.executors import RayExecutor

    expected = _shards(tmp_path / "shards")
    spec = compile_graph(small_graph(tmp_path), Cluster(cpus=2)).plan.spec
    tok = build_char_tokenizer()
    broken = tmp_path / "broken.parquet"
    broken.write_bytes((tmp_path / "shards" / "part-00000.parquet").read_bytes()[:-20])
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), empty)
    ex = RayExecutor(spec, {}, 0, {})
    try:
        on_ray, _ = load_prompts(str(tmp_path / "shards"), tokenizer=tok, read_parquet=ex.read_parquet)
        with pytest.raises(DataError, match=r"broken.parquet: cannot read as parquet: \w+"):
            load_prompts(str(broken), tokenizer=tok, read_parquet=ex.read_parquet)
        with pytest.raises(DataError, match=r"empty.parquet: no usable prompts: it has no rows"):
            load_prompts(str(empty), tokenizer=tok, read_parquet=ex.read_parquet)
    finally:
        ex.shutdown()
    local, _ = load_prompts(str(tmp_path / "shards"), tokenizer=tok)
    assert on_ray.column(C.PROMPT_TEXT).to_pylist() == expected
    assert on_ray.to_pylist() == local.to_pylist()
