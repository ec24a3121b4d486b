"""The compiler: golden explain output, placement, rewrites, and every broken graph in
tests/graphs_bad/ failing with the located message its `# expect:` lines promise."""

from __future__ import annotations

import copy
import os
import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from dapo_flow.graph import rewrites
from dapo_flow.core.contract import produces
from dapo_flow.graph.compiler import compile_graph, load, place, plan, validate
from dapo_flow.graph.explain import explain
from dapo_flow.errors import GraphError, SchemaError, UnknownOperatorError
from dapo_flow.graph.plan import Call, Cluster, Sync

ROOT = Path(__file__).resolve().parents[1]
DAPO = ROOT / "graphs" / "dapo.yaml"
GRPO = ROOT / "graphs" / "grpo.yaml"
BAD = sorted((ROOT / "tests" / "graphs_bad").glob("*.yaml"))
GOLDEN = ROOT / "tests" / "golden"


GROUP_LINE = "train: {workers: auto, strategy: ddp}"


ROLLOUT_LOGP_LINE = "params: {role: actor, source: rollout}"


def _one_worker_dapo() -> str:
    """graphs/dapo.yaml with its policy trained by one actor instead of a 2-worker DDP group, and
    old logprobs recomputed by it (a model node; with `source: rollout` it runs in the driver):
    the placement tests below are about where single actors and their nodes go."""
    text = DAPO.read_text()
    assert GROUP_LINE in text and ROLLOUT_LOGP_LINE in text
    return text.replace(GROUP_LINE, "train: {workers: 1}").replace(ROLLOUT_LOGP_LINE, "params: {role: actor}")


def _plan(path: Path | None = None):
    if path is None:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            one = Path(tmp) / "dapo.yaml"
            one.write_text(_one_worker_dapo())
            return plan(validate(load(one)))
    return plan(validate(load(path)))


def _with_placement(tmp_path: Path, placement: str) -> Path:
    """graphs/dapo.yaml (one training actor) plus a `placement:` block."""
    out = tmp_path / "dapo.yaml"
    out.write_text(_one_worker_dapo() + "\n" + placement)
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


@pytest.mark.timeout(10)
def test_alias_bomb_is_refused_fast():
    # 9 aliases per level, 10 levels: ~1 KB that expands to 9^10 values (validate grew past 11 GB;
    # the refusal takes ~0.25 s of CPU, the timeout is the guard against expanding it)
    with pytest.raises(GraphError, match=r"bad_alias_bomb.yaml:17: the document expands to more than 100,000"):
        load(ROOT / "tests/graphs_bad/bad_alias_bomb.yaml")


def test_aliases_within_the_limit_still_work(tmp_path):
    path = tmp_path / "g.yaml"
    path.write_text("name: g\nshared: &p {lr: 1.0e-4, clip_low: 0.2}\nnodes:\n  - {id: a, params: *p}\n"
                    "  - {id: b, params: {<<: *p, lr: 2.0e-4}}\n")
    raw = load(path).raw
    assert raw["nodes"][0]["params"] == {"lr": 1.0e-4, "clip_low": 0.2}
    assert raw["nodes"][1]["params"] == {"lr": 2.0e-4, "clip_low": 0.2}


@pytest.mark.timeout(30)  # the parser's scanner is quadratic in flow nesting: 250k levels took hours
@pytest.mark.parametrize("levels", [5000, 250_000])  # a RecursionError traceback once; then a hang
def test_nesting_deeper_than_the_parser_recurses_is_a_graph_error(tmp_path, levels):
    path = tmp_path / "deep.yaml"
    path.write_text("name: g\n# [[[[ in a comment\nnodes: '[[[' " + "[" * levels + "]" * levels + "\n")
    with pytest.raises(GraphError, match=r"deep.yaml:3: the document nests more than 100 levels deep"):
        load(path)


def test_graph_file_over_the_size_limit_is_refused(tmp_path):
    from dapo_flow.graph.loader import MAX_GRAPH_BYTES

    path = tmp_path / "big.yaml"
    path.write_text(DAPO.read_text() + "#" * MAX_GRAPH_BYTES)
    with pytest.raises(GraphError, match=r"big.yaml: the file is [\d,]+ bytes, over the 1,048,576-byte limit"):
        load(path)


