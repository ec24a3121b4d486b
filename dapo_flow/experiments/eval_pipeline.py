"""`dapo-flow eval --executor ray`: evaluation as a Ray Data batch-inference pipeline.

    read + tokenize (tasks, a parquet row group each)  ->  generate (an actor pool: the
    generating stage's engines)  ->  grade (an actor pool: the reward node's stage)  ->  driver

Prompts stream through: a parquet source is read a row group at a time by Ray Data tasks, never
whole and never in the driver; the driver reads only graded batches, in source order, to tally
them (and write them, with ``--save``). Each pool actor is the stage's own StageWorker, built as
a run builds it, so a prompt samples what a local eval samples: a prompt's seed comes from the
graph's seed and its id, and a parquet row's id is its position in the source (``{split}-{row}``,
the same in the local eval). Built-in tasks and .jsonl files are loaded in the driver, as the
local eval loads them, then flow through the same pool.

The pools: as many engine actors as the generating stage has (``rollout.replicas``, or a
training group's workers, each a plain copy here), with that stage's CPUs and GPUs; one grading
actor, with the CPUs of the reward node's stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from dapo_flow.graph.plan import DRIVER

# A read + tokenize task asks for no CPU: the pools hold the cluster's, and Ray Data's tasks that
# want one beside them waited forever (as the executor's prompt readers: runtime/executors.py)
READ_CPUS = 0.0


@dataclass(frozen=True)
class RowGroup:
    """A unit of reading: a parquet file's row group, the source position of its first row and
    how many of its rows to read (``data.size`` may cut the last one)."""

    path: str
    index: int
    first_row: int
    rows: int


def row_groups(files: list[Path], size: int | None) -> list[RowGroup]:
    """The row groups of ``files`` in source order, up to ``size`` rows in all."""
    out, row = [], 0
    for path in files:
        meta = pq.ParquetFile(path).metadata
        for g in range(meta.num_row_groups):
            rows = meta.row_group(g).num_rows
            if size is not None:
                rows = min(rows, size - row)
            if rows <= 0:
                return out
            out.append(RowGroup(str(path), g, row, rows))
            row += rows
    return out


def read_prompts(items: pa.Table, tokenize, split: str) -> Iterator[pa.Table]:
    """Ray Data task: row groups in -> their usable rows as numbered prompt rows, a batch at a
    time (``tokenize``: a :class:`~dapo_flow.data.stream.TokenizeBatch`)."""
    from dapo_flow.data.stream import READ_BATCH_ROWS, numbered_by_row

    for item in items.to_pylist():
        reader = pq.ParquetFile(item["path"])
        row, left = item["first_row"], item["rows"]
        for batch in reader.iter_batches(batch_size=READ_BATCH_ROWS, row_groups=[item["index"]]):
            raw = pa.Table.from_batches([batch]).slice(0, left)
            table, _ = numbered_by_row(tokenize(raw), split, row)
            row, left = row + raw.num_rows, left - raw.num_rows
            if table.num_rows:
                yield table
            if left <= 0:
                break


class StageCall:
    """Ray Data pool actor: one stage's StageWorker, built as a run builds it, running
    ``node_id`` on each batch (``overrides``: a variant, as validation generates)."""

    def __init__(self, graph, setup, seed: int, node_id: str, overrides: dict | None):
        from dapo_flow.runtime.executors import normal_priority
        from dapo_flow.runtime.worker import StageWorker

        normal_priority()  # Ray starts workers at nice 15; this is the job's work
        self.worker = StageWorker(graph, setup, seed)
        self.node_id, self.overrides = node_id, overrides

    def __call__(self, table: pa.Table) -> pa.Table:
        if self.overrides is not None:
            return self.worker.run_variant(self.node_id, table, self.overrides)
        return self.worker.run(self.node_id, table)[0]


def eval_dataset(placed, setups: dict, prompts, *, n: int, temperature: float, seed: int, batch_size: int):
    """The pipeline as a Ray Data dataset of graded tables, in source order. ``prompts``: a
    list of :class:`RowGroup` with ``(tokenize, split)`` (a parquet source), or a table."""
    import ray

    plan, spec = placed.plan, placed.plan.spec
    gen, score = plan.first("generate"), plan.first("reward")
    context = ray.data.DataContext.get_current()
    context.execution_options.preserve_order = True  # graded batches come in source order
    context.enable_progress_bars = False  # eval draws its own
    gen_stage, score_stage = placed.node_stage[gen.id], placed.node_stage[score.id]
    pools = pool_options(placed, setups, [gen_stage, score_stage], ray.cluster_resources().get("CPU", 1.0))
    if isinstance(prompts, pa.Table):
        ds = ray.data.from_arrow(prompts)
    else:
        groups, tokenize, split = prompts
        # a block per row group: each read task streams one (never a CPU-wanting shuffle to cut
        # them: the pools hold the CPUs, and a task asking for a whole one waited forever).
        # As many read tasks at once as there are engines to feed: a zero-CPU task is never
        # held back by the CPUs, so Ray Data started one per row group at once, each in a new
        # worker process importing the tokenizer's libraries (5 row groups on 2 CPUs: 56
        # CPU-seconds for the first eval of a cluster, 25 with one reader)
        ds = ray.data.from_items([vars(g) for g in groups], override_num_blocks=max(len(groups), 1))
        ds = ds.map_batches(read_prompts, fn_kwargs={"tokenize": tokenize, "split": split}, batch_size=1,
                            batch_format="pyarrow", num_cpus=READ_CPUS,
                            concurrency=min(pools[0]["concurrency"], max(len(groups), 1)))
    ds = ds.map_batches(StageCall, fn_constructor_args=(spec, setups[gen_stage], seed, gen.id,
                                                        {"n": n, "temperature": temperature}),
                        batch_size=batch_size, batch_format="pyarrow", **pools[0])
    return ds.map_batches(StageCall, fn_constructor_args=(spec, setups[score_stage], seed, score.id, None),
                          batch_size=None, batch_format="pyarrow", **pools[1])


def pool_options(placed, setups: dict, stages: list[str], cluster_cpus: float) -> list[dict[str, Any]]:
    """Each stage's actor pool: its replicas or workers (one for the driver stage), each with
    the stage's CPUs and GPUs; the driver stage asks for no CPU, as its actor in a run does. Pools
    that would ask for more CPUs than the cluster has are scaled down to fit it (CPUs are Ray's
    bookkeeping here: each worker's torch threads are set by its stage), so they never wait
    for each other forever."""
    sizes = [1 if s == DRIVER else max(setups[s].workers, 1) for s in stages]
    cpus = [0.0 if s == DRIVER else placed.stage(s).num_cpus for s in stages]
    asked = sum(size * c for size, c in zip(sizes, cpus))
    scale = min(1.0, cluster_cpus / asked) if asked else 1.0
    out = []
    for stage, size, c in zip(stages, sizes, cpus):
        gpus = placed.stage(stage).num_gpus
        out.append({"concurrency": size, "num_cpus": c * scale, **({"num_gpus": gpus} if gpus else {})})
    return out


def graded_batches(placed, setups: dict, prompts, *, n: int, temperature: float, seed: int,
                   batch_size: int) -> Iterator[pa.Table]:
    """The graded tables of :func:`eval_dataset`, streamed into the driver in source order."""
    ds = eval_dataset(placed, setups, prompts, n=n, temperature=temperature, seed=seed, batch_size=batch_size)
    yield from whole_prompts(ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=1))


def whole_prompts(tables: Iterator[pa.Table]) -> Iterator[pa.Table]:
    """Graded tables in source order -> the same rows, each table holding every sample of its
    prompts (pass@k needs a prompt's samples together; Ray Data may cut a big block in two)."""
    from dapo_flow.core import columns as C

    held: pa.Table | None = None
    for table in tables:
        if held is not None:
            table = pa.concat_tables([held, table], promote_options="default")
            held = None
        if table.num_rows == 0:
            continue
        ids = table.column(C.PROMPT_ID)
        last = ids[-1]
        start = table.num_rows
        while start > 0 and ids[start - 1] == last:
            start -= 1
        if start:
            yield table.slice(0, start)
        held = table.slice(start)  # the last prompt: its samples may go on in the next table
    if held is not None and held.num_rows:
        yield held
