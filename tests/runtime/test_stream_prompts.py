"""Streamed prompt sources (data.train.stream): the shuffle-buffer sampler's determinism,
epochs, resume and bad rows; a streamed run on the local executor and, identical, on Ray
(streaming Ray tasks read and tokenize)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from dapo_flow.data.stream import OK, StreamSampler, TokenizeBatch, local_batches
from dapo_flow.errors import DataError
from dapo_flow.core import columns as C
from dapo_flow.graph.compiler import compile_graph
from dapo_flow.graph.plan import Cluster
from dapo_flow.runtime import execute
from dapo_flow.tracking import read_run
from prompt_files import verl_parquet


def _fake_stream(n: int, batch: int, bad: set[int] = frozenset()):
    """A fake tokenized stream (named so): rows p0..p{n-1}, cut into batches of ``batch``."""
    def open_stream():
        for start in range(0, n, batch):
            idx = list(range(start, min(start + batch, n)))
            yield pa.table({C.PROMPT_ID: [""] * len(idx), C.PROMPT_TEXT: [f"p{i}" for i in idx],
                            C.PROMPT_IDS: [[i] for i in idx], C.GROUND_TRUTH: [str(i) for i in idx],
                            C.DATA_SOURCE: ["t"] * len(idx), OK: [i not in bad for i in idx]},
                           schema=C.prompt_schema().append(pa.field(OK, pa.bool_())))
    return open_stream


def _texts(sampler: StreamSampler, k: int, times: int) -> list[list[str]]:
    return [sampler.next(k).column(C.PROMPT_TEXT).to_pylist() for _ in range(times)]


def test_draws_do_not_depend_on_how_the_reader_cuts_batches():
    a = StreamSampler(_fake_stream(50, 3), seed=1, buffer_rows=8, split="train", source="s")
    b = StreamSampler(_fake_stream(50, 17), seed=1, buffer_rows=8, split="train", source="s")
    assert _texts(a, 7, 6) == _texts(b, 7, 6)
    c = StreamSampler(_fake_stream(50, 3), seed=2, buffer_rows=8, split="train", source="s")
    assert _texts(c, 7, 6) != _texts(StreamSampler(_fake_stream(50, 3), 1, 8, "train", "s"), 7, 6)


def test_an_epoch_draws_every_row_once_then_the_next_epoch_reshuffles():
    s = StreamSampler(_fake_stream(20, 6), seed=0, buffer_rows=5, split="train", source="s")
    first = s.next(20)
    assert sorted(first.column(C.PROMPT_TEXT).to_pylist()) == sorted(f"p{i}" for i in range(20))
    assert all(pid.endswith("@0") for pid in first.column(C.PROMPT_ID).to_pylist())
    second = s.next(20)
    assert all(pid.endswith("@1") for pid in second.column(C.PROMPT_ID).to_pylist())
    assert second.column(C.PROMPT_TEXT).to_pylist() != first.column(C.PROMPT_TEXT).to_pylist()
    # the buffer is a local shuffle: nothing is drawn before the buffer could hold it
    assert int(first.column(C.PROMPT_TEXT)[0].as_py()[1:]) < 5


def test_resume_replays_to_the_cursor():
    straight = StreamSampler(_fake_stream(30, 4), seed=3, buffer_rows=6, split="train", source="s")
    _texts(straight, 11, 4)  # into epoch 1
    state = straight.state()
    assert state["epoch"] == 1
    resumed = StreamSampler(_fake_stream(30, 4), seed=3, buffer_rows=6, split="train", source="s")
    resumed.load(state)
    assert _texts(resumed, 9, 5) == _texts(straight, 9, 5)


def test_bad_rows_are_counted_size_limits_and_an_empty_stream_is_an_error():
    s = StreamSampler(_fake_stream(10, 4, bad={1, 2, 7}), seed=0, buffer_rows=100, split="train", source="s")
    texts = s.next(7).column(C.PROMPT_TEXT).to_pylist()
    assert sorted(texts) == sorted(f"p{i}" for i in (0, 3, 4, 5, 6, 8, 9)) and s.skipped == 3
    # ids number the usable rows in stream order
    assert sorted(s.next(7).column(C.PROMPT_ID).to_pylist()) == sorted(f"train-{k}@1" for k in range(7))
    sized = StreamSampler(_fake_stream(10, 4), seed=0, buffer_rows=100, split="train", source="s", size=4)
    assert sorted(sized.next(4).column(C.PROMPT_TEXT).to_pylist()) == ["p0", "p1", "p2", "p3"]
    with pytest.raises(DataError, match="no usable prompt row"):
        StreamSampler(_fake_stream(3, 2, bad={0, 1, 2}), 0, 10, "train", "s").next(1)


def test_tokenize_batch_matches_the_whole_file_loader_and_names_a_bad_row(tmp_path, tiny_adder_path):
    data = tmp_path / "p.parquet"
    verl_parquet(data, rows=40)
    model = str(tiny_adder_path)  # the fixture: the session orders the test after tiny-adder's build
    out = pa.concat_tables(map(TokenizeBatch(model, str(data), "train"), local_batches([data])))
    from dapo_flow.data.prompts import load_prompts
    from transformers import AutoTokenizer

    whole, _ = load_prompts(str(data), tokenizer=AutoTokenizer.from_pretrained(model))
    assert out.column(C.PROMPT_IDS).equals(whole.column(C.PROMPT_IDS))
    assert out.column(C.GROUND_TRUTH).equals(whole.column(C.GROUND_TRUTH))
    bad = pa.table({"prompt": ["1+1=", ""], "reward_model": [{"ground_truth": "2"}, {"ground_truth": "3"}]})
    with pytest.raises(DataError, match="the row whose prompt is ''"):
        TokenizeBatch(model, "f.parquet", "train")(bad)
    assert TokenizeBatch(model, "f.parquet", "train", on_bad_row="skip")(bad).column(OK).to_pylist() == [True, False]


def _streamed_graph(workdir, small_graph, data):
    path = small_graph(workdir, name="stream", steps=2, ckpt=0)
    path.write_text(path.read_text().replace(
        'train: {source: "builtin:addition", split: train}',
        f'train: {{source: "{data}", stream: true, shuffle_buffer: 50}}'))
    return path


def test_a_streamed_source_trains_on_the_local_executor(workdir, small_graph):
    data = workdir / "prompts.parquet"
    verl_parquet(data)
    summary = execute(compile_graph(_streamed_graph(workdir, small_graph, data), Cluster(cpus=2)),
                      executor="local")
    hist = read_run(summary["tracking_uri"], summary["run_id"])["history"]
    assert [s for s, _ in hist["batch/reward_mean"]] == [1, 2]
    assert hist["data/stream_skipped_rows"] == [(1, 0.0), (2, 0.0)]


def test_a_streamed_run_resumes_as_if_never_stopped(workdir, small_graph):
    """Stopped after step 2 and resumed to 4 (past the end of the 20-row file: a new epoch), a
    streamed run logs what a straight run to 4 logs."""
    data = workdir / "prompts.parquet"
    verl_parquet(data, rows=20, row_group=8)  # 4 steps draw >= 32 prompts
    path = _streamed_graph(workdir, small_graph, data)
    path.write_text(path.read_text().replace("steps: 2", "steps: 4").replace("checkpoint_every: 0", "checkpoint_every: 2"))
    det = lambda h: {k: v for k, v in h.items() if not k.startswith(("time/", "perf/", "gen/"))}  # noqa: E731
    straight = execute(compile_graph(path, Cluster(cpus=2)), executor="local")
    first = execute(compile_graph(path, Cluster(cpus=2)), executor="local", steps=2)
    resumed = execute(compile_graph(path, Cluster(cpus=2)), executor="local", resume=first["run_id"], steps=4)
    want = read_run(straight["tracking_uri"], straight["run_id"])["history"]
    got = read_run(resumed["tracking_uri"], resumed["run_id"])["history"]
    assert det(got) == det(want)


def test_stream_reads_parquet_only():
    from pydantic import ValidationError

    from dapo_flow.graph.spec import DataSourceSpec

    with pytest.raises(ValidationError, match="stream: true reads a .parquet file"):
        DataSourceSpec(source="builtin:addition", stream=True)


@pytest.mark.shared_ray
@pytest.mark.slow
def test_ray_tasks_stream_the_same_prompts_as_the_local_reader(workdir, small_graph):
    data = workdir / "prompts.parquet"
    verl_parquet(data)
    path = _streamed_graph(workdir, small_graph, data)
    ray_run = execute(compile_graph(path, Cluster(cpus=2)), executor="ray")
    local_run = execute(compile_graph(path, Cluster(cpus=2)), executor="local")
    ray_hist = read_run(ray_run["tracking_uri"], ray_run["run_id"])["history"]
    local_hist = read_run(local_run["tracking_uri"], local_run["run_id"])["history"]
    for key in ("batch/reward_mean", "actor/pg_loss", "val/acc"):
        assert ray_hist[key] == local_hist[key], key