@pytest.mark.timeout(30)
def test_many_comment_lines_load_fast_with_lines_kept(tmp_path, monkeypatch):
    # ruamel's round-trip scanner is quadratic in a block of comment lines (1 MiB of them took
    # 2.8 s of CPU here, and 200k lines minutes on a busy box): they are blanked before parsing
    from dapo_flow.graph import loader

    lines = DAPO.read_text().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.startswith("nodes:"))
    path = tmp_path / "commented.yaml"
    path.write_text("".join(lines[:at]) + "# note\n" * 20_000 + "".join(lines[at:]) + "      # tail\n" * 20_000)
    scanned = []  # what the round-trip parser was given

    class FakeRecordingYAML(loader.YAML):
        def load(self, stream):
            if self.typ == ["rt"]:
                scanned.append(stream)
            return super().load(stream)

    with monkeypatch.context() as patched:
        patched.setattr(loader, "YAML", FakeRecordingYAML)
        doc = load(path)
    assert len(scanned) == 1 and "# note" not in scanned[0] and "# tail" not in scanned[0]
    assert scanned[0].count("\n") == path.read_text().count("\n")  # blanked, not removed: lines kept
    assert doc.raw == load(DAPO).raw
    text = path.read_text().splitlines()
    assert text[doc.line_of(("nodes", 6, "params", "clip_high")) - 1].strip() == "clip_high: 0.28"


def test_comment_like_lines_inside_strings_survive_the_fast_path(tmp_path):
    notes = "# note\n" * 2_000  # enough comment lines for the fast path
    block = tmp_path / "block.yaml"  # blanked, it still parses, to another value: parsed as written
    block.write_text("name: g\ndescription: |\n  first\n  # text of the block\n" + notes + "nodes: []\n")
    doc = load(block)
    assert doc.raw["description"] == "first\n# text of the block\n"
    assert doc.line_of(("nodes",)) == 2_005
    quoted = tmp_path / "quoted.yaml"  # blanked, the quote never closes: parsed as written
    quoted.write_text('name: g\nquoted: "a\n  # also text"\n' + notes + "nodes: []\n")
    assert load(quoted).raw["quoted"] == "a # also text"
    tagged = tmp_path / "tagged.yaml"  # a tag the plain parser does not know: parsed as written
    tagged.write_text("name: g\nx: !custom 3\n" + notes + "nodes: []\n")
    assert load(tagged).raw["nodes"] == [] and load(tagged).line_of(("nodes",)) == 2_003


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


@pytest.mark.parametrize("graph, code, column", [
    ("bad_missing_column.yaml", "missing-column", "ref_logp"),
    ("bad_column_type.yaml", "column-type", None),
    ("bad_param_typo.yaml", "extra_forbidden", ""),
    ("bad_missing_field.yaml", "missing", ""),
])
def test_a_problem_carries_its_code_and_the_column_it_is_about(graph, code, column):
    """What a program reads off a problem (an edit's relocation, a UI): its kind and its column,
    as Pydantic's errors carry `type` and `loc`, never parsed back out of the message."""
    with pytest.raises(GraphError) as info:
        compile_graph(ROOT / "tests/graphs_bad" / graph, Cluster(cpus=2))
    found = [p for p in info.value.problems if p.code == code]
    assert found, [(p.code, p.message) for p in info.value.problems]
    if column is None:  # a column check: some column, named in the message
        assert found[0].column and f"'{found[0].column}'" in found[0].message
    else:
        assert found[0].column == column


def test_enough_bad_graphs():
    assert len(BAD) >= 54  # the bad graphs in tests/graphs_bad/ today: none may go missing


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


