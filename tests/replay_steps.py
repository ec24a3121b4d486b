"""One `update` step on rollout rows with routing replay on or off: the replay tests of single-turn
(tests/operators/test_routing_replay_ops.py) and multi-turn rows (tests/agent/
test_agent_routing_replay.py) compare the two steps."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from dapo_flow.core import columns as C
from dapo_flow.core.contract import OpContext


def update_step(model, rows: pa.Table, micro_batch_size: int) -> tuple[dict, dict]:
    """``model`` (a trainable MoE's resource) takes one update on ``rows`` (old logprobs the
    rollout's, advantages spread over [-1, 1]); its metrics and weights after it."""
    from dapo_flow.operators.update import Params, Update

    batch = rows.append_column(C.OLD_LOGP, rows.column(C.ROLLOUT_LOGP)).append_column(
        C.ADVANTAGE, pa.array(np.linspace(-1, 1, rows.num_rows, dtype=np.float32)))
    op = Update(Params(lr=1e-2, micro_batch_size=micro_batch_size, grad_clip=1e9), OpContext("train", model=model))
    op(batch)
    return op.last_metrics(), {k: v.detach().clone() for k, v in model.policy.model.state_dict().items()}
