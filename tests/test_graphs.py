"""Every graph shipped in graphs/ (subfolders included) validates, plans, places, explains."""

from __future__ import annotations

from pathlib import Path

import pytest

from dapo_flow.graph.compiler import load, place, plan, validate
from dapo_flow.graph.explain import explain
from dapo_flow.graph.plan import Cluster

ROOT = Path(__file__).resolve().parents[1]
# graphs/ablations/ holds patch files (variants of a graph), checked by tests/test_sweep.py
GRAPHS = sorted(p for p in (ROOT / "graphs").glob("**/*.yaml") if "ablations" not in p.parts)


def test_there_are_graphs():
    assert {p.name for p in GRAPHS} >= {"dapo.yaml", "grpo.yaml"}


@pytest.mark.parametrize("path", GRAPHS, ids=lambda p: str(p.relative_to(ROOT / "graphs")))
def test_graph_compiles(path: Path):
    text = path.read_text()
    assert text.startswith("#"), "a graph opens with a comment: what it is, how to run it"
    assert "dapo-flow run" in text
    valid = validate(load(path))
    placed = place(plan(valid), Cluster(cpus=2))
    assert placed.plan.nodes
    assert set(placed.node_stage) == {n.id for n in placed.plan.nodes}
    assert sum(s.num_cpus for s in placed.stages if s.kind == "actor") <= 2
    assert f"graph {valid.spec.name}" in explain(placed)


def test_the_moe_graph_explains_its_experts_and_active_parameters():
    """graphs/moe.yaml's policy is builtin:tiny-moe: explain prints its experts and its
    parameters, all of them and those a token runs through, without building it."""
    placed = place(plan(validate(load(ROOT / "graphs" / "moe.yaml"))), Cluster(cpus=2))
    assert ("builtin:tiny-moe (float32, hf, device auto, trained by 2 worker(s) with ddp, 4 experts top-2 in 2 of 2 "
            "layers: 233k parameters, 134k active per token; experts not split across workers)") in explain(placed)
