"""Arrow <-> numpy/torch adapters for ragged token columns, vectorized via list offsets."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import pyarrow as pa

from dapo_flow import algos
from dapo_flow.core import columns as C


def _flat(col: pa.ChunkedArray | pa.Array) -> pa.ListArray:
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    return arr


def ragged_to_padded(
    col: pa.ChunkedArray | pa.Array, *, pad: float | int = 0, dtype=None
) -> tuple[np.ndarray, np.ndarray]:
    """A list column as a right-padded 2-D array plus row lengths.

    Shape: (rows,) list column -> (rows, max_len) values, (rows,) int64 lengths.
    """
    arr = _flat(col)
    values = arr.flatten().to_numpy(zero_copy_only=False)
    return _padded(arr, values, pad, dtype or values.dtype)


def _padded(arr: pa.ListArray, values: np.ndarray, pad: float | int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """Each row's ``values`` (its list's entries, in order) right-padded with ``pad``, and the
    row lengths. Shape: values (entries, ...) -> (rows, max_len, ...), (rows,) int64."""
    offsets = arr.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
    offsets = offsets - offsets[0]
    lengths = np.diff(offsets)
    width = int(lengths.max()) if len(lengths) else 0
    out = np.full((len(lengths), width) + values.shape[1:], pad, dtype=dtype)
    # row index and position of every flat value: one scatter, no Python loop over rows
    rows = np.repeat(np.arange(len(lengths)), lengths)
    pos = np.arange(len(values)) - np.repeat(offsets[:-1], lengths)
    out[rows, pos] = values
    return out, lengths


def _kept(values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The first ``lengths[i]`` entries of each row i, end to end.
    Shape: (rows, width, ...), (rows,) -> (sum(lengths), ...)."""
    return values[np.arange(values.shape[1])[None, :] < lengths[:, None]]


def _offsets(lengths: np.ndarray) -> pa.Array:
    return pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32), pa.int32())


def padded_to_ragged(values: np.ndarray, lengths: np.ndarray, type_: pa.DataType) -> pa.ListArray:
    """Inverse of :func:`ragged_to_padded`: keep the first ``lengths[i]`` values of row i."""
    lengths = np.asarray(lengths, dtype=np.int64)
    flat = _kept(values, lengths) if values.ndim == 2 else np.zeros(0, values.dtype)
    return pa.ListArray.from_arrays(_offsets(lengths), pa.array(flat, type=type_.value_type))


def topk_to_ragged(values: np.ndarray, lengths: np.ndarray, type_: pa.DataType) -> pa.ListArray:
    """K values per token of each row's first ``lengths[i]`` tokens as a list<list<...>> column
    (a teacher's top-K ids or logprobs). Shape: values (rows, width, K), lengths (rows,) ->
    (rows,) lists of lengths[i] lists of K."""
    lengths = np.asarray(lengths, dtype=np.int64)
    flat = _kept(values, lengths)  # (tokens, K)
    inner = pa.ListArray.from_arrays(pa.array(np.arange(len(flat) + 1, dtype=np.int32) * values.shape[2], pa.int32()),
                                     pa.array(flat.reshape(-1), type=type_.value_type.value_type))
    return pa.ListArray.from_arrays(_offsets(lengths), inner)


def topk_to_padded(col: pa.ChunkedArray | pa.Array, *, dtype) -> np.ndarray:
    """Inverse of :func:`topk_to_ragged`, right-padded with 0. Every token must hold the same
    number K of values (K = 1 when there are no tokens).
    Shape: (rows,) list<list<...>> column -> (rows, max_len, K)."""
    arr = _flat(col)
    inner = arr.flatten()  # (tokens,) lists of K
    sizes = np.diff(inner.offsets.to_numpy(zero_copy_only=False).astype(np.int64))
    k = int(sizes[0]) if len(sizes) else 1
    if (sizes != k).any():
        raise ValueError(f"top-K column holds lists of {sorted(set(sizes.tolist()))} values per token, expected {k}")
    values = inner.flatten().to_numpy(zero_copy_only=False).reshape(-1, k)
    return _padded(arr, values, 0, dtype)[0]


