"""Tables through Ray's object store: one Arrow IPC stream each (what dapo-flow registers,
`dapo_flow.runtime.executors.tables_as_ipc`) against Ray's own reducer for Arrow tables.

Every hop of a step on Ray stores a call's output table and reads its input tables. Ray's
reducer pickles each column's buffers in Python; dapo-flow writes the table as one IPC stream,
an out-of-band buffer whose columns the reader points into. Measured in one run, each way on the
same tables, alternating (median of the repetitions):

- `put` and `get`: `ray.put` of the table, `ray.get` of it in this process;
- `call`: an actor call that takes the table and returns its second half (an input read and an
  output stored, as a stage's call does; the actor serializes as this process does).

Tables: `main` (graphs/dapo.yaml's generation batch: 48 prompts x 8 samples, responses of 8
tokens with their logprobs and texts) and `long` (32 x 16 samples of 256-token responses, the
shape driver_bytes.py runs). Ratios are Ray's reducer over IPC (> 1: IPC is faster).

Run: python benchmarks/table_transport.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import pyarrow as pa
from rich.table import Table

from _common import fmt, make_console, write_json

SHAPES = {"main": (48, 8, 8, 12), "long": (32, 16, 256, 64)}  # prompts, samples each, response, prompt tokens
WAYS = ("ray", "ipc")


def batch(prompts: int, n: int, response: int, prompt_len: int, seed: int = 0) -> pa.Table:
    """A generation batch's columns as the rollout hands them on (ragged int32 / float32 lists,
    strings), with its schema metadata."""
    rng = np.random.default_rng(seed)
    rows = prompts * n

    def ragged(width: int, dtype, low: int = 0, high: int = 32000) -> pa.Array:
        lengths = rng.integers(max(width // 2, 1), width + 1, rows)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        values = (rng.integers(low, high, offsets[-1]) if dtype == np.int32 else -rng.random(offsets[-1]) * 5)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values.astype(dtype)))

    table = pa.table({
        "prompt_id": [f"train-{i // n}-e0" for i in range(rows)],
        "prompt_ids": ragged(prompt_len, np.int32),
        "sample_idx": pa.array(np.arange(rows) % n, pa.int32()),
        "response_ids": ragged(response, np.int32),
        "response_text": [f"{i * 7919 % 100000}" for i in range(rows)],
        "response_len": pa.array(rng.integers(1, response + 1, rows), pa.int32()),
        "rollout_logp": ragged(response, np.float32),
        "score": pa.array(rng.choice([-1.0, 1.0], rows).astype(np.float32)),
    })
    return table.replace_schema_metadata({b"dapo_flow.batch_part": b"first"})


def use(way: str) -> None:
    """Serialize tables in this process ``way``: dapo-flow's IPC, or Ray's own reducer (registered
    again: Ray's private function, as Ray itself applies it to a new serialization context)."""
    import ray

    from dapo_flow.runtime.executors import tables_as_ipc

    if way == "ipc":
        tables_as_ipc()
    else:
        from ray._private.arrow_serialization import _register_custom_datasets_serializers

        _register_custom_datasets_serializers(ray._private.worker.global_worker.get_serialization_context())


def timed(fn, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` calls, after one warm-up call."""
    fn()
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return statistics.median(out)


def measure(table: pa.Table, actors: dict, reps: int) -> dict:
    """Per way, the median put, get and call seconds; the ways alternate per repetition block."""
    import ray

    found: dict[str, dict[str, list[float]]] = {w: {"put": [], "get": [], "call": []} for w in WAYS}
    for _ in range(3):  # three alternating blocks: a drift in the box's speed hits both ways
        for way in WAYS:
            use(way)
            ref = ray.put(table)
            assert ray.get(ref).equals(table)
            found[way]["put"].append(timed(lambda: ray.put(table), reps))
            found[way]["get"].append(timed(lambda: ray.get(ref), reps))
            half = actors[way].tail.remote
            assert ray.get(half(table)).num_rows == table.num_rows - table.num_rows // 2
            found[way]["call"].append(timed(lambda: ray.get(half(table)), max(reps // 4, 3)))
    return {w: {k: statistics.median(v) for k, v in d.items()} for w, d in found.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="20 repetitions a block instead of 200")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    console = make_console()
    reps = 20 if args.quick else 200

    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)

    @ray.remote(num_cpus=0)
    class Stage:
        def __init__(self, way: str):
            use(way)

        def tail(self, table: pa.Table) -> pa.Table:
            return table.slice(table.num_rows // 2)

    try:
        actors = {way: Stage.remote(way) for way in WAYS}
        results = {}
        for name, shape in SHAPES.items():
            table = batch(*shape)
            results[name] = {"rows": table.num_rows, "bytes": table.nbytes, **measure(table, actors, reps)}
    finally:
        ray.shutdown()

    out = Table(title=f"tables through Ray's object store: Ray's reducer vs one IPC stream (median of {reps})")
    for col in ("table", "rows", "kB", "op", "Ray's ms", "IPC ms", "Ray / IPC"):
        out.add_column(col, justify="left" if col in ("table", "op") else "right")
    for name, r in results.items():
        r["ratio"] = {op: r["ray"][op] / r["ipc"][op] for op in ("put", "get", "call")}
        for op in ("put", "get", "call"):
            out.add_row(name, str(r["rows"]), f"{r['bytes'] / 1e3:.0f}", op, fmt(r["ray"][op] * 1e3),
                        fmt(r["ipc"][op] * 1e3), f"{r['ratio'][op]:.2f}x")
    console.print(out)
    write_json(args.json, {"reps": reps, "tables": results}, console)


if __name__ == "__main__":
    main()
