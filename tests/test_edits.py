"""--set / --drop / --swap / --insert: what each does to the graph, and every kind of bad edit
-> one GraphError located at the edit (library) or exit 2 with no traceback (CLI)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dapo_flow import cli
from dapo_flow.graph.explain import explain
from dapo_flow.graph.edits import (
    DropEdit,
    InsertEdit,
    Origin,
    SetEdit,
    SwapEdit,
    apply_edits,
    compile_edited,
    edit_file,
    parse_cli_edit,
    parse_cli_edits,
    parse_edit_string,
)
from dapo_flow.errors import GraphError, SchemaError
from dapo_flow.graph.loader import GraphDoc, load
from dapo_flow.graph.plan import Cluster

ROOT = Path(__file__).resolve().parents[1]
DAPO = str(ROOT / "graphs" / "dapo.yaml")
CLUSTER = Cluster(cpus=2)


def edited(*flags: tuple[str, str]):
    return edit_file(DAPO, parse_cli_edits(flags))


def node(doc: GraphDoc, node_id: str) -> dict:
    return next(n for n in doc.raw["nodes"] if n["id"] == node_id)


# --- parsing ------------------------------------------------------------------------------


@pytest.mark.parametrize("text, path, value", [
    ("train.lr=5e-4", ("train", "lr"), 5e-4),
    ("train.clip_c=null", ("train", "clip_c"), None),
    ("verify.extra_columns=[a, b]", ("verify", "extra_columns"), ["a", "b"]),
    ("models.policy.backend=vllm", ("models", "policy", "backend"), "vllm"),
    ("run.steps=5", ("run", "steps"), 5),
    ("seed=3", ("seed",), 3),
    ("train.mask_truncated=true", ("train", "mask_truncated"), True),
    ("data.train.options={low: 0, high: 9}", ("data", "train", "options"), {"low": 0, "high": 9}),
    ("verify.reward=builtin:addition", ("verify", "reward"), "builtin:addition"),
])
def test_parse_set_values_are_yaml(text, path, value):
    assert parse_cli_edit("set", text) == SetEdit(path, value)


def test_parse_other_flags_and_strings():
    assert parse_cli_edit("drop", "overlong") == DropEdit("overlong")
    assert parse_cli_edit("swap", "adv=advantage") == SwapEdit("adv", "advantage")
    assert parse_cli_edit("insert", "ref:logprob:after=old_logp:model=ref") == InsertEdit(
        "ref", "logprob", "old_logp", {}, "ref")
    assert parse_edit_string("--set run.steps=3 --drop overlong --swap=adv=advantage") == [
        SetEdit(("run", "steps"), 3), DropEdit("overlong"), SwapEdit("adv", "advantage")]
    # cli() is what gets logged, and it parses back to the same edit
    for e in (SetEdit(("train", "clip_c"), None), SetEdit(("verify", "extra_columns"), ["a", "b"]),
              DropEdit("x"), SwapEdit("a", "score"), InsertEdit("r", "logprob", "a", {}, "ref")):
        assert parse_edit_string(e.cli()) == [e]
    with_params = InsertEdit("o", "overlong-shape", "verify", {"max_len": 8})
    assert parse_edit_string(with_params.cli()) == [InsertEdit("o", "overlong-shape", "verify"),
                                                    SetEdit(("o", "max_len"), 8)]


# --- what each edit does --------------------------------------------------------------------


def test_set_param_section_and_model():
    e = edited(("set", "train.lr=5e-4"), ("set", "run.steps=5"), ("set", "models.policy.dtype=bfloat16"),
               ("set", "train.clip_c=null"), ("set", "seed=7"), ("set", "data.train.options.low=5"))
    placed = e.compile(CLUSTER)
    spec = placed.plan.spec
    assert placed.plan.node("train").params.lr == 5e-4
    assert placed.plan.node("train").params.clip_c is None
    assert (spec.run.steps, spec.models["policy"].dtype, spec.seed) == (5, "bfloat16", 7)
    assert spec.data.train.options == {"low": 5}  # intermediate mappings are created
    assert e.params() == {"edit.0": "--set train.lr=0.0005", "edit.1": "--set run.steps=5",
                          "edit.2": "--set models.policy.dtype=bfloat16", "edit.3": "--set train.clip_c=null",
                          "edit.4": "--set seed=7", "edit.5": "--set data.train.options.low=5"}


def test_set_node_fields_and_explicit_params():
    e = edited(("set", "adv.params.estimator=rloo"), ("set", "old_logp.model=policy"))
    assert node(e.doc, "adv")["params"] == {"estimator": "rloo"}
    assert e.compile(CLUSTER).plan.node("adv").params.estimator == "rloo"


def test_drop_rewires_consumers_to_the_inputs():
    e = edited(("drop", "dynamic_sampling"))
    assert node(e.doc, "old_logp")["inputs"] == ["overlong"]
    placed = e.compile(CLUSTER)
    assert placed.plan.group_filter is None
    assert "no group-filter, so no dynamic sampling" in explain(placed)
    # the line numbers of untouched nodes survive: train is still where the file has it
    assert placed.plan.node("train").line == load(DAPO).line_of(("nodes", 6))


def test_drop_dedups_inputs_keeping_order():
    doc = GraphDoc("g.yaml", {"nodes": [
        {"id": "a", "op": "x", "inputs": ["prompts"]},
        {"id": "b", "op": "x", "inputs": ["a", "prompts"]},
        {"id": "c", "op": "x", "inputs": ["b", "a"]},
    ]}, {("nodes", i): 10 + i for i in range(3)})
    out = apply_edits(doc, [DropEdit("b")])
    assert [n["id"] for n in out.raw["nodes"]] == ["a", "c"]
    assert out.raw["nodes"][1]["inputs"] == ["a", "prompts"]
    assert out.line_of(("nodes", 1)) == 12  # c's line moved with it
    assert doc.raw["nodes"][2]["inputs"] == ["b", "a"]  # pure: the input is untouched


def test_drop_then_set_the_column_it_made():
    placed = edited(("drop", "overlong"), ("set", "adv.reward_column=score")).compile(CLUSTER)
    assert [n.id for n in placed.plan.nodes] == ["rollout", "verify", "dynamic_sampling", "old_logp", "adv", "train"]


def test_drop_overlong_alone_reads_the_raw_score():
    # adv's reward_column defaults to `auto`: `reward` while overlong shaping is upstream, else `score`
    params = {n.id: n.params for n in edited().compile(CLUSTER).plan.nodes}
    assert params["adv"].reward_column == "reward"
    placed = edited(("drop", "overlong")).compile(CLUSTER)
    assert {n.id: n.params for n in placed.plan.nodes}["adv"].reward_column == "score"
    assert "reward_column=score" in explain(placed)


def test_swap_keeps_id_wiring_and_the_params_the_new_op_has():
    e = edited(("swap", "verify=logprob"))
    n = node(e.doc, "verify")
    assert (n["op"], n["inputs"], n["model"], n["params"]) == ("logprob", ["rollout"], "policy", {})
    assert node(e.doc, "overlong")["inputs"] == ["verify"]
    same = edited(("swap", "dynamic_sampling=group-filter")).compile(CLUSTER)
    assert same.plan.node("dynamic_sampling").params.on_cap == "train-on-what-we-have"



def test_a_swap_or_insert_gives_a_model_only_to_a_node_whose_params_run_on_one():
    """`score` may run on a model (a reward model, a judge); with a rule reward it runs on none,
    so swapping to it (or inserting one) must not write the graph's model into its `model:`."""
    swapped = edited(("swap", "verify=score"))
    assert "model" not in node(swapped.doc, "verify") and swapped.compile(CLUSTER).plan.node("verify").model is None
    doc = apply_edits(load(DAPO), [InsertEdit("again", "score", "verify", {"reward": "builtin:addition"})])
    assert "model" not in node(doc, "again")
    assert node(edited(("swap", "verify=logprob")).doc, "verify")["model"] == "policy"

