"""`dapo-flow eval` streams: prompts in batches (a parquet source read batch by batch), metrics
summed batch by batch equal to one pass over the whole set, graded samples saved to parquet,
and on Ray the same numbers as in-process."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dapo_flow.data.stream import OK, numbered_batches, rebatched
from dapo_flow.errors import DataError, RunError
from dapo_flow.experiments.eval_data import ResponseWriter
from dapo_flow.experiments.evaluate import evaluate
from dapo_flow.core import columns as C
from dapo_flow.graph.compiler import compile_graph
from dapo_flow.graph.plan import Cluster
from dapo_flow.runtime.validation import ValidationTally
from prompt_files import verl_parquet

CLUSTER = Cluster(cpus=2)


def _graded(groups: list[list[int]], start: int = 0) -> pa.Table:
    """A graded table (made by hand): prompt p{start + i} has the samples' acc of groups[i]."""
    rows = [(f"p{start + i}", acc) for i, accs in enumerate(groups) for acc in accs]
    return pa.table({C.PROMPT_ID: [r[0] for r in rows], C.ACC: [float(r[1]) for r in rows],
                     C.SCORE: [2.0 * r[1] - 1 for r in rows], C.RESPONSE_LEN: [3 + r[1] for r in rows],
                     C.PROMPT_TEXT: [r[0] for r in rows]})


def test_a_tally_over_batches_equals_one_over_the_whole_set():
    groups = [[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [0, 1, 0, 1], [0, 0, 1, 0]]
    whole = ValidationTally(n=4, log_samples=3)
    whole.add(_graded(groups))
    parts = ValidationTally(n=4, log_samples=3)
    parts.add(_graded(groups[:2]))
    parts.add(_graded(groups[2:3], start=2))
    parts.add(_graded([]))
    parts.add(_graded(groups[3:], start=3))
    assert parts.result() == pytest.approx(whole.result())
    m = whole.result()
    assert m["val/acc"] == pytest.approx(8 / 20) and m["val/pass_at_4"] == pytest.approx(4 / 5)
    # pass@2 by hand: 1 - C(n - c, 2) / C(4, 2) per prompt: c = 1, 4, 0, 2, 1
    assert m["val/pass_at_2"] == pytest.approx((0.5 + 1 + 0 + 5 / 6 + 0.5) / 5)
    assert [s[C.PROMPT_TEXT] for s in parts.samples] == ["p0", "p0", "p0"] and parts.prompts == 5
    assert ValidationTally(n=1, log_samples=0).result() == {}


def test_numbered_batches_number_usable_rows_and_rebatching_keeps_order():
    def raw(start: int, stop: int, bad: set[int]):
        idx = list(range(start, stop))
        return pa.table({C.PROMPT_ID: [None] * len(idx), C.PROMPT_TEXT: [f"t{i}" for i in idx],
                         C.PROMPT_IDS: [[i] for i in idx], C.GROUND_TRUTH: ["g"] * len(idx),
                         C.DATA_SOURCE: ["s"] * len(idx), OK: [i not in bad for i in idx]},
                        schema=C.prompt_schema().append(pa.field(OK, pa.bool_())))

    out = list(numbered_batches(iter([raw(0, 5, {1}), raw(5, 9, {6, 7})]), "val", size=8))
    assert [skipped for _, skipped in out] == [1, 2]
    tables = [t for t, _ in out]
    assert pa.concat_tables(tables).column(C.PROMPT_ID).to_pylist() == [f"val-{k}" for k in range(5)]
    assert pa.concat_tables(tables).column(C.PROMPT_TEXT).to_pylist() == ["t0", "t2", "t3", "t4", "t5"]
    cut = list(rebatched(iter(tables), 2))
    assert [t.num_rows for t in cut] == [2, 2, 1]
    assert pa.concat_tables(cut).equals(pa.concat_tables(tables))


def test_response_writer_refuses_bad_paths_and_leaves_no_half_file(tmp_path):
    with pytest.raises(RunError, match="name a .parquet file"):
        ResponseWriter(str(tmp_path / "out.csv"))
    with pytest.raises(RunError, match="does not exist"):
        ResponseWriter(str(tmp_path / "missing" / "out.parquet"))
    writer = ResponseWriter(str(tmp_path / "out.parquet"))
    writer.write(_graded([[1, 0]]))
    writer.abort()
    assert list(tmp_path.iterdir()) == []


def _eval_graph(workdir, small_graph, data, on_bad_row: str = "skip"):
    """The small graph validating on ``data`` (a parquet file)."""
    path = small_graph(workdir, name="evalstream", steps=1, ckpt=0, val_n=4, val_temp=1.0)
    path.write_text(path.read_text().replace(
        'val: {source: "builtin:addition", split: val, size: 16}',
        f'val: {{source: "{data}", split: val, on_bad_row: {on_bad_row}}}'))
    return compile_graph(path, CLUSTER)


def test_a_parquet_set_streams_in_batches_with_the_numbers_of_one_pass(workdir, small_graph):
    data = workdir / "val.parquet"
    verl_parquet(data, rows=25, row_group=5, bad=frozenset({4, 11}))
    with pytest.raises(DataError, match="empty"):  # on_bad_row: error stops at the bad row
        evaluate(_eval_graph(workdir, small_graph, data, "error"), which="base", batch_size=6)

    placed = _eval_graph(workdir, small_graph, data)
    small = evaluate(placed, which="base", batch_size=6, save=str(workdir / "graded.parquet"))
    whole = evaluate(placed, which="base", batch_size=256)
    for m in (small["metrics"], whole["metrics"]):
        assert (m["eval/prompts"], m["eval/skipped_rows"]) == (23, 2)
    for key in ("val/acc", "val/pass_at_2", "val/pass_at_4", "val/score", "val/response_len_mean"):
        assert small["metrics"][key] == pytest.approx(whole["metrics"][key]), key  # per-prompt seeds
    saved = pq.read_table(workdir / "graded.parquet")
    # an eval's prompt id is its row in the source (the bad rows 4 and 11 leave gaps), on Ray too
    rows = [r for r in range(25) if r not in (4, 11)]
    assert saved.num_rows == 23 * 4 and saved.column(C.PROMPT_ID).to_pylist()[::4] == [f"val-{r}" for r in rows]
    assert sum(saved.column(C.ACC).to_pylist()) / saved.num_rows == pytest.approx(small["metrics"]["val/acc"])
    assert not list(workdir.glob("*.partial"))


@pytest.mark.shared_ray
@pytest.mark.slow
def test_eval_on_ray_streams_the_numbers_of_the_local_executor(workdir, small_graph, monkeypatch):
    """On Ray, eval is a Ray Data pipeline (row groups read by tasks, an engine pool, a grading
    pool); a prompt samples what it samples in-process, so every graded sample is the same. The
    size cut falls inside a row group. The 5 row groups are read one task at a time, as many as
    the pool has engines (at once, each had a worker process of its own to start)."""
    from dapo_flow.experiments import eval_pipeline

    data = workdir / "val.parquet"
    verl_parquet(data, rows=20, row_group=4, bad=frozenset({3}))
    placed = _eval_graph(workdir, small_graph, data)
    reads = workdir / "reads"
    reads.mkdir()
    read = eval_pipeline.read_prompts

    def timed_read(items, tokenize, split):  # a local function: Ray ships it by value
        import time
        import uuid

        start = time.monotonic()
        yield from read(items, tokenize, split)
        (reads / uuid.uuid4().hex).write_text(f"{start} {time.monotonic()}")

    monkeypatch.setattr(eval_pipeline, "read_prompts", timed_read)
    saved = {how: workdir / f"{how}.parquet" for how in ("local", "ray")}
    local = evaluate(placed, which="base", batch_size=5, size=17, save=str(saved["local"]))["metrics"]
    ray = evaluate(placed, which="base", batch_size=5, size=17, executor="ray", save=str(saved["ray"]))["metrics"]
    spans = sorted(tuple(map(float, f.read_text().split())) for f in reads.iterdir())
    assert len(spans) == 5 and all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), spans  # one at a time
    assert (ray["eval/prompts"], ray["eval/skipped_rows"]) == (16, 1)
    for key in ("val/acc", "val/pass_at_4", "val/score", "val/response_len_mean", "eval/prompts", "eval/skipped_rows"):
        assert ray[key] == pytest.approx(local[key]), key
    local_rows, ray_rows = (pq.read_table(saved[h]) for h in ("local", "ray"))
    assert ray_rows.column(C.PROMPT_ID).to_pylist()[::4] == [f"val-{r}" for r in range(17) if r != 3]
    for column in (C.PROMPT_ID, C.RESPONSE_TEXT, C.ACC, C.SCORE):
        assert ray_rows.column(column).to_pylist() == local_rows.column(column).to_pylist(), column


