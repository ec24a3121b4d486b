"""Routing replay in the plan: a generate node on a model with train.routing_replay declares the
`routed_experts` column (PRODUCES_WITH_TRAIN), so explain shows it and the column checks see it;
a node needing it without replay on, or a rollout that records no routes, is a validate problem.
Validate and explain only: no model is built (tiny-moe's config.json is read as declared)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from dapo_flow.core import columns as C
from dapo_flow.errors import GraphError
from dapo_flow.graph.compiler import load, place, plan, validate
from dapo_flow.graph.explain import explain
from dapo_flow.graph.plan import Cluster

ROOT = Path(__file__).resolve().parents[1]
MOE_TRAIN = "train: {workers: auto, strategy: ddp}"
REPLAY_TRAIN = "train: {workers: auto, strategy: ddp, routing_replay: true}"

# a sink that reads the routes (a custom metrics op); TYPE is the Arrow type it requires them as
NEEDS_ROUTES = '''
import pyarrow as pa
from pydantic import BaseModel, ConfigDict


class NeedsRoutes:
    class Params(BaseModel):
        model_config = ConfigDict(frozen=True, extra="forbid")

    REQUIRES = {"routed_experts": TYPE}
    PRODUCES = {}
    CARDINALITY = "sink"
    NEEDS_MODEL = False

    def __init__(self, params, ctx):
        pass

    def __call__(self, batch):
        return pa.table({"rows": [batch.num_rows]})
'''


def _moe_graph(tmp_path: Path, replay: bool, probe_type: str | None = None) -> Path:
    """graphs/moe.yaml with routing replay on or off; with ``probe_type``, a custom sink reading
    `routed_experts` as that Arrow type after the advantage node."""
    text = (ROOT / "graphs" / "moe.yaml").read_text()
    assert MOE_TRAIN in text
    text = text.replace(MOE_TRAIN, REPLAY_TRAIN if replay else MOE_TRAIN)
    if probe_type is not None:
        module = f"probe_{len(list(tmp_path.glob('probe_*.py')))}.py"  # a file per class: loads are cached
        (tmp_path / module).write_text(NEEDS_ROUTES.replace("TYPE", probe_type))
        text += f"\n  - {{id: probe, op: custom, impl: \"{module}:NeedsRoutes\", inputs: [adv]}}\n"
    path = tmp_path / "g.yaml"
    path.write_text(text)
    return path


def test_replay_adds_routed_experts_to_the_generate_nodes_columns(tmp_path):
    valid = validate(load(_moe_graph(tmp_path, replay=True)))
    assert valid.out_schema["rollout"].field(C.ROUTED_EXPERTS).type == C.ROUTED == pa.list_(pa.int16())
    assert C.ROUTED_EXPERTS in valid.in_schema["train"].names  # carried to the update
    text = explain(place(plan(valid), Cluster(cpus=2)))
    rollout = text.split("    rollout [generate, expand]")[1].splitlines()
    adds = next(line for line in rollout if line.strip().startswith("adds"))
    assert adds.endswith("rollout_version:list<int32>, routed_experts:list<int16>")
    off = validate(load(_moe_graph(tmp_path, replay=False)))
    assert C.ROUTED_EXPERTS not in off.out_schema["rollout"].names
    assert "routed_experts" not in explain(place(plan(off), Cluster(cpus=2)))


def test_a_node_needing_routes_without_replay_is_told_the_setting(tmp_path):
    with pytest.raises(GraphError) as err:
        validate(load(_moe_graph(tmp_path, replay=False, probe_type="pa.list_(pa.int16())")))
    message = str(err.value)
    assert "node 'probe'" in message and "requires column 'routed_experts' (list<int16>)" in message
    assert ("turn on `train.routing_replay` of model 'policy' (models.policy.train.routing_replay: true): "
            "node 'rollout' then adds 'routed_experts'") in message
    # with replay on the same graph validates, and the edge's type is checked
    validate(load(_moe_graph(tmp_path, replay=True, probe_type="pa.list_(pa.int16())")))
    with pytest.raises(GraphError, match=r"requires column 'routed_experts' as list<int32>, but 'rollout' "
                                         r"gives list<int16>"):
        validate(load(_moe_graph(tmp_path, replay=True, probe_type="pa.list_(pa.int32())")))


def _on_tiny_moe(tmp_path: Path, graph: str) -> Path:
    """graphs/GRAPH with its policy builtin:tiny-moe under routing replay."""
    text = (ROOT / "graphs" / graph).read_text()
    policy = '    path: "builtin:tiny-agent"\n    dtype: float32\n    backend: hf\n'
    assert policy in text
    moe = policy.replace("builtin:tiny-agent", "builtin:tiny-moe") + "    train: {routing_replay: true}\n"
    path = tmp_path / graph
    path.write_text(text.replace(policy, moe))
    return path


def test_a_multi_turn_rollout_records_routes_for_replay(tmp_path):
    """agent-generate stitches each episode's routes across its turns (tests/agent/test_agent_routing_replay.py)."""
    path = _on_tiny_moe(tmp_path, "agent.yaml")
    budget = "      max_tokens: 64 "
    assert budget in path.read_text()
    path.write_text(path.read_text().replace(budget, "      max_tokens: 32 "))  # tiny-moe's context is 64
    valid = validate(load(path))
    assert valid.out_schema["rollout"].field(C.ROUTED_EXPERTS).type == C.ROUTED
    assert C.ROUTED_EXPERTS in valid.in_schema["train"].names


def test_a_harness_rollout_records_no_routes_and_refuses_replay(tmp_path):
    """harness-generate's agents call an endpoint whose answers carry no experts: nothing to replay."""
    with pytest.raises(GraphError) as err:
        validate(load(_on_tiny_moe(tmp_path, "harness.yaml")))
    assert ("op 'harness-generate' records no expert routes (column 'routed_experts'), but its model 'policy' "
            "trains with train.routing_replay") in str(err.value)
    assert ("fix: set models.policy.train.routing_replay: false, or roll out with op 'generate' or op "
            "'agent-generate'") in str(err.value)


def test_a_column_declared_under_a_setting_no_model_has_is_a_contract_problem(tmp_path):
    (tmp_path / "typo.py").write_text(NEEDS_ROUTES.replace("TYPE", "pa.list_(pa.int16())").replace(
        '    PRODUCES = {}\n', '    PRODUCES = {}\n    PRODUCES_WITH_TRAIN = {"routing_replays": {"x": pa.int32()}}\n'))
    path = _moe_graph(tmp_path, replay=True)
    path.write_text(path.read_text() + '\n  - {id: probe, op: custom, impl: "typo.py:NeedsRoutes", inputs: [adv]}\n')
    with pytest.raises(GraphError, match=r"`PRODUCES_WITH_TRAIN` names train.routing_replays, which is not a model "
                                         r"setting \(did you mean 'routing_replay'\?\)"):
        validate(load(path))