def test_insert_between_node_and_consumers():
    e = edited(("set", "models.ref.path=builtin:tiny-adder"), ("insert", "ref:logprob:after=old_logp:model=ref"),
               ("set", "ref.role=ref"))
    assert node(e.doc, "ref") == {"id": "ref", "op": "logprob", "inputs": ["old_logp"], "model": "ref",
                                  "params": {"role": "ref"}}
    assert node(e.doc, "adv")["inputs"] == ["ref"]
    placed = e.compile(CLUSTER)
    assert [n.id for n in placed.plan.nodes][4:7] == ["old_logp", "ref", "adv"]
    assert "ref_logp" in placed.plan.node("adv").in_schema.names
    assert "model:ref" in placed.node_stage.values()


def test_insert_model_defaults_to_the_anchor_s_and_params_apply():
    e = edited(("insert", "x:logprob:after=old_logp"))
    assert node(e.doc, "x")["model"] == "policy"
    doc = apply_edits(load(DAPO), [InsertEdit("gf", "group-filter", "verify", {"metric": "score"})])
    assert node(doc, "gf") == {"id": "gf", "op": "group-filter", "inputs": ["verify"], "params": {"metric": "score"}}
    assert "model" not in node(doc, "gf")


def test_edits_apply_in_order():
    with pytest.raises(GraphError, match="unknown node 'x'"):
        edited(("set", "x.role=ref"), ("insert", "x:logprob:after=old_logp"))


