"""A mixture's prompt order (``data.train.sources``): a stratified, seeded draw whose counts
follow the weights exactly over the run, resumable from a checkpoint.

Counts. The k prompts of a draw are dealt one at a time, each to the source furthest below its
share of everything drawn so far (largest deficit ``share * (n + 1) - count``, ties to the first
source): after any number n of prompts, every source's count is within one of ``share * n``
(Tijdeman's bound for this rule), so weights hold exactly over a run whatever the batch size,
not just in expectation. Within a source, prompts come from its own seeded permutation per
epoch (:class:`PromptSampler`); the batch's rows are then put in a seeded random order, so the
sources interleave. The state is the counts, the number of draws and each source's cursor.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from dapo_flow.runtime.sampler import PromptSampler

ORDER_STREAM = 7  # the batch-order generator's key, apart from the sources' permutations


def deal(shares: list[float], counts: list[int], k: int) -> list[int]:
    """How many of the next ``k`` prompts each source gets, given ``counts`` drawn so far."""
    counts = list(counts)
    n = sum(counts)
    out = [0] * len(shares)
    for _ in range(k):
        n += 1
        i = max(range(len(shares)), key=lambda j: (shares[j] * n - counts[j], -j))
        counts[i] += 1
        out[i] += 1
    return out


class MixtureSampler:
    """``next(k)``: k prompts from ``tables`` in proportion to ``shares`` (summing to 1)."""

    def __init__(self, tables: list[pa.Table], shares: list[float], seed: int):
        if len(tables) != len(shares):
            raise ValueError(f"{len(tables)} sources for {len(shares)} shares")
        self.parts = [PromptSampler(t, seed + k) for k, t in enumerate(tables)]
        self.shares, self.seed = list(shares), seed
        self.counts = [0] * len(tables)
        self.draws = 0

    def next(self, k: int) -> pa.Table:
        take = deal(self.shares, self.counts, k)
        tables = [part.next(c) for part, c in zip(self.parts, take) if c]
        self.counts = [c + t for c, t in zip(self.counts, take)]
        batch = pa.concat_tables(tables)
        order = np.random.default_rng([self.seed, ORDER_STREAM, self.draws]).permutation(batch.num_rows)
        self.draws += 1
        return batch.take(pa.array(order, pa.int64()))

    def state(self) -> dict:
        return {"counts": list(self.counts), "draws": self.draws, "parts": [p.state() for p in self.parts]}

    def load(self, state: dict) -> None:
        if len(state["parts"]) != len(self.parts):
            raise ValueError(f"the checkpoint's mixture has {len(state['parts'])} sources, this graph's "
                             f"{len(self.parts)}")
        self.counts, self.draws = [int(c) for c in state["counts"]], int(state["draws"])
        for part, s in zip(self.parts, state["parts"]):
            part.load(s)
