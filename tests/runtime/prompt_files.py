"""Prompt files for tests: the built-in addition task written as a verl-style parquet."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from dapo_flow.data.tasks import AdditionTask


def verl_parquet(path, rows: int = 300, row_group: int = 64, bad: frozenset[int] = frozenset()) -> None:
    """``rows`` addition problems (train split) in verl's layout (prompt, reward_model.ground_truth,
    data_source); rows in ``bad`` get an empty prompt."""
    problems = AdditionTask().problems("train")[:rows]
    pq.write_table(pa.table({
        "prompt": ["" if i in bad else p.prompt for i, p in enumerate(problems)],
        "reward_model": [{"ground_truth": p.answer} for p in problems],
        "data_source": ["addition"] * len(problems),
    }), path, row_group_size=row_group)