def test_effective_yaml_round_trips(tmp_path):
    e = edited(("drop", "overlong"), ("set", "adv.reward_column=score"), ("set", "train.clip_c=null"))
    text = e.yaml()
    assert text.startswith("# effective graph: ") and "#   --drop overlong" in text
    path = tmp_path / "effective.yaml"
    path.write_text(text)
    assert load(path).raw == e.doc.raw
    assert compile_edited(load(path), (), CLUSTER).plan.spec == e.compile(CLUSTER).plan.spec


# --- bad edits: library --------------------------------------------------------------------


BAD = [
    # (flags, expected location, expected message fragment, expected hint fragment)
    ([("set", "trian.lr=1")], "<--set trian.lr>", "unknown node 'trian'", "did you mean 'train'"),
    ([("set", "train.lrr=1")], "<--set train.lrr>: node 'train' params.lrr", "unknown key 'lrr'", "'lr'"),
    ([("set", "train.lr=abc")], "<--set train.lr>: node 'train' params.lr", "valid number", ""),
    ([("set", "train.lr=-1")], "<--set train.lr>: node 'train' params.lr", "greater than 0", ""),
    ([("set", "train.loss_agg_mode=token_mean")], "<--set train.loss_agg_mode>", "token_mean", "'token-mean'"),
    ([("set", "run.steps=0")], "<--set run.steps>: run.steps", "greater than or equal to 1", ""),
    ([("set", "run.stepz=5")], "<--set run.stepz>: run.stepz", "unknown key 'stepz'", "'steps'"),
    ([("set", "models.policy.backend=vlm")], "<--set models.policy.backend>", "'hf' or 'vllm'", "'vllm'"),
    ([("set", "train.lr")], "<--set train.lr>", "expected PATH=VALUE", "--set NODE.PARAM=VALUE"),
    ([("set", "train.lr=")], "<--set train.lr=>", "no value after '='", "null"),
    ([("set", "train.lr=[1,")], "<--set train.lr=[1,>", "cannot read value", "quote"),
    ([("set", "seed.x=1")], "<--set seed.x>", "'seed' is 0, not a mapping", "--set seed=VALUE"),
    ([("set", "train.id=t2")], "<--set train.id>", "cannot be changed", "--insert"),
    ([("set", "nodes.0.op=score")], "<--set nodes.0.op>", "edited by id", "--drop"),
    ([("set", "train=1")], "<--set train>", "names a node", "--set train.PARAM=VALUE"),
    ([("set", "rollout.inputs.x=1")], "<--set rollout.inputs.x>", "has no sub-keys", ""),
    ([("drop", "overlng")], "<--drop overlng>", "unknown node 'overlng'", "did you mean 'overlong'"),
    ([("drop", "prompts")], "<--drop prompts>", "implicit source", ""),
    ([("drop", "verify")], "<--drop verify>: node 'overlong' inputs", "requires column 'score'",
     "the dropped node 'verify' produced it"),
    ([("set", "adv.reward_column=reward"), ("drop", "overlong")], "<--drop overlong>: node 'adv' inputs",
     "requires column 'reward'", "--set adv.reward_column=score"),
    ([("swap", "verify=scor")], "<--swap verify=scor>", "unknown op 'scor'", "did you mean 'score'"),
    ([("swap", "verfy=score")], "<--swap verfy=score>", "unknown node 'verfy'", "'verify'"),
    ([("swap", "verify")], "<--swap verify>", "expected NODE=OP", "--swap NODE=OP"),
    ([("swap", "old_logp=advantage")], "<--swap old_logp=advantage>", "requires column 'old_logp'",
     "the swapped node 'old_logp' produced it"),
    ([("insert", "x:logprob:after=nope")], "<--insert x:logprob:after=nope>", "unknown node 'nope'", ""),
    ([("insert", "adv:logprob:after=old_logp")], "<--insert adv:logprob:after=old_logp>",
     "node id 'adv' already exists", "pick a new id"),
    ([("insert", "x:logprb:after=adv")], "<--insert x:logprb:after=adv>", "unknown op 'logprb'", "'logprob'"),
    ([("insert", "x:logprob")], "<--insert x:logprob>", "expected NEW_ID:OP:after=NODE", ""),
    ([("insert", "x:logprob:before=adv")], "<--insert x:logprob:before=adv>", "bad option", "after=NODE"),
    ([("insert", "1x:logprob:after=adv")], "<--insert 1x:logprob:after=adv>", "not a valid node id", ""),
    ([("insert", "ref:logprob:after=old_logp"), ("set", "ref.role=ref")],
     "<--insert ref:logprob:after=old_logp>: node 'ref' model",
     "must stay frozen", "separate model"),
    ([("insert", "x:update:after=adv")], "<--insert x:update:after=adv>", "already updated", ""),
]


