"""`dapo-flow diff`: what differs between two effective graphs (graph files or MLflow run ids),
key by key (the comparison itself: :mod:`dapo_flow.graph.diff`). A run id reads the run's
``graph/effective.yaml`` artifact (or, for runs logged before edits existed, the graph file it
logged).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from rich.console import Console
from ruamel.yaml import YAML

from dapo_flow.errors import DapoFlowError
from dapo_flow.graph.diff import Change, diff_graphs
from dapo_flow.graph.loader import load

RUN_ID = re.compile(r"^[0-9a-f]{32}$")


def load_graph(ref: str, uri: str | None = None) -> tuple[str, dict[str, Any]]:
    """(label, raw graph) of a graph file or an MLflow run id."""
    if Path(ref).is_file():
        return ref, dict(load(ref).raw)
    if not RUN_ID.match(ref):
        raise DapoFlowError(f"{ref}: no such file, and not an MLflow run id (32 hex digits)")
    from dapo_flow.tracking import artifact_paths, default_tracking_uri, find_run, read_artifact_text

    uri = uri or default_tracking_uri()
    if find_run(uri, ref) is None:
        raise DapoFlowError(f"{ref}: no such file, and no such run in {uri}")
    name = "graph/effective.yaml"
    text = read_artifact_text(uri, ref, name)
    if text is None:  # a run logged before edits existed: the graph file itself
        name = next((p for p in artifact_paths(uri, ref, "graph") if p.endswith((".yaml", ".yml"))), "")
        text = read_artifact_text(uri, ref, name) if name else None
    if text is None:
        raise DapoFlowError(f"run {ref} has no graph artifact (graph/effective.yaml or graph/*.yaml)")
    raw = YAML(typ="safe", pure=True).load(text)
    if not isinstance(raw, dict):
        raise DapoFlowError(f"run {ref}: {name} is not a graph mapping")
    return f"run {ref[:8]} ({name})", raw


def print_diff(a: str, b: str, console: Console | None = None, uri: str | None = None) -> list[Change]:
    console = console or Console(highlight=False)
    (la, ga), (lb, gb) = load_graph(a, uri), load_graph(b, uri)
    changes = diff_graphs(ga, gb)
    console.print(f"--- {la}", style="red", markup=False)
    console.print(f"+++ {lb}", style="green", markup=False)
    style = {"removed": "red", "added": "green", "changed": "yellow"}
    sign = {"removed": "-", "added": "+", "changed": "~"}
    for c in changes:
        console.print(f"{sign[c.kind]} {c.render()}", style=style[c.kind], markup=False, highlight=False)
    n = len(changes)
    console.print("no differences" if not n else f"{n} difference{'s' if n != 1 else ''}")
    return changes
