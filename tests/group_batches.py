"""The batches the training-group tests train on (tests/runtime/test_training_group.py over gloo
on Ray, tests/gpu/test_gpu_groups.py over NCCL): one builder, so both train on the same rows."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from dapo_flow.core import columns as C


def group_batch(seed: int, group_sizes: list[int]) -> pa.Table:
    """Rows of prompt groups with responses, rollout logprobs and advantages; uneven groups so
    the workers get different row and micro-batch counts (one gets a single row)."""
    rng = np.random.default_rng(seed)
    rows = sum(group_sizes)
    lengths = rng.integers(1, 7, rows)
    return pa.table({
        C.PROMPT_ID: pa.array([f"g{g}" for g, size in enumerate(group_sizes) for _ in range(size)]),
        C.PROMPT_IDS: pa.array([rng.integers(3, 14, rng.integers(3, 6)).tolist() for _ in range(rows)], C.TOKENS),
        C.RESPONSE_IDS: pa.array([rng.integers(3, 14, n).tolist() for n in lengths], C.TOKENS),
        C.OLD_LOGP: pa.array([rng.uniform(-3.0, -0.5, n).tolist() for n in lengths], C.TOKEN_FLOATS),
        C.ADVANTAGE: pa.array(rng.normal(size=rows), pa.float32()),
    })


#: two steps' batches: 11 rows in 3 groups, 10 rows in 4
BATCHES = [group_batch(1, [8, 1, 2]), group_batch(2, [2, 3, 1, 4])]
