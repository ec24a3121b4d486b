"""Validation metrics summed batch by batch, so that a validation or `dapo-flow eval` set of
any size streams through generation and grading in batches and ends with the numbers one
pass over the whole set would give.

Every batch holds whole prompts (all n samples of a prompt are generated in one call), so
pass@k, a mean over prompts, sums exactly: per batch, its prompts' mean times their count.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from dapo_flow import algos
from dapo_flow.algos.metrics import source_sums
from dapo_flow.data.arrow_utils import group_codes
from dapo_flow.core import columns as C

SAMPLE_COLUMNS = (C.PROMPT_TEXT, C.RESPONSE_TEXT, C.GROUND_TRUTH, C.SCORE, C.ACC,
                  C.NUM_TURNS, C.NUM_TOOL_CALLS, C.TOOL_ERRORS, C.CONVERSATION)  # agent-generate's, when there


def pass_ks(n: int) -> list[int]:
    """The k of the pass@k metrics at n samples per prompt: 2, 4, 8, ... and n (none for n = 1)."""
    return sorted({2 ** i for i in range(1, n.bit_length())} | {n}) if n > 1 else []


class ValidationTally:
    """Graded validation batches in -> avg@n accuracy (``val/acc``), mean score and response
    length, unbiased pass@k, accuracy and score per data source (``val/SOURCE/acc``,
    ``val/SOURCE/score``); and the first ``log_samples`` samples to log."""

    def __init__(self, n: int, log_samples: int):
        self.n, self.log_samples = n, log_samples
        self.rows = 0
        self.prompts = 0
        self.sums = {C.ACC: 0.0, C.SCORE: 0.0, C.RESPONSE_LEN: 0.0}
        self.pass_sums = {k: 0.0 for k in pass_ks(n)}
        self.pass_prompts = {k: 0 for k in pass_ks(n)}
        self.samples: list[dict] = []
        self.by_source: dict[str, dict[str, tuple[float, int]]] = {C.ACC: {}, C.SCORE: {}}  # source -> (sum, rows)

    def add(self, graded: pa.Table) -> None:
        """One graded batch (the reward node's output over whole prompts)."""
        if graded.num_rows == 0:
            return
        self.rows += graded.num_rows
        for col in self.sums:
            self.sums[col] += float(np.sum(graded.column(col).to_numpy()))
        groups = group_codes(graded.column(C.PROMPT_ID))
        sizes = np.bincount(groups.codes, minlength=groups.n_groups)
        self.prompts += groups.n_groups
        acc = graded.column(C.ACC).to_numpy()
        for k in self.pass_sums:
            counted = int((sizes >= k).sum())
            if counted:
                self.pass_sums[k] += algos.pass_at_k(groups, acc, k) * counted
                self.pass_prompts[k] += counted
        if C.DATA_SOURCE in graded.column_names:
            sources = graded.column(C.DATA_SOURCE).to_pylist()
            for col, tally in self.by_source.items():
                for name, (total, count) in source_sums(sources, graded.column(col).to_numpy()).items():
                    old = tally.get(name, (0.0, 0))
                    tally[name] = (old[0] + total, old[1] + count)
        if len(self.samples) < self.log_samples:
            cols = [c for c in SAMPLE_COLUMNS if c in graded.column_names]
            self.samples += graded.select(cols).slice(0, self.log_samples - len(self.samples)).to_pylist()

    def result(self) -> dict[str, float]:
        """The metrics of every batch added so far (empty before the first)."""
        if not self.rows:
            return {}
        out = {
            "val/acc": self.sums[C.ACC] / self.rows,
            "val/score": self.sums[C.SCORE] / self.rows,
            "val/response_len_mean": self.sums[C.RESPONSE_LEN] / self.rows,
        }
        for col, tally in self.by_source.items():  # per data_source, as verl's val-core/SOURCE/...
            out.update({f"val/{name}/{col}": total / count for name, (total, count) in tally.items()})
        for k, total in self.pass_sums.items():
            if self.pass_prompts[k]:
                out[f"val/pass_at_{k}"] = total / self.pass_prompts[k]
        return out