def response_mask(batch: pa.Table, lengths: np.ndarray, width: int) -> np.ndarray:
    """The response tokens that count: position < the row's length, and the row's ``loss_mask``
    where the batch has one (0 on tool / observation tokens of a multi-turn response, and on a
    row overlong filtering dropped). Shape: lengths (rows,) -> (rows, width) bool."""
    mask = np.arange(width)[None, :] < np.asarray(lengths)[:, None]
    if C.LOSS_MASK in batch.column_names:
        flags = ragged_to_padded(batch.column(C.LOSS_MASK), dtype=np.int8)[0][:, :width]
        mask[:, : flags.shape[1]] &= flags.astype(bool)
        mask[:, flags.shape[1]:] = False
    return mask


def token_lists(col: pa.ChunkedArray | pa.Array) -> list[list[int]]:
    """A list<int32> column as Python lists (what model backends take)."""
    return _flat(col).to_pylist()


def with_columns(table: pa.Table, new: Mapping[str, pa.Array | np.ndarray | Sequence]) -> pa.Table:
    """``table`` plus (or with replaced) columns, typed from ``columns.SCHEMA`` when known."""
    for name, values in new.items():
        type_ = C.SCHEMA.get(name)
        arr = values if isinstance(values, (pa.Array, pa.ChunkedArray)) else pa.array(values, type=type_)
        if type_ is not None and arr.type != type_:
            arr = arr.cast(type_)
        idx = table.schema.get_field_index(name)
        table = table.set_column(idx, name, arr) if idx >= 0 else table.append_column(name, arr)
    return table


def float_column(table: pa.Table, name: str) -> np.ndarray:
    """A scalar column as float32 numpy (nulls are an error upstream, not here)."""
    return table.column(name).to_numpy().astype(np.float32, copy=False)


def group_codes(col: pa.ChunkedArray | pa.Array) -> algos.Groups:
    """Dense group codes of an id column (prompt uids), for the algos functions.

    String ids take one Arrow hash pass (``dictionary_encode``: codes by first appearance,
    shared across chunks), ~1.5x faster than going through polars at 65k uids; other types go
    through :func:`algos.factorize`. Shape: (rows,) -> codes (rows,).
    """
    if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
        return algos.factorize(col)
    if col.null_count:
        raise algos.AlgoError(f"group ids contain {col.null_count} null(s)")
    encoded = col.dictionary_encode()
    chunks = encoded.chunks if isinstance(encoded, pa.ChunkedArray) else [encoded]
    if not chunks:
        return algos.Groups(np.zeros(0, np.int64), 0)
    codes = np.concatenate([c.indices.to_numpy() for c in chunks]).astype(np.int64, copy=False)
    return algos.Groups(codes, len(chunks[-1].dictionary))


def routes_to_arrow(routes: Sequence[np.ndarray]) -> pa.ListArray:
    """Each row's expert choices, (n_tokens, layers, k) each, as the ``routed_experts`` column:
    one flat list per row in (token, layer, k) order."""
    offsets = np.concatenate([[0], np.cumsum([r.size for r in routes])]).astype(np.int32)
    values = np.concatenate([r.reshape(-1) for r in routes]) if routes else np.zeros(0)
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values.astype(np.int16), pa.int16()))


def routes_from_arrow(col: pa.ChunkedArray | pa.Array, layers: int, top_k: int) -> list[np.ndarray]:
    """The ``routed_experts`` column back as each row's (n_tokens, layers, k) int16 array."""
    flat = _flat(col)
    offsets = flat.offsets.to_numpy()
    values = flat.values.to_numpy(zero_copy_only=False).copy()  # writable: torch takes it without a copy
    return [values[offsets[i]:offsets[i + 1]].reshape(-1, layers, top_k) for i in range(len(flat))]