def test_calls_chain_each_stage_nodes_that_feed_only_the_next():
    placed = place(_plan(), Cluster(cpus=2))
    assert placed.calls["rollout"] == (Call("model:policy", ("rollout",)),
                                       Call("driver", ("verify", "overlong", "dynamic_sampling")))
    assert placed.calls["train"] == (Call("model:policy", ("old_logp", "adv", "train")),)
    grpo = place(_plan(GRPO), Cluster(cpus=2))
    assert list(grpo.calls) == ["step"]  # no group filter: one phase
    assert [n for c in grpo.calls["step"] for n in c.nodes] == [n.id for n in grpo.plan.nodes]


def test_syncs_are_placed_by_backend_and_placement(tmp_path):
    hf = place(_plan(), Cluster(cpus=2))
    assert hf.syncs == ()  # the hf engine is the trained policy: nothing to sync
    vllm = place(plan(validate(load(ROOT / "graphs" / "dapo-vllm.yaml"))), Cluster(cpus=2))
    assert vllm.syncs == (Sync("train", "policy", "model:policy", "model:policy", "in-actor"),)
    path = _with_placement(tmp_path, "placement: {mode: disaggregated}\n")
    apart = place(plan(validate(load(path))), Cluster(cpus=2))
    assert apart.syncs == (Sync("train", "policy", "model:policy", "rollout:policy", "transfer"),)


def test_weight_sync():
    assert _plan().syncs == (("train", "policy"),)


def test_rewrites_are_pure():
    p = _plan()
    bare = replace(p, rollout=(), group_filter=None, train=(), syncs=())
    for rule in rewrites.REWRITES:
        before = copy.deepcopy(bare)
        after = rule(bare)
        assert bare == before and after is not bare
    assert rewrites.add_weight_syncs(bare).syncs == p.syncs
    assert rewrites.mark_group_barrier(bare).rollout == p.rollout


# --- placement --------------------------------------------------------------------------


def test_the_default_graph_trains_on_a_ddp_group_of_two():
    """graphs/dapo.yaml as shipped: two 1-thread DDP workers hold the policy; old logprobs taken
    from the generator need no model and the GRPO advantage only its prompt group's rows, so both
    run in the group, each worker on its share, and the train phase is one call to the group."""
    placed = place(plan(validate(load(DAPO))), Cluster(cpus=2))
    actor = placed.stage("model:policy")
    assert actor.is_group and (actor.workers, actor.strategy) == (2, "ddp")
    assert actor.nodes == ("rollout", "old_logp", "adv", "train")
    assert placed.calls["train"] == (Call("model:policy", ("old_logp", "adv", "train")),)
    assert placed.stage("driver").nodes == ("verify", "overlong", "dynamic_sampling")
    assert "policy" not in placed.stage("driver").models


@pytest.mark.parametrize("estimator, in_group", [("grpo", True), ("rloo", True), ("opo", True),
                                                 ("reinforce_pp_baseline", False), ("reinforce_pp", False)])
def test_only_an_advantage_of_prompt_groups_runs_on_a_groups_shares(tmp_path, estimator, in_group):
    """An advantage whitened over the batch needs every row: it stays in the driver's stage (one
    call), and the copy of the rollout's logprobs before it stays with it; a group-normalised one
    runs in the training group on each worker's share of whole groups."""
    graph = tmp_path / "dapo.yaml"
    graph.write_text(DAPO.read_text().replace("estimator: grpo", f"estimator: {estimator}"))
    placed = place(plan(validate(load(graph))), Cluster(cpus=2))
    assert (placed.node_stage["adv"] == "model:policy") is in_group
    expected = ((Call("model:policy", ("old_logp", "adv", "train")),) if in_group
                else (Call("driver", ("old_logp", "adv")), Call("model:policy", ("train",))))
    assert placed.calls["train"] == expected


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


