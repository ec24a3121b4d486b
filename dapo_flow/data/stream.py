"""Streamed prompt sources (``data.train.stream: true``): a parquet file or a folder of shards
read batch by batch while training runs, never whole.

Raw batches are chat-templated and tokenized by :class:`TokenizeBatch` (under Ray in streaming
Ray tasks, one per file, a few batches ahead of the driver; in-process otherwise), and
:class:`StreamSampler` draws each generation batch from a seeded shuffle buffer of
``shuffle_buffer`` rows: the driver holds that buffer, not the source, so a file of millions
of rows starts training at once with flat memory. Both executors see the same rows in the same
order: the buffer is topped up one row at a time, so how the reader cuts its batches does not
matter.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pyarrow as pa

from dapo_flow.data.prompts import _parquet_shards, _Record, _clip, missing_prompt_file, prompt_table
from dapo_flow.errors import DataError
from dapo_flow.core import columns as C
from dapo_flow.data.prompt_budget import PromptBudget

READ_BATCH_ROWS = 1024  # raw rows per read / tokenize batch
OK = "_ok"  # TokenizeBatch's per-row flag: the row is usable (else dropped and counted)

_TOKENIZERS: dict[str, Any] = {}  # model dir -> tokenizer, one load per process


def stream_files(source: str) -> list[Path]:
    """A streamable source's parquet files, in read order."""
    path = Path(source)
    if path.is_dir():
        return _parquet_shards(path)
    if not path.is_file():
        raise missing_prompt_file(path)
    return [path]


def local_batches(files: list[Path]) -> Iterator[pa.Table]:
    """Raw rows in file order, a batch at a time (pyarrow; the local executor's reader)."""
    import pyarrow.parquet as pq

    for path in files:
        try:
            reader = pq.ParquetFile(path)
        except Exception as exc:  # noqa: BLE001 - any reader failure on user data is a bad file
            raise DataError(f"{path}: cannot read as parquet: {exc}\n    fix: rewrite the file") from None
        for batch in reader.iter_batches(batch_size=READ_BATCH_ROWS):
            yield pa.Table.from_batches([batch])


def tokenized_batches(path: str, tokenize: Callable[[pa.Table], pa.Table]) -> Iterator[pa.Table]:
    """One file's rows, read and tokenized a batch at a time (a Ray streaming task's body under
    Ray, called in-process otherwise)."""
    for raw in local_batches([Path(path)]):
        yield tokenize(raw)


@dataclass(frozen=True)
class TokenizeBatch:
    """Raw source rows -> prompt rows, one per input row, with ``_ok`` false (and nulls) where
    a row is bad (dropped with ``on_bad_row: skip``; an error otherwise) or over the prompt
    ``budget`` and filtered. Prompt ids are left for the sampler, which numbers the usable rows in
    stream order. Picklable: Ray tasks run it, each worker process loading the tokenizer once."""

    model_dir: str
    source: str
    split: str
    prompt_key: str = "prompt"
    answer_key: str | None = None
    max_prompt_tokens: int | None = None
    on_bad_row: str = "error"
    budget: PromptBudget | None = None  # the graph's prompt budget; replaces max_prompt_tokens

    def __call__(self, raw: pa.Table) -> pa.Table:
        tokenizer = _TOKENIZERS.get(self.model_dir)
        if tokenizer is None:
            from dapo_flow.core.imports import skip_unneeded_transformers_imports

            skip_unneeded_transformers_imports()
            from transformers import AutoTokenizer

            tokenizer = _TOKENIZERS[self.model_dir] = AutoTokenizer.from_pretrained(self.model_dir)
        rows = raw.to_pylist()
        table, _, kept = prompt_table([_Record(i, _where(r, self.prompt_key), r) for i, r in enumerate(rows)],
                                      source=self.source, default_source=Path(self.source).stem,
                                      tokenizer=tokenizer, split=self.split, prompt_key=self.prompt_key,
                                      answer_key=self.answer_key, max_prompt_tokens=self.max_prompt_tokens,
                                      on_bad_row=self.on_bad_row, first_id=0, budget=self.budget)
        ok = np.zeros(len(rows), dtype=bool)
        ok[kept] = True
        # one output row per input row: a dropped row's is all nulls (the sampler skips it)
        at = np.where(ok, np.cumsum(ok) - 1, -1)
        index = pa.array([int(i) if i >= 0 else None for i in at], pa.int64())
        return table.take(index).append_column(OK, pa.array(ok))


def _where(row: dict, prompt_key: str) -> str:
    """How a user finds a streamed row (its position is not known where it is tokenized)."""
    index = (row.get("extra_info") or {}).get("index") if isinstance(row.get("extra_info"), dict) else None
    if index is not None:
        return f"the row with extra_info.index {index}"
    return f"the row whose {prompt_key} is {_clip(str(row.get(prompt_key)))!r}"


