"""Cutting a batch by token counts: balanced parts for the ranks of a training group, and
micro-batches under a token budget (verl's ``get_seqlen_balanced_partitions`` and dynamic batch
size, ``rearrange_micro_batches``). Pure numpy; every function returns index arrays.
"""

from __future__ import annotations

import heapq

import numpy as np

from dapo_flow.algos.errors import AlgoError


def balanced_partitions(lengths: np.ndarray, k: int, *, equal_size: bool = False) -> list[np.ndarray]:
    """``k`` parts of the rows whose token sums are as equal as the greedy rule makes them:
    rows in decreasing length, each to the part with the fewest tokens so far (LPT; its largest
    part is at most 4/3 of the optimum). ``equal_size``: parts also get the same number of rows
    (``len(lengths)`` must divide by ``k``), as ranks that must run the same number of
    micro-batches need. Deterministic (ties by row index); each part's indices sorted.

    Shape: lengths (batch,) -> k arrays of row indices, together every row exactly once.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if k < 1:
        raise AlgoError(f"k must be >= 1, got {k}")
    n = len(lengths)
    if equal_size and n % k:
        raise AlgoError(f"equal_size needs the batch ({n} rows) to divide by k={k}")
    cap = n // k if equal_size else n
    order = np.lexsort((np.arange(n), -lengths))  # longest first, then by index
    heap = [(0, part) for part in range(k)]  # (tokens so far, part): the lightest on top
    parts: list[list[int]] = [[] for _ in range(k)]
    for row in order:
        tokens, part = heapq.heappop(heap)
        parts[part].append(int(row))
        if len(parts[part]) < cap:  # a full part leaves the heap
            heapq.heappush(heap, (tokens + int(lengths[row]), part))
    return [np.array(sorted(p), dtype=np.int64) for p in parts]


def token_budget_micro_batches(lengths: np.ndarray, max_tokens: int) -> list[np.ndarray]:
    """Micro-batches of consecutive rows whose token sums stay within ``max_tokens``; a row
    longer than the budget is a micro-batch of its own. Consecutive, so a row's position in
    the mini-batch (and any seeded order) is kept.

    Shape: lengths (batch,) -> arrays of row indices, in order, together every row once.
    """
    if max_tokens < 1:
        raise AlgoError(f"max_tokens must be >= 1, got {max_tokens}")
    out: list[np.ndarray] = []
    start, used = 0, 0
    lengths = np.asarray(lengths, dtype=np.int64)
    for i, tokens in enumerate(lengths.tolist()):
        if i > start and used + tokens > max_tokens:
            out.append(np.arange(start, i, dtype=np.int64))
            start, used = i, 0
        used += tokens
    if start < len(lengths):
        out.append(np.arange(start, len(lengths), dtype=np.int64))
    return out
