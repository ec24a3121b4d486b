"""REINFORCE++ end to end: the `advantage` operator's token-level estimator emits token_advantage,
`update` resolves to train on it (compile-time column check included), and a short run trains."""

from __future__ import annotations

import math

from dapo_flow.graph.compiler import compile_graph
from dapo_flow.graph.explain import explain
from dapo_flow.graph.plan import Cluster
from dapo_flow.runtime import execute
from dapo_flow.tracking import read_run

CLUSTER = Cluster(cpus=2)


def test_a_reinforce_pp_graph_compiles_and_trains(workdir, small_graph):
    path = small_graph(workdir, steps=2, ckpt=0)
    path.write_text(path.read_text().replace(
        "{id: adv, op: advantage, inputs: [old_logp]}",
        "{id: adv, op: advantage, inputs: [old_logp], params: {estimator: reinforce_pp, gamma: 0.99}}"))
    placed = compile_graph(path, CLUSTER)
    text = explain(placed)
    assert "adds     token_advantage:list<float>" in text
    assert placed.plan.node("train").params.advantage_column == "token_advantage"
    summary = execute(placed, executor="local")
    history = read_run(summary["tracking_uri"], summary["run_id"])["history"]
    assert [s for s, _ in history["actor/pg_loss"]] == [1, 2]
    assert all(math.isfinite(v) for _, v in history["actor/grad_norm"])
    # whitened over the batch's valid tokens: mean ~0
    assert all(abs(v) < 1e-4 for _, v in history["adv/mean"])