def numbered_batches(batches: Iterator[pa.Table], split: str, size: int | None = None, *,
                     by_source_row: bool = False) -> Iterator[tuple[pa.Table, int]]:
    """:class:`TokenizeBatch` outputs in source order -> (their usable rows as prompt rows, the
    batch's count of dropped bad rows). Prompt ids number the usable rows in stream order
    (``{split}-{n}``: the training sampler's), or with ``by_source_row`` are the rows' positions
    in the source (an eval's: :func:`numbered_by_row`); ``size`` keeps the first ``size`` raw
    rows of the stream."""
    raw_read, usable = 0, 0
    for batch in batches:
        if size is not None:
            batch = batch.slice(0, max(size - raw_read, 0))
        ok = batch.column(OK).to_numpy(zero_copy_only=False)
        positions = np.flatnonzero(ok) + raw_read if by_source_row else np.arange(int(ok.sum())) + usable
        raw_read += batch.num_rows
        usable += len(positions)
        yield _numbered(batch, ok, split, positions)
        if size is not None and raw_read >= size:
            return


def numbered_by_row(batch: pa.Table, split: str, first_row: int) -> tuple[pa.Table, int]:
    """A :class:`TokenizeBatch` output whose first row is source row ``first_row`` -> its usable
    rows as prompt rows whose ids are their source positions (``{split}-{row}``: an eval's ids,
    the same however the source is cut into batches or tasks), and its count of dropped rows."""
    ok = batch.column(OK).to_numpy(zero_copy_only=False)
    return _numbered(batch, ok, split, np.flatnonzero(ok) + first_row)


def _numbered(batch: pa.Table, ok: np.ndarray, split: str, positions: np.ndarray) -> tuple[pa.Table, int]:
    """``batch``'s usable rows (``ok``) with ids ``{split}-{position}``, and its dropped count."""
    table = batch.filter(pa.array(ok)).drop_columns([OK])
    ids = pa.array([f"{split}-{p}" for p in positions.tolist()], pa.string())
    return table.set_column(table.schema.get_field_index(C.PROMPT_ID), C.PROMPT_ID, ids), int((~ok).sum())


def rebatched(tables: Iterator[pa.Table], rows: int) -> Iterator[pa.Table]:
    """The rows of ``tables`` in order, re-cut into tables of ``rows`` rows (the last one shorter)."""
    held: list[pa.Table] = []
    count = 0
    for table in tables:
        held.append(table)
        count += table.num_rows
        while count >= rows:
            joined = pa.concat_tables(held)
            yield joined.slice(0, rows)
            rest = joined.slice(rows)
            held, count = [rest], rest.num_rows
    if count:
        yield pa.concat_tables(held)


class StreamSampler:
    """Generation batches from a stream of tokenized batches (``open_stream()`` starts one
    pass over the source, rows in source order): a seeded shuffle buffer, topped up row by
    row to ``buffer_rows`` before each draw; a pass is an epoch, and prompt ids get the epoch
    suffix as :class:`~dapo_flow.runtime.sampler.PromptSampler`'s do. ``size``: use only the
    first ``size`` rows of the source. Resuming replays the epoch's draws up to the cursor
    (reading, not generating: seconds for a million rows)."""

    def __init__(self, open_stream: Callable[[], Iterator[pa.Table]], seed: int, buffer_rows: int,
                 split: str, source: str, size: int | None = None):
        self.open_stream, self.seed, self.buffer_rows = open_stream, seed, buffer_rows
        self.split, self.source, self.size = split, source, size
        self.epoch = 0
        self.cursor = 0  # rows drawn this epoch
        self.skipped = 0  # bad rows dropped so far (this process)
        self._start_epoch()

    def _start_epoch(self) -> None:
        self._rows: Iterator[dict] = self._usable_rows(self.open_stream())
        self._buffer: list[dict] = []
        self._rng = np.random.default_rng([self.seed, self.epoch])
        self._exhausted = False

    def _usable_rows(self, batches: Iterator[pa.Table]) -> Iterator[dict]:
        for table, skipped in numbered_batches(batches, self.split, self.size):
            self.skipped += skipped
            yield from table.to_pylist()

    def _draw(self) -> dict | None:
        while not self._exhausted and len(self._buffer) < self.buffer_rows:
            row = next(self._rows, None)
            if row is None:
                self._exhausted = True
            else:
                self._buffer.append(row)
        if not self._buffer:
            return None
        i = int(self._rng.integers(len(self._buffer)))
        row, self._buffer[i] = self._buffer[i], self._buffer[-1]
        self._buffer.pop()
        return row

    def next(self, k: int) -> pa.Table:
        rows = []
        while len(rows) < k:
            row = self._draw()
            if row is None:
                if self.cursor == 0:
                    raise DataError(f"{self.source}: the stream gave no usable prompt row (skipped "
                                    f"{self.skipped} bad row(s)); training could never draw a prompt")
                self.epoch, self.cursor = self.epoch + 1, 0
                self._start_epoch()
                continue
            row[C.PROMPT_ID] = f"{row[C.PROMPT_ID]}@{self.epoch}"
            rows.append(row)
            self.cursor += 1
        return pa.Table.from_pylist(rows, schema=C.prompt_schema())

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load(self, state: dict) -> None:
        self.epoch, cursor = int(state["epoch"]), int(state["cursor"])
        self.cursor = 0
        self._start_epoch()
        for _ in range(cursor):  # replay the epoch's draws
            if self._draw() is None:
                break
            self.cursor += 1