def test_eval_pools_fit_the_cluster_they_run_on(workdir, small_graph, tiny_adder_path):
    from dapo_flow.experiments.eval_pipeline import pool_options
    from dapo_flow.runtime.setup import stage_setups

    placed = _eval_graph(workdir, small_graph, workdir / "val.parquet")
    setups = stage_setups(placed)
    gen, grade = pool_options(placed, setups, ["model:policy", "driver"], cluster_cpus=2)
    assert gen == {"concurrency": 1, "num_cpus": placed.stage("model:policy").num_cpus} and grade["num_cpus"] == 0
    small = pool_options(placed, setups, ["model:policy", "model:policy"], cluster_cpus=1)  # e.g. a reward model's
    assert sum(p["num_cpus"] for p in small) == pytest.approx(1)  # scaled down: else they wait forever


def test_a_prompt_cut_between_two_pipeline_blocks_is_joined_again():
    from dapo_flow.experiments.eval_pipeline import whole_prompts

    cut = [_graded([[1, 0, 0, 0], [1, 1]]), _graded([], start=9), _graded([[1, 0], [0, 0, 0, 0]], start=1)]
    out = list(whole_prompts(iter(cut)))
    assert [t.column(C.PROMPT_ID).to_pylist() for t in out] == [["p0"] * 4, ["p1"] * 4, ["p2"] * 4]
    whole, parts = ValidationTally(n=4, log_samples=0), ValidationTally(n=4, log_samples=0)
    whole.add(_graded([[1, 0, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]]))
    for t in out:
        parts.add(t)
    assert parts.result() == pytest.approx(whole.result())
