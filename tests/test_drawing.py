"""DAG pictures: mermaid text and images."""

from __future__ import annotations

from pathlib import Path

import pytest

from dapo_flow.graph.compiler import compile_graph
from dapo_flow.graph.drawing import draw, edge_label, mermaid, to_networkx
from dapo_flow.errors import DapoFlowError
from dapo_flow.graph.plan import Cluster

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def placed():
    return compile_graph(ROOT / "graphs" / "dapo.yaml", Cluster(cpus=2))


def test_edges_carry_added_columns(placed):
    g = to_networkx(placed.plan)
    assert g.edges["verify", "overlong"]["columns"] == ["score", "acc"]
    assert g.edges["dynamic_sampling", "old_logp"]["columns"] == []  # a filter adds nothing
    assert g.nodes["train"]["op"] == "update"


def test_edge_label_abbreviates():
    assert edge_label(["a", "b"]) == "a, b"
    assert edge_label(["a", "b", "c", "d"]) == "a, b +2"


def test_mermaid(placed):
    text = mermaid(placed)
    assert text.startswith("flowchart TD")
    assert 'subgraph s_model_policy["model:policy"]' in text
    assert 'n_verify -->|"score, acc"| n_overlong' in text
    assert "n_prompts([prompts])" in text


@pytest.mark.parametrize("suffix, magic", [(".png", b"\x89PNG"), (".svg", b"<?xml"), (".mmd", b"flowchart")])
def test_draw_files(placed, tmp_path, suffix, magic):
    out = draw(placed, tmp_path / f"dag{suffix}")
    assert out.read_bytes().startswith(magic)


def test_draw_unknown_format(placed, tmp_path):
    with pytest.raises(DapoFlowError, match="use one of"):
        draw(placed, tmp_path / "dag.jpg")