def test_cpu_maps_that_feed_only_a_one_worker_actor_run_in_it(tmp_path):
    """Old logprobs taken from the generator (`source: rollout`) and the advantage need no model,
    but with one training worker they feed nothing else: they run in its actor, the train phase
    is one call (rows go there either way), also with the rollout in an actor of its own. A
    2-worker group (the shipped graph) keeps them in the driver (each worker sees a share)."""
    one = tmp_path / "one.yaml"
    for placement in ("", "placement: {mode: disaggregated}\n"):
        one.write_text(DAPO.read_text().replace(GROUP_LINE, "train: {workers: 1}") + "\n" + placement)
        placed = place(plan(validate(load(one))), Cluster(cpus=2))
        assert placed.calls["train"] == (Call("model:policy", ("old_logp", "adv", "train")),)
        assert placed.stage("driver").nodes == ("verify", "overlong", "dynamic_sampling")
    judge = place(plan(validate(load(ROOT / "graphs" / "judge.yaml"))), Cluster(cpus=2))
    # old_logp reads the judge actor's output: it stays in the driver, the advantage moves on
    assert judge.calls["step"][-2:] == (Call("driver", ("old_logp",)), Call("model:policy", ("adv", "train")))


def test_gpu_cluster():
    placed = place(_plan(), Cluster(cpus=16, gpus=2))
    assert placed.stage("model:policy").num_gpus == 1.0
    assert placed.stage("model:policy").num_cpus == 1.0
    assert placed.stage("driver").num_cpus == 15.0


def test_too_few_gpus_for_the_default_actors_are_shared_never_left_for_cpu(tmp_path):
    """Two actors (rollout, trainer) on one GPU: half of it each (tests/test_sizing.py has the
    rest: a group's ranks keep whole GPUs, and what cannot share is refused)."""
    path = _with_placement(tmp_path, "placement: {mode: disaggregated}\n")
    placed = place(plan(validate(load(path))), Cluster(cpus=8, gpus=1))
    assert {s.name: s.num_gpus for s in placed.stages} == {"driver": 0.0, "rollout:policy": 0.5, "model:policy": 0.5}


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
    import torch

    c = Cluster.local()
    assert (c.cpus, c.gpus, c.nodes) == (float(os.cpu_count()), float(torch.cuda.device_count()), 1)


