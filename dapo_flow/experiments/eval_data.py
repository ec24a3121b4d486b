"""What `dapo-flow eval` reads and writes, a batch at a time: the prompts (a parquet file or
folder streamed, never read whole; a built-in task or a .jsonl file loaded and cut into
batches), and the graded samples (``--save``: a parquet file written batch by batch).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from dapo_flow.data.prompts import SOURCE_KINDS
from dapo_flow.data.stream import numbered_batches, rebatched, stream_files
from dapo_flow.errors import DataError, RunError
from dapo_flow.core import columns as C
from dapo_flow.runtime.run_data import generator_tokenizer, load_source, prompt_stream

SAVED_COLUMNS = (C.PROMPT_ID, C.SAMPLE_IDX, C.DATA_SOURCE, C.PROMPT_TEXT, C.RESPONSE_TEXT, C.GROUND_TRUTH,
                 C.SCORE, C.ACC, C.RESPONSE_LEN, C.TRUNCATED, C.NUM_TURNS, C.NUM_TOOL_CALLS, C.TOOL_ERRORS,
                 C.CONVERSATION)  # the last four: agent-generate's


def streams(source: str | None) -> bool:
    """Whether eval reads ``source`` batch by batch (parquet) rather than whole (None: a mixture,
    read whole, as generated sources are)."""
    return (source is not None and not source.startswith(("builtin:", "reasoning_gym:", "verifiers:"))
            and not source.lower().endswith((".json", ".jsonl")))


class EvalPrompts:
    """The prompt batches of one eval, ``batch_size`` prompts each, in source order; after (or
    while) iterating, ``count`` prompts were given and ``skipped`` bad rows dropped.
    ``total_hint``: the source's row count when known up front (a progress bar's total)."""

    def __init__(self, plan, data, ex, batch_size: int, role: str = "val"):
        self.data, self.batch_size = data, batch_size
        self.count = self.skipped = 0
        if streams(data.source):
            self._open = prompt_stream(plan, data, ex)
            self._table = None
            try:
                rows = sum(pq.ParquetFile(f).metadata.num_rows for f in stream_files(data.source))
            except (pa.ArrowException, OSError) as exc:  # not parquet, or damaged
                raise DataError(f"{data.source}: cannot read it as parquet ({exc})\n    fix: --source takes "
                                f"{SOURCE_KINDS}") from None
            self.total_hint = rows if data.size is None else min(rows, data.size)
        else:
            self._table, self.skipped = load_source(plan, data, generator_tokenizer(plan), ex.read_parquet,
                                                    role=role)
            self.total_hint = self._table.num_rows

    def __iter__(self) -> Iterator[pa.Table]:
        if self._table is not None:
            tables: Iterator[pa.Table] = iter([self._table])
        else:
            tables = self._usable(self._open())
        for batch in rebatched(tables, self.batch_size):
            self.count += batch.num_rows
            yield batch
        if self.count == 0:
            raise DataError(f"{self.data.label}: no usable prompt row (skipped {self.skipped} bad row(s)): "
                            "nothing to evaluate")

    def _usable(self, batches: Iterator[pa.Table]) -> Iterator[pa.Table]:
        """Tokenized batches in source order -> their usable rows, numbered by source row (as
        the Ray Data eval numbers them: eval_pipeline), the first ``data.size`` rows only."""
        for table, skipped in numbered_batches(batches, self.data.split, self.data.size, by_source_row=True):
            self.skipped += skipped
            yield table


class ResponseWriter:
    """Graded samples to a parquet file, a batch at a time: written as ``NAME.partial`` and
    renamed when the eval ends, so that an interrupted eval never leaves a file that looks whole
    (and a file from an earlier eval stays until the new one is complete)."""

    def __init__(self, path: str):
        self.path = Path(path).expanduser()
        if self.path.suffix != ".parquet":
            raise RunError(f"--save {path}: the graded samples are written as parquet: name a .parquet file")
        if not self.path.parent.is_dir():
            raise RunError(f"--save {path}: folder {self.path.parent} does not exist: create it first")
        if self.path.is_dir():
            raise RunError(f"--save {path}: that is a folder: name a .parquet file to write")
        self.partial = self.path.with_name(self.path.name + ".partial")
        self._writer: pq.ParquetWriter | None = None
        self.rows = 0

    def write(self, graded: pa.Table) -> None:
        table = graded.select([c for c in SAVED_COLUMNS if c in graded.column_names])
        if self._writer is None:
            self._writer = pq.ParquetWriter(self.partial, table.schema)
        self._writer.write_table(table)
        self.rows += table.num_rows

    def close(self) -> None:
        """Finish the file (an eval with no batch writes none)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            os.replace(self.partial, self.path)

    def abort(self) -> None:
        """Drop an unfinished file (after :meth:`close`, nothing to do)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
            self.partial.unlink(missing_ok=True)
