"""The compiler: golden explain output, placement, rewrites, and every broken graph in
tests/graphs_bad/ failing with the located message its `# expect:` lines promise."""

from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path

import pytest

from dapo_flow import rewrites
from dapo_flow.contract import produces
from dapo_flow.compiler import compile_graph, explain, load, place, plan, validate
from dapo_flow.errors import GraphError, SchemaError, UnknownOperatorError
from dapo_flow.plan import Cluster

ROOT = Path(__file__).resolve().parents[1]
DAPO = ROOT / "graphs" / "dapo.yaml"
GRPO = ROOT / "graphs" / "grpo.yaml"
BAD = sorted((ROOT / "tests" / "graphs_bad").glob("*.yaml"))
GOLDEN = ROOT / "tests" / "golden"


def _plan(path: Path = DAPO):
    return plan(validate(load(path)))


def _with_placement(tmp_path: Path, placement: str) -> Path:
    """graphs/dapo.yaml plus a `placement:` block."""
    out = tmp_path / "dapo.yaml"
    out.write_text(DAPO.read_text() + "\n" + placement)
    return out


# --- golden explain ---------------------------------------------------------------------


@pytest.mark.parametrize("path", [DAPO, GRPO], ids=lambda p: p.stem)
def test_explain_golden(path: Path):
    text = explain(compile_graph(path, Cluster(cpus=2)))
    golden = GOLDEN / f"{path.stem}.explain.txt"
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text(), f"regenerate with UPDATE_GOLDEN=1 pytest {__file__}"


# --- loader -----------------------------------------------------------------------------


def test_line_of():
    doc = load(DAPO)
    lines = DAPO.read_text().splitlines()
    line = doc.line_of(("nodes", 6, "params", "clip_high"))
    assert lines[line - 1].strip() == "clip_high: 0.28"
    assert "id: verify" in lines[doc.line_of(("nodes", 1)) - 1]
    # a missing key falls back to its nearest enclosing key
    assert doc.line_of(("nodes", 1, "params", "nope")) == doc.line_of(("nodes", 1, "params"))
    assert doc.line_of(()) == 1


def test_missing_file(tmp_path):
    with pytest.raises(GraphError, match="nope.yaml: no such file"):
        load(tmp_path / "nope.yaml")


# --- validate ---------------------------------------------------------------------------


def test_schemas_propagate():
    p = _plan()
    assert "prompt_ids" in p.node("rollout").in_schema.names
    assert {"score", "acc", "reward"} <= set(p.node("overlong").out_schema.names)
    # a sink emits only its metrics
    train = p.node("train")
    assert set(train.out_schema.names) == set(produces(train.op_cls, train.params))


def test_error_class_follows_problem_kind():
    with pytest.raises(UnknownOperatorError):
        validate(load(ROOT / "tests/graphs_bad/bad_unknown_op.yaml"))
    with pytest.raises(SchemaError):
        validate(load(ROOT / "tests/graphs_bad/bad_missing_column.yaml"))


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.stem)
def test_bad_graph(path: Path):
    expects = [line.removeprefix("# expect:").strip() for line in path.read_text().splitlines()
               if line.startswith("# expect:")]
    assert expects, f"{path.name} needs `# expect:` lines"
    with pytest.raises(GraphError) as info:
        compile_graph(path, Cluster(cpus=2))
    text = str(info.value)
    at = 0
    for expect in expects:  # each appears, in order: problems are sorted by line
        found = text.find(expect, at)
        assert found >= 0, f"{expect!r} not in (or out of order in):\n{text}"
        at = found
    assert re.search(rf"{re.escape(path.name)}:\d+: ", text), "every problem names file:line"


def test_enough_bad_graphs():
    assert len(BAD) >= 30


def test_multiple_problems_sorted():
    with pytest.raises(GraphError) as info:
        validate(load(ROOT / "tests/graphs_bad/bad_multiple.yaml"))
    problems = info.value.problems
    assert len(problems) >= 4
    assert [p.line for p in problems] == sorted(p.line for p in problems)


# --- rewrites ---------------------------------------------------------------------------


def test_group_barrier():
    p = _plan()
    assert p.group_filter == "dynamic_sampling"
    assert p.rollout == ("rollout", "verify", "overlong", "dynamic_sampling")
    assert p.train == ("old_logp", "adv", "train")
    g = _plan(GRPO)
    assert g.group_filter is None and g.rollout == ()
    assert g.train == tuple(n.id for n in g.nodes)


