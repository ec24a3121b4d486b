"""With the Ray executor, parquet prompts are read in Ray tasks (one per file), in file order: a Ray run
and a local run of the same graph see the same prompts and log the same numbers."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dapo_flow.graph.compiler import compile_graph
from dapo_flow.graph.plan import Cluster
from dapo_flow.runtime import execute, executors
from dapo_flow.runtime.executors import RayExecutor
from dapo_flow.data.tasks import AdditionTask
from dapo_flow.tracking import read_run


def _verl_parquet(path):
    problems = AdditionTask().problems("train")[:64]
    pq.write_table(pa.table({
        "prompt": [p.prompt for p in problems],
        "reward_model": [{"ground_truth": p.answer} for p in problems],
        "data_source": ["addition"] * len(problems),
    }), path, row_group_size=16)  # several row groups: order must survive the parallel read


@pytest.mark.shared_ray
@pytest.mark.slow
def test_ray_reads_parquet_prompts_in_ray_tasks(workdir, small_graph, monkeypatch):
    data = workdir / "prompts.parquet"
    _verl_parquet(data)
    path = small_graph(workdir, name="pq", steps=2, ckpt=0)
    path.write_text(path.read_text().replace(
        'train: {source: "builtin:addition", split: train}', f'train: {{source: "{data}"}}'))
    reads = []
    real = RayExecutor.read_parquet

    def spy(self, p):
        reads.append(str(p))
        return real(self, p)

    # where each file is read: the reader the executor hands to Ray, recording the process and
    # the Ray task it runs in (a local function: Ray ships it by value to the worker)
    where = workdir / "read-in"
    where.mkdir()
    read_file = executors._read_parquet_file

    def read_and_record(p):
        import json
        import os

        import ray

        (where / f"{os.getpid()}.json").write_text(json.dumps(
            {"path": p, "pid": os.getpid(), "task_id": ray.get_runtime_context().get_task_id()}))
        return read_file(p)

    monkeypatch.setattr(RayExecutor, "read_parquet", spy)
    monkeypatch.setattr(executors, "_read_parquet_file", read_and_record)
    ray_run = execute(compile_graph(path, Cluster(cpus=2)), executor="ray")
    local_run = execute(compile_graph(path, Cluster(cpus=2)), executor="local")
    assert reads == [str(data)]
    records = [json.loads(f.read_text()) for f in where.iterdir()]
    assert len(records) == 1 and records[0]["path"] == str(data)
    assert records[0]["pid"] != os.getpid() and records[0]["task_id"] is not None  # a Ray task, not the driver
    ray_hist = read_run(ray_run["tracking_uri"], ray_run["run_id"])["history"]
    local_hist = read_run(local_run["tracking_uri"], local_run["run_id"])["history"]
    for key in ("batch/reward_mean", "actor/pg_loss", "val/acc"):
        assert ray_hist[key] == local_hist[key], key
