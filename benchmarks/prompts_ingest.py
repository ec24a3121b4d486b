"""Prompt ingestion: time to the first generation batch and the driver's peak memory for a large
verl-format parquet (chat-message prompts, `reward_model.ground_truth`), read whole before the
first step (`stream: false`, the baseline) vs streamed (`stream: true`), in one run.

Each setting runs in a fresh process that imports what a run imports, then draws one batch of
48 prompts as the run's sampler does; reported: seconds from the start of reading to that
batch, and peak RSS above the process's RSS before reading (ru_maxrss, so a transient peak
counts). Settings: `whole` (dapo_flow.data.prompts.load_prompts + the permutation sampler, the
local executor's path; a Ray run reads the same way, in tasks), `stream-local` (pyarrow batches
tokenized in-process), `stream-ray` (streaming Ray tasks tokenize, a few batches ahead). The
prompts are templated with tiny-chat's chat template and tokenized with its BPE tokenizer.

Run: python benchmarks/prompts_ingest.py [--quick] [--rows N] [--json out.json] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from _common import fmt, make_console, scratch_dir, write_json

SETTINGS = ("whole", "stream-local", "stream-ray")
BATCH = 48


def write_parquet(path: Path, rows: int) -> None:
    """``rows`` verl rows: chain-task-like chat prompts with ground truths, 64k-row groups."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    chunk = 65536
    schema = None
    writer = None
    for start in range(0, rows, chunk):
        n = min(chunk, rows - start)
        idx = range(start, start + n)
        table = pa.table({
            "data_source": ["chain"] * n,
            "prompt": [[{"role": "user", "content": f"Compute step by step: {i % 97} + {i % 89} * {i % 13} - {i % 7}"}]
                       for i in idx],
            "reward_model": [{"style": "rule", "ground_truth": str(i % 97 + (i % 89) * (i % 13) - i % 7)} for i in idx],
            "extra_info": [{"index": i} for i in idx],
        })
        if writer is None:
            schema = table.schema
            writer = pq.ParquetWriter(path, schema)
        writer.write_table(table.cast(schema), row_group_size=chunk)
    writer.close()


def child(mode: str, path: str, model: str) -> dict:
    """One setting, measured in this (fresh) process."""
    import pyarrow  # noqa: F401 - imports are not what is measured
    import transformers  # noqa: F401

    from dapo_flow.data.stream import StreamSampler, TokenizeBatch, tokenized_batches
    from dapo_flow.runtime.sampler import PromptSampler

    ex = None
    if mode == "stream-ray":
        import os

        from dapo_flow.runtime.executors import RayExecutor

        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ex = RayExecutor.__new__(RayExecutor)  # only its stream reader: no stages
        import ray

        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
        ex._ray = ray
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    if mode == "whole":
        from transformers import AutoTokenizer

        from dapo_flow.data.prompts import load_prompts

        table, _ = load_prompts(path, tokenizer=AutoTokenizer.from_pretrained(model))
        batch = PromptSampler(table, seed=0).next(BATCH)
    else:
        tokenize = TokenizeBatch(model, path, "train")
        opener = ((lambda: ex.stream_parquet([Path(path)], tokenize)) if ex is not None
                  else (lambda: tokenized_batches(path, tokenize)))
        batch = StreamSampler(opener, seed=0, buffer_rows=10_000, split="train", source=path).next(BATCH)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert batch.num_rows == BATCH
    return {"first_batch_seconds": seconds, "peak_extra_bytes": max(peak - base, 0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000, help="rows in the parquet (default 1M)")
    ap.add_argument("--quick", action="store_true", help="smoke test: 50k rows")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--workdir", help="working directory to keep (default: a temp dir, removed)")
    ap.add_argument("--child", nargs=3, metavar=("MODE", "FILE", "MODEL"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    console = make_console()
    rows = 50_000 if args.quick else args.rows
    from dapo_flow.models import resolve_model

    model = str(resolve_model("builtin:tiny-chat"))
    results = {}
    with scratch_dir(args.workdir, console) as work:
        data = work / "prompts.parquet"
        t0 = time.perf_counter()
        write_parquet(data, rows)
        console.print(f"{rows:,} verl rows written in {time.perf_counter() - t0:.1f} s "
                      f"({data.stat().st_size / 2**20:.1f} MiB)")
        for mode in SETTINGS:
            r = subprocess.run([sys.executable, __file__, "--child", mode, str(data), model],
                               capture_output=True, text=True)
            if r.returncode != 0:
                raise SystemExit(f"{mode} failed:\n{r.stderr[-3000:]}")
            results[mode] = json.loads(r.stdout.strip().splitlines()[-1])
    whole = results["whole"]
    console.print(f"\nfirst batch of {BATCH} prompts from {rows:,} rows:")
    for mode, r in results.items():
        console.print(f"  {mode:<13} {r['first_batch_seconds']:8.2f} s  peak +{r['peak_extra_bytes'] / 2**20:8.1f} MiB"
                      f"  ({fmt(whole['first_batch_seconds'] / max(r['first_batch_seconds'], 1e-9), '.0f')}x faster"
                      f" than whole, {fmt(r['peak_extra_bytes'] / max(whole['peak_extra_bytes'], 1), '.3f')} of its memory)")
    write_json(args.json, {"rows": rows, "batch": BATCH, **{m: r for m, r in results.items()}}, console)


if __name__ == "__main__":
    main()