def test_fuse_cpu_maps():
    p = _plan()
    assert p.fused == (("verify", "overlong"),)  # the group barrier stops the run
    assert _plan(GRPO).fused == ()  # verify -> old_logp needs the model


def test_weight_sync():
    assert _plan().syncs == (("train", "policy"),)


def test_rewrites_are_pure():
    p = _plan()
    bare = replace(p, rollout=(), group_filter=None, train=(), syncs=(), fused=())
    for rule in rewrites.REWRITES:
        before = bare
        after = rule(bare)
        assert before == bare and after is not bare
    assert rewrites.add_weight_syncs(bare).syncs == p.syncs
    assert rewrites.mark_group_barrier(bare).rollout == p.rollout
    assert rewrites.fuse_cpu_maps(bare).fused == (("verify", "overlong"),)


# --- placement --------------------------------------------------------------------------


def test_colocated_on_two_cpus():
    placed = place(_plan(), Cluster(cpus=2))
    assert [s.name for s in placed.stages] == ["driver", "model:policy"]
    actor = placed.stage("model:policy")
    # adv sits between two nodes of the actor, so it is pulled into the actor (one call)
    assert actor.nodes == ("rollout", "old_logp", "adv", "train") and actor.models == ("policy",)
    assert (actor.num_cpus, actor.num_gpus) == (1.0, 0.0)
    assert placed.stage("driver").nodes == ("verify", "overlong", "dynamic_sampling")
    assert placed.node_stage["train"] == "model:policy"
    with pytest.raises(TypeError):
        placed.node_stage["train"] = "driver"  # read-only


def test_disaggregated(tmp_path):
    path = _with_placement(tmp_path, "placement: {mode: disaggregated}\n")
    placed = place(plan(validate(load(path))), Cluster(cpus=2))
    assert [s.name for s in placed.stages] == ["driver", "rollout:policy", "model:policy"]
    assert placed.stage("rollout:policy").nodes == ("rollout",)
    assert placed.stage("model:policy").nodes == ("old_logp", "adv", "train")
    # 2 actors + driver on 2 CPUs: fractional shares, nobody starves
    assert placed.stage("model:policy").num_cpus == pytest.approx(2 / 3)


def test_gpu_cluster():
    placed = place(_plan(), Cluster(cpus=16, gpus=2))
    assert placed.stage("model:policy").num_gpus == 1.0
    assert placed.stage("model:policy").num_cpus == 1.0
    assert placed.stage("driver").num_cpus == 15.0


def test_too_few_gpus_for_default_falls_back_to_cpu(tmp_path):
    path = _with_placement(tmp_path, "placement: {mode: disaggregated}\n")
    placed = place(plan(validate(load(path))), Cluster(cpus=8, gpus=1))
    assert {s.num_gpus for s in placed.stages} == {0.0}


def test_explicit_resources(tmp_path):
    path = _with_placement(tmp_path, "placement:\n  models:\n    policy: {num_gpus: 2, num_cpus: 4}\n")
    placed = place(plan(validate(load(path))), Cluster(cpus=8, gpus=2))
    assert (placed.stage("model:policy").num_cpus, placed.stage("model:policy").num_gpus) == (4, 2)


def test_too_many_gpus(tmp_path):
    path = _with_placement(tmp_path, "placement:\n  models:\n    policy: {num_gpus: 4}\n")
    p = plan(validate(load(path)))
    with pytest.raises(GraphError, match=r"dapo.yaml:\d+: placement.models.policy.num_gpus: .* 4 GPU") as info:
        place(p, Cluster(cpus=8, gpus=2))
    assert "cluster has 2" in str(info.value)
    place(p, Cluster(cpus=8, gpus=4))  # fits


def test_cluster_local():
    c = Cluster.local()
    assert c.cpus >= 1 and c.gpus >= 0 and c.nodes == 1


def test_plan_pickles():
    """The runtime may ship the plan to Ray actors."""
    import pickle

    p = _plan()
    assert pickle.loads(pickle.dumps(p)) == p


def test_explain_names_auto_generation_batches():
    from dapo_flow.edits import edit_file, parse_cli_edits

    placed = edit_file(ROOT / "graphs" / "dapo.yaml",
                       parse_cli_edits([("set", "run.gen_prompts_per_batch=auto")])).compile(Cluster(cpus=2))
    assert "generation batches sized from the keep rate so far (auto)" in explain(placed)
