"""Deterministic prompt order: a seeded permutation per epoch and a cursor to resume from."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from dapo_flow.core import columns as C
from dapo_flow.data.arrow_utils import with_columns
from dapo_flow.errors import DataError


@dataclass
class PromptSampler:
    table: pa.Table
    seed: int
    epoch: int = 0
    cursor: int = 0

    def __post_init__(self) -> None:
        # An empty table would make next() loop forever on empty permutations (the loader
        # already refuses empty sources; this guards every other way a table gets here).
        if self.table.num_rows == 0:
            raise DataError("no prompts to sample from: the prompt table has 0 rows")

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.table.num_rows)

    def next(self, k: int) -> pa.Table:
        """The next ``k`` prompts; group ids get an epoch suffix so a prompt seen again in a
        later epoch never merges with its earlier group."""
        idx, ids = [], []
        base = self.table.column(C.PROMPT_ID).to_pylist()
        while len(idx) < k:
            order = self._order(self.epoch)
            take = order[self.cursor : self.cursor + (k - len(idx))]
            idx.extend(take.tolist())
            ids.extend(f"{base[i]}@{self.epoch}" for i in take)
            self.cursor += len(take)
            if self.cursor >= len(order):
                self.epoch, self.cursor = self.epoch + 1, 0
        return with_columns(self.table.take(pa.array(idx, pa.int64())), {C.PROMPT_ID: ids})

    def state(self) -> dict:
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load(self, state: dict) -> None:
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
