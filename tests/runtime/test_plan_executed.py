"""What runs is what `explain` prints: a real run's call log (every round trip the Runner made,
and every weight sync) holds exactly the placed plan's calls, phase by phase, and each of them
is printed by explain."""

from __future__ import annotations

from collections import Counter

from dapo_flow.graph.compiler import compile_graph
from dapo_flow.graph.explain import explain
from dapo_flow.graph.plan import Cluster
from dapo_flow.runtime import execute

CLUSTER = Cluster(cpus=2)


def _check_log_is_the_plan(placed, log: list) -> None:
    text = explain(placed)
    planned = {phase: [(c.stage, c.nodes) for c in calls] for phase, calls in placed.calls.items()}
    by_phase: dict[str, list] = {}
    for phase, stage, nodes in log:
        by_phase.setdefault(phase, []).append((stage, tuple(nodes)))
    for phase, calls in planned.items():
        made = by_phase.pop(phase)
        # every call made is a planned one, and each planned call ran equally often (once per
        # chunk of every generation batch in the rollout phase, once per step in train)
        counts = Counter(made)
        assert set(counts) == set(calls), phase
        assert len(set(counts.values())) == 1, counts
        if phase != "rollout":  # rollout queues every chunk's generation first (streaming)
            assert made == calls * (len(made) // len(calls))
    for stage, nodes in planned.get("train", planned.get("step")):
        for nid in nodes:
            assert f"{nid} [" in text and f"@ {stage}" in text
        if len(nodes) > 1:
            assert f"one call @ {stage}: {' -> '.join(nodes)}" in text
    syncs = by_phase.pop("sync", [])
    assert Counter((src, tgt_kind) for src, tgt_kind in syncs) == Counter(
        {(s.source, (s.target, s.kind)): len(syncs) // max(len(placed.syncs), 1) for s in placed.syncs})
    for s in placed.syncs:
        assert f"sync weights: {s.after}" in text
    gen, grade = placed.plan.first("generate"), placed.plan.first("reward")
    assert set(by_phase.pop("validate")) == {(placed.node_stage[gen.id], (gen.id,)),
                                             (placed.node_stage[grade.id], (grade.id,))}
    assert by_phase == {}


def test_a_colocated_run_makes_exactly_the_planned_calls(workdir, small_graph):
    placed = compile_graph(small_graph(workdir, steps=2, ckpt=0), CLUSTER)
    summary = execute(placed, executor="local")
    _check_log_is_the_plan(placed, summary["call_log"])
    assert not any(phase == "sync" for phase, _, _ in summary["call_log"])  # hf: same policy


def test_a_disaggregated_run_makes_the_planned_calls_and_transfers(workdir, small_graph):
    path = small_graph(workdir, steps=2, ckpt=0)
    path.write_text(path.read_text() + "placement: {mode: disaggregated}\n")
    placed = compile_graph(path, CLUSTER)
    assert [s.kind for s in placed.syncs] == ["transfer"]
    summary = execute(placed, executor="local")
    _check_log_is_the_plan(placed, summary["call_log"])
    assert [e for e in summary["call_log"] if e[0] == "sync"] == [
        ("sync", "model:policy", ("rollout:policy", "transfer"))] * 2  # once per step
