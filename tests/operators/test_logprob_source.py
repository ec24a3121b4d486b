"""logprob `source: rollout`: the generator's sampled-token logprobs become the old ones."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from pydantic import ValidationError

from dapo_flow.core import columns as C
from dapo_flow.core.contract import OpContext, produces, requires
from dapo_flow.graph.edits import edit_file, parse_cli_edits
from dapo_flow.graph.plan import Cluster
from dapo_flow.operators.logprob import Logprob, Params

DAPO = str(Path(__file__).resolve().parents[2] / "graphs" / "dapo.yaml")


def test_rollout_source_copies_the_generators_logprobs_without_a_model():
    params = Params(source="rollout")
    batch = pa.table({
        C.PROMPT_IDS: pa.array([[1, 2], [3]], C.SCHEMA[C.PROMPT_IDS]),
        C.RESPONSE_IDS: pa.array([[4, 5, 6], [7]], C.SCHEMA[C.RESPONSE_IDS]),
        C.ROLLOUT_LOGP: pa.array([[-0.5, -1.25, -2.0], [-0.75]], C.TOKEN_FLOATS),
    })
    op = Logprob(params, OpContext(node_id="old_logp", seed=0, model=None))  # no model: no forward pass
    out = op(batch)
    assert out.column(C.OLD_LOGP).to_pylist() == [[-0.5, -1.25, -2.0], [-0.75]]
    assert out.schema.field(C.OLD_LOGP).type == C.SCHEMA[C.OLD_LOGP]
    assert C.ENTROPY not in out.column_names and op.last_metrics() == {}


def test_rollout_source_declares_its_columns_and_is_the_actors_only():
    rollout, recompute = Params(source="rollout"), Params()
    assert C.ROLLOUT_LOGP in requires(Logprob, rollout) and C.ROLLOUT_LOGP not in requires(Logprob, recompute)
    assert set(produces(Logprob, rollout)) == {C.OLD_LOGP}
    assert set(produces(Logprob, recompute)) == {C.OLD_LOGP, C.ENTROPY}
    with pytest.raises(ValidationError, match="use source: recompute for role ref"):
        Params(role="ref", source="rollout")


def test_the_source_is_a_one_line_edit_and_decides_where_the_node_runs():
    """graphs/dapo.yaml takes rollout logprobs: a column copy of each row alone, so the training
    group's workers make it on their shares at the head of the update's call (no round trip of
    its own); recomputing them is a forward pass of the model, a call of its own to the workers."""
    rollout = edit_file(DAPO, []).compile(Cluster(cpus=2))
    assert rollout.plan.node("old_logp").params.source == "rollout"
    assert rollout.node_stage["old_logp"] == "model:policy"
    assert [c.nodes for c in rollout.calls["train"]] == [("old_logp", "adv", "train")]
    recompute = edit_file(DAPO, parse_cli_edits([("set", "old_logp.source=recompute")])).compile(Cluster(cpus=2))
    assert recompute.plan.node("old_logp").params.source == "recompute"
    assert recompute.node_stage["old_logp"] == "model:policy"
    assert [c.nodes for c in recompute.calls["train"]] == [("old_logp",), ("adv",), ("train",)]