@pytest.mark.parametrize("flags, where, message, hint", BAD, ids=lambda v: str(v)[:40] if isinstance(v, list) else "")
def test_bad_edit_is_one_located_problem(flags, where, message, hint):
    with pytest.raises(GraphError) as info:
        edited(*flags).compile(CLUSTER)
    text = str(info.value)
    assert f"  {where}" in text, text
    assert message in text, text
    assert hint in text, text


def test_every_bad_edit_reported_at_once():
    with pytest.raises(GraphError) as info:
        edited(("set", "trian.lr=1"), ("drop", "nope"), ("swap", "adv=x"))
    assert len(info.value.problems) == 3
    with pytest.raises(GraphError) as info:
        edited(("set", "train.lr=-1"), ("set", "run.steps=0")).compile(CLUSTER)
    assert len(info.value.problems) == 2


def test_schema_error_kind_and_untouched_lines_kept():
    with pytest.raises(SchemaError):
        edited(("drop", "verify")).compile(CLUSTER)
    # a problem in an untouched part still names file:line, after an insert shifted the nodes
    with pytest.raises(GraphError) as info:
        edited(("insert", "x:overlong-shape:after=rollout"), ("set", "rollout.max_tokens=4")).compile(CLUSTER)
    line = load(DAPO).line_of(("nodes", 2, "params", "max_len"))
    assert f"dapo.yaml:{line}: node 'overlong' params.max_len: max_len 8 differs" in str(info.value)


def test_patch_origin_names_the_patch_line():
    edit = SetEdit(("train", "lr"), -1.0, Origin("ladder.yaml", 12))
    with pytest.raises(GraphError, match=r"ladder.yaml:12: node 'train' params.lr: Input should be greater"):
        compile_edited(apply_edits(load(DAPO), [edit]), [edit], CLUSTER)


