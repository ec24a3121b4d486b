"""`explain` says where a harness node's endpoint will serve (no model, no server)."""

from __future__ import annotations

from pathlib import Path

from dapo_flow.graph.explain import explain
from dapo_flow.graph.edits import edit_file, parse_cli_edits

GRAPH = Path(__file__).resolve().parents[2] / "graphs" / "harness.yaml"


def test_explain_prints_the_endpoint_address():
    text = explain(edit_file(str(GRAPH), []).compile(None))
    assert ("      endpoint http://127.0.0.1:PORT/v1 in its model's process, PORT a free one, a bearer token "
            "per run (printed when it starts)\n") in text
    pinned = explain(edit_file(str(GRAPH), parse_cli_edits([("set", "rollout.port=8011")])).compile(None))
    assert "endpoint http://127.0.0.1:8011/v1 in its model's process, a bearer token" in pinned
