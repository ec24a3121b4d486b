"""The default graph really trains: an in-process run of graphs/dapo.yaml raises held-out
accuracy (sampled avg@4 on 200 val prompts) by a clear margin. Measured: 0.22 -> 0.35 in
120 steps (~15 s on 2 cores); asserted loosely."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from dapo_flow.compiler import compile_graph
from dapo_flow.plan import Cluster
from dapo_flow.runtime import execute

GRAPH = Path(__file__).resolve().parents[1] / "graphs" / "dapo.yaml"


@pytest.mark.slow
def test_dapo_graph_raises_val_accuracy(tmp_path, monkeypatch, tiny_adder_path):
    monkeypatch.chdir(tmp_path)
    summary = execute(compile_graph(GRAPH, Cluster(cpus=2)), executor="local",
                      console=Console(file=open(tmp_path / "log.txt", "w")))
    gain = summary["val_acc_end"] - summary["val_acc_start"]
    assert gain >= 0.08, summary
    assert summary["last_metrics"]["actor/entropy"] < 1.4  # the policy sharpened