def test_unknown_flag_in_edit_string():
    with pytest.raises(GraphError, match=r"expected an edit flag.*\n.*did you mean 'set'"):
        parse_edit_string("--sett run.steps=3")


# --- CLI ----------------------------------------------------------------------------------


def test_cli_validate_explain_graph_with_edits(capsys, tmp_path, monkeypatch):
    # a terminal narrower than the message, as a long checkout path makes it: the status line
    # stays one line (rich used to fold it, "6 \nnodes", when the clone's path was long)
    monkeypatch.setenv("COLUMNS", "20")
    flags = ["--set", "train.lr=5e-4", "--drop", "overlong", "--set", "adv.reward_column=score"]
    assert cli.main(["validate", DAPO, *flags, "--effective"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"ok: {DAPO} with 3 edit(s): graph 'dapo', 6 nodes, 2 stages"
    assert "#   --drop overlong" in out
    assert cli.main(["explain", DAPO, "--cpus", "2", *flags]) == 0
    out = capsys.readouterr().out
    assert "overlong" not in out and "lr=0.0005" in out
    assert cli.main(["graph", DAPO, "-o", str(tmp_path / "g.mmd"), "--drop", "dynamic_sampling"]) == 0
    assert "dynamic_sampling" not in (tmp_path / "g.mmd").read_text()


def test_cli_run_passes_edits_to_execute(monkeypatch):
    import types

    seen = {}
    fake = types.ModuleType("dapo_flow.runtime")
    fake.execute = lambda placed, **kw: seen.update(kw, spec=placed.plan.spec)
    monkeypatch.setitem(sys.modules, "dapo_flow.runtime", fake)
    assert cli.main(["run", DAPO, "--executor", "local", "--set", "train.lr=5e-4", "--drop", "overlong",
                     "--set", "adv.reward_column=score"]) == 0
    assert seen["spec"].nodes[4].params == {"estimator": "grpo", "reward_column": "score"}
    assert seen["extra_params"] == {"edit.0": "--set train.lr=0.0005", "edit.1": "--drop overlong",
                                    "edit.2": "--set adv.reward_column=score"}
    artifacts = seen["artifacts"]
    assert "#   --drop overlong" in artifacts["graph/effective.yaml"]
    # the run logs the edited plan as explain prints it, and its picture
    assert "train [update, sink]" in artifacts["graph/plan.txt"] and "overlong [" not in artifacts["graph/plan.txt"]
    assert artifacts["graph/dag.png"].startswith(b"\x89PNG")


@pytest.mark.parametrize("flags, where, message, hint", BAD, ids=lambda v: str(v)[:40] if isinstance(v, list) else "")
def test_cli_bad_edit_exits_2(flags, where, message, hint, capsys):
    args = [a for flag, text in flags for a in (f"--{flag}", text)]
    assert cli.main(["validate", DAPO, *args]) == 2
    err = capsys.readouterr().err
    assert where in err and message in err and "Traceback" not in err


def test_cli_subprocess_exit_2_without_traceback():
    r = subprocess.run([sys.executable, "-m", "dapo_flow.cli", "validate", DAPO, "--set", "trian.lr=1", "--drop", "nope",
                        "--insert", "x:logprb:after=adv"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "3 problems in the graph" in r.stderr
    assert "<--set trian.lr>: unknown node 'trian'" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_inserted_filter_and_kl_nodes_resolve_their_consumers():
    e = edited(("set", "models.ref.path=builtin:tiny-adder"), ("insert", "ref:logprob:after=old_logp:model=ref"),
               ("set", "ref.role=ref"), ("insert", "kl:kl:after=ref"), ("insert", "filt:overlong-filter:after=kl"))
    nodes = {n.id: n for n in e.compile(CLUSTER).plan.nodes}
    assert nodes["kl"].params.reward_column == "reward"  # overlong shaping is upstream
    assert nodes["adv"].params.reward_column == "reward"
    assert nodes["train"].params.loss_mask == "use"
    assert {"kl", "loss_mask"} <= set(nodes["train"].in_schema.names)