def test_cluster_local_counts_no_gpus_without_importing_torch(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch")  # as in a process that has not imported it
    assert Cluster.local().gpus == 0.0
    assert "torch" not in sys.modules


def test_plan_pickles():
    """The runtime may ship the plan to Ray actors."""
    import pickle

    p = _plan()
    assert pickle.loads(pickle.dumps(p)) == p


def test_explain_names_auto_generation_batches():
    from dapo_flow.graph.edits import edit_file, parse_cli_edits

    placed = edit_file(ROOT / "graphs" / "dapo.yaml",
                       parse_cli_edits([("set", "run.gen_prompts_per_batch=auto")])).compile(Cluster(cpus=2))
    assert "generation batches sized from the keep rate so far (auto)" in explain(placed)


def test_the_engine_context_is_the_prompt_budget_plus_max_tokens(tmp_path):
    from dapo_flow.graph.edits import edit_file, parse_cli_edits

    edits = parse_cli_edits([("set", "data.train.max_prompt_tokens=16"), ("set", "data.val.max_prompt_tokens=12")])
    placed = edit_file(ROOT / "graphs" / "dapo-vllm.yaml", edits).compile()
    assert placed.plan.engine_context() == {"policy": 16 + 8}  # largest budget + the rollout's max_tokens
    assert "max_model_len 24 (prompt budget + max_tokens)" in explain(placed)
    one_unbounded = edit_file(ROOT / "graphs" / "dapo-vllm.yaml", edits[:1]).compile()
    assert one_unbounded.plan.engine_context() == {}  # val has no budget: the model's own maximum


def test_explain_says_how_weights_travel_between_actors():
    from dapo_flow.graph.edits import edit_file, parse_cli_edits

    def sync_line(*sets: str) -> str:
        edits = [("set", s) for s in ("placement.mode=disaggregated", "models.policy.train.workers=1",
                                       "models.policy.train.strategy=null", *sets)]
        text = explain(edit_file(DAPO, parse_cli_edits(edits)).compile(Cluster(cpus=2)))
        return next(line for line in text.splitlines() if "sync weights" in line)

    assert "broadcast in 256 MB buckets on Ray, in-process when local" in sync_line()
    assert "broadcast in 64 MB buckets" in sync_line("models.policy.rollout.sync_bucket_mb=64")
    assert "through the object store as float32" in sync_line("models.policy.rollout.weight_sync=object-store")


def test_the_registries_are_handed_to_the_compiler(tmp_path):
    """As the cluster is: a caller's registries decide which op and backend names a graph may
    use, in validate, edits and the worker setups, without touching the default ones."""
    from dataclasses import replace as dc_replace

    from dapo_flow.graph.edits import SwapEdit, edit_file
    from dapo_flow.graph.registry import OPERATORS, Registries
    from dapo_flow.models.engines import BACKENDS
    from dapo_flow.operators.score import Score
    from dapo_flow.runtime.setup import stage_setups

    torch_engine = dc_replace(BACKENDS["hf"], description="the hf engine under a name of my own")
    mine = Registries(operators={**{k: v for k, v in OPERATORS.items() if k != "score"}, "grade": Score},
                      backends={"torch": torch_engine})
    with pytest.raises(GraphError) as err:
        compile_graph(DAPO, registries=mine)
    assert "unknown op 'score'" in str(err.value) and "models.policy.backend" in str(err.value)
    graph = tmp_path / "graded.yaml"
    graph.write_text(DAPO.read_text().replace("op: score", "op: grade").replace("backend: hf", "backend: torch"))
    with pytest.raises(GraphError, match="unknown op 'grade'"):
        compile_graph(graph)
    placed = compile_graph(graph, registries=mine)
    assert placed.plan.backends == {"policy": torch_engine}
    setups = list(stage_setups(placed).values())
    assert [(n.op, n.impl) for s in setups for n in s.nodes if n.op == "grade"] == [
        ("grade", "dapo_flow.operators.score:Score")]
    assert all(s.backends == {"policy": torch_engine} for s in setups if "policy" in s.models)
    assert "grade" not in OPERATORS and "torch" not in BACKENDS
    swapped = edit_file(DAPO, [SwapEdit(node="verify", op="grade")], registries=dc_replace(mine, backends=BACKENDS))
    assert {n.id: n.op for n in swapped.compile().plan.nodes}["verify"] == "grade"
    with pytest.raises(GraphError, match="unknown op 'grade'"):
        edit_file(DAPO, [SwapEdit(node="verify", op="grade")])


def test_dynamic_sampling_is_an_object_the_compiler_builds():
    """The loop reads how the rollout phase repeats from the plan, not from the group filter's
    params: fixed at compile time (and shown by explain), None without a group filter."""
    from dapo_flow.graph.plan import DynamicSampling

    placed = compile_graph(DAPO)
    assert placed.plan.dynamic_sampling == DynamicSampling(
        node="dynamic_sampling", metric="acc", max_gen_batches=10, on_cap="train-on-what-we-have",
        max_skipped_steps=5)
    assert "at most 10 generation batches, then train-on-what-we-have" in explain(placed)
    assert compile_graph(GRPO).plan.dynamic_sampling is None


def test_a_load_balancing_loss_on_a_model_without_experts_is_a_validate_error(tmp_path):
    """update's router_aux_loss_coef needs routers: validate reads the model's config (a builtin's
    declared shape, nothing built) and names the param's line; on builtin:tiny-moe it validates."""
    graphs = Path(__file__).resolve().parents[1] / "graphs"
    text = (graphs / "moe.yaml").read_text().replace("router_aux_loss_coef: 0.0", "router_aux_loss_coef: 0.01")
    dense = tmp_path / "dense.yaml"
    dense.write_text(text.replace('path: "builtin:tiny-moe"', 'path: "builtin:tiny-adder"'))
    line = next(i for i, row in enumerate(dense.read_text().splitlines(), 1) if "router_aux_loss_coef: 0.01" in row)
    with pytest.raises(GraphError, match=rf"dense.yaml:{line}: node 'train' params.router_aux_loss_coef: "
                                         r"router_aux_loss_coef is 0.01 but the model \(llama\) has no experts"):
        validate(load(dense))
    moe = tmp_path / "moe.yaml"
    moe.write_text(text)
    assert validate(load(moe)).params["train"].router_aux_loss_coef == 0.01
