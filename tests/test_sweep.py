"""Patch files and sweeps: loading with file:line errors, jobs, the ladder's dry run, and a
real two-variant sweep read back by compare and diff (slow)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from dapo_flow import cli
from dapo_flow.graph.edits import InsertEdit, SetEdit
from dapo_flow.errors import GraphError
from dapo_flow.experiments.sweep import load_patch, plan_jobs, validate_jobs

ROOT = Path(__file__).resolve().parents[1]
GRPO = ROOT / "graphs" / "grpo.yaml"
PATCHES = sorted((ROOT / "graphs" / "ablations").glob("*.yaml"))
LADDER = ROOT / "graphs" / "ablations" / "dapo-ladder.yaml"
RUNGS = ["grpo", "+overlong-filter", "+clip-higher", "+soft-overlong", "+token-loss", "+dynamic-sampling"]


def write(tmp_path: Path, text: str, name: str = "patch.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).replace("BASE", str(GRPO)))
    return path


def test_ladder_loads():
    patch = load_patch(LADDER)
    names = [v.name for v in patch.variants]
    assert names[:6] == RUNGS and {"dr-grpo", "rloo", "dapo-verl"} <= set(names)
    assert patch.experiment == "dapo-ladder" and patch.base == GRPO
    clip = next(v for v in patch.variants if v.name == "+clip-higher")
    assert [e.cli() for e in clip.edits] == ["--set train.mask_truncated=true", "--set train.clip_high=0.28"]
    assert clip.extends == "+overlong-filter" and [e.cli() for e in clip.own] == ["--set train.clip_high=0.28"]
    soft = next(v for v in patch.variants if v.name == "+soft-overlong")
    insert = next(e for e in soft.own if isinstance(e, InsertEdit))
    assert (insert.new_id, insert.after, dict(insert.params)) == ("overlong", "verify",
                                                                  {"max_len": 8, "buffer_len": 4, "factor": 1.0})
    assert insert.origin.file == str(LADDER) and insert.origin.line > 30


@pytest.mark.parametrize("path", PATCHES, ids=lambda p: p.name)
def test_every_shipped_patch_compiles(path: Path):
    text = path.read_text()
    assert text.startswith("#") and "dapo-flow sweep" in text
    patch = load_patch(path)
    ready = validate_jobs(patch, plan_jobs(patch, seeds="0,1"))
    assert len(ready) == 2 * len(patch.variants)


def test_ladder_rungs_change_one_thing_each():
    patch = load_patch(LADDER)
    ready = {r.job.variant: r.placed.plan for r in validate_jobs(patch, plan_jobs(patch))}
    p = {name: {n.id: n.params for n in plan.nodes} for name, plan in ready.items()}
    assert not p["grpo"]["train"].mask_truncated and p["+overlong-filter"]["train"].mask_truncated
    assert (p["+overlong-filter"]["train"].clip_high, p["+clip-higher"]["train"].clip_high) == (0.2, 0.28)
    assert "overlong" not in p["+clip-higher"] and p["+soft-overlong"]["adv"].reward_column == "reward"
    assert p["+soft-overlong"]["train"].loss_agg_mode == "seq-mean-token-mean"
    assert p["+token-loss"]["train"].loss_agg_mode == "token-mean"
    assert ready["+token-loss"].group_filter is None and ready["+dynamic-sampling"].group_filter == "dynamic_sampling"
    assert ready["+dynamic-sampling"].spec.run.gen_prompts_per_batch == 48
    dr = p["dr-grpo"]
    assert (dr["adv"].norm_by_std, dr["train"].loss_agg_mode, dr["train"].norm_len) == (
        False, "seq-mean-token-sum-norm", 8)
    assert p["rloo"]["adv"].estimator == "rloo"
    assert all(plan.spec.tracking.experiment == "dapo-ladder" for plan in ready.values())


def test_jobs_seed_major_with_steps_and_only():
    patch = load_patch(LADDER)
    jobs = plan_jobs(patch, only="rloo,grpo", seeds="0,1", steps=3)
    assert [(j.variant, j.seed) for j in jobs] == [("grpo", 0), ("rloo", 0), ("grpo", 1), ("rloo", 1)]
    assert jobs[3].edits[-3:] == (SetEdit(("tracking", "experiment"), "dapo-ladder"), SetEdit(("run", "steps"), 3),
                                  SetEdit(("seed",), 1))
    ready = validate_jobs(patch, jobs)
    assert [r.run_name for r in ready] == ["grpo/seed0", "rloo/seed0", "grpo/seed1", "rloo/seed1"]
    assert ready[0].placed.plan.spec.run.steps == 3
    with pytest.raises(GraphError, match=r"<--only rlo>: unknown variant 'rlo'\n.*did you mean 'rloo'"):
        plan_jobs(patch, only="rlo")
    with pytest.raises(GraphError, match="seeds must be integers"):
        plan_jobs(patch, seeds="0,x")
    with pytest.raises(GraphError, match=r"<--seeds -1>: seed: Input should be greater than or equal to 0"):
        validate_jobs(patch, plan_jobs(patch, only="grpo", seeds=[-1]))


BAD_PATCHES = [
    # (patch text, expected "file:line: ..." fragment, hint fragment)
    ("base: BASE\nvariant:\n  a: []\n", "patch.yaml:2: variant: unknown key 'variant'", "did you mean 'variants'"),
    ("base: BASE\n", "patch.yaml:1: variants: required field is missing", ""),
    ("base: nope.yaml\nvariants:\n  a: []\n", "patch.yaml:1: base: base graph 'nope.yaml' not found", "relative"),
    ("base: BASE\nvariants:\n  a: [{dorp: overlong}]\n", "patch.yaml:3: variants.a[0]: an edit has one key",
     "did you mean 'drop'"),
    ("base: BASE\nvariants:\n  a: [{drop: verify, set: {x: 1}}]\n", "patch.yaml:3: variants.a[0]: an edit has one key",
     ""),
    ("base: BASE\nvariants:\n  a: {extends: b}\n", "patch.yaml:3: variants.a.extends: extends unknown variant 'b'", ""),
    ("base: BASE\nvariants:\n  a: {extends: b}\n  b: {extends: a}\n", "extends cycle: a -> b -> a", ""),
    ("base: BASE\nvariants:\n  a: {extend: b}\n", "patch.yaml:3: variants.a.extend: unknown key 'extend'",
     "did you mean 'extends'"),
    ("base: BASE\nvariants:\n  a: 3\n", "patch.yaml:3: variants.a: a variant is a list of edits", ""),
    ("base: BASE\nvariants:\n  a,b: []\n", "patch.yaml:3: variants.a,b: bad variant name", "no commas"),
    ("base: BASE\nvariants:\n  a:\n    - insert: {id: x, op: logprob}\n",
     "patch.yaml:4: variants.a[0].insert.after: required field is missing", ""),
    ("base: BASE\nvariants:\n  a: ['--sett run.steps=3']\n", "patch.yaml:3: expected an edit flag", "'set'"),
    ("base: BASE\nvariants:\n  a: [{set: [run.steps, 3]}]\n",
     "patch.yaml:3: variants.a[0].set: `set` takes a mapping", ""),
    ("base: BASE\nseeds: [-1]\nvariants:\n  a: []\n", "patch.yaml:2: seeds[0]: Input should be greater", ""),
]


@pytest.mark.parametrize("text, where, hint", BAD_PATCHES, ids=[w[:40] for _, w, _ in BAD_PATCHES])
def test_bad_patch_file_located(tmp_path, text, where, hint):
    path = write(tmp_path, text)
    with pytest.raises(GraphError) as info:
        load_patch(path)
    msg = str(info.value).replace(str(tmp_path) + "/", "")
    assert where in msg and hint in msg, msg


BAD_VARIANTS = [
    # compile errors of the effective graph point at the edit's line in the patch file
    ("base: BASE\nvariants:\n  ok: []\n  a:\n    - set: {train.lr: -1}\n",
     "patch.yaml:5: node 'train' params.lr: Input should be greater than 0 (got -1) (in variant a)"),
    ("base: BASE\nvariants:\n  a: [{drop: overlng}]\n", "patch.yaml:3: unknown node 'overlng'"),
    ("base: BASE\nvariants:\n  a: [{drop: verify}]\n",
     "patch.yaml:3: node 'adv' inputs: requires column 'score' (float) but no upstream node produces it "
     "(in variant a)\n    fix: the dropped node 'verify' produced it: keep it, or add an upstream node"),
    ("base: BASE\nvariants:\n  a: [{swap: {adv: advantag}}]\n", "patch.yaml:3: unknown op 'advantag'"),
    ("base: BASE\nvariants:\n  a:\n    - insert: {id: o, op: overlong-shape, after: verify,\n"
     "               params: {max_len: 8, buffer_len: 9}}\n",
     "patch.yaml:4: node 'o' params: buffer_len (9) must be <= max_len (8)"),
    ("base: BASE\nsettings: [{set: {run.stepz: 3}}]\nvariants:\n  a: []\n  b: []\n",
     "patch.yaml:2: run.stepz: unknown key 'stepz' (in every variant)"),
]


@pytest.mark.parametrize("text, where", BAD_VARIANTS, ids=[w[:40] for _, w in BAD_VARIANTS])
def test_bad_variant_names_the_patch_line(tmp_path, text, where):
    patch = load_patch(write(tmp_path, text))
    with pytest.raises(GraphError) as info:
        validate_jobs(patch, plan_jobs(patch))
    assert where in str(info.value).replace(str(tmp_path) + "/", ""), str(info.value)


def test_cli_dry_run_ladder(monkeypatch, capsys):
    # in this process (a terminal of 80 columns: rich reads COLUMNS as the command starts); the
    # module's entry point as a process: tests/test_edits.py
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("COLUMNS", "80")
    code = cli.main(["sweep", str(LADDER), "--dry-run", "--seeds", "0,1"])
    out = capsys.readouterr()
    assert code == 0, out.err
    for name in [*RUNGS, "dr-grpo", "rloo", "dapo-verl"]:
        assert name in out.out
    assert "every variant compiles (18 run(s)); nothing trained" in out.out
    # at 80 columns every flag is whole on a line of its own (it used to fold mid-token)
    lines = {line.strip() for line in out.out.splitlines()}
    for flag in ("--set train.clip_high=0.28", "--insert dynamic_sampling:group-filter:after=overlong",
                 "--set dynamic_sampling.on_cap=train-on-what-we-have",
                 "--set train.loss_agg_mode=seq-mean-token-sum-norm", "--set run.gen_prompts_per_batch=48"):
        assert flag in lines, out.out


def test_dry_run_report_lists_every_flag_whole_at_80_columns():
    import io

    from rich.console import Console

    from dapo_flow.experiments.sweep import _flags, dry_run_report

    patch = load_patch(LADDER)
    ready = validate_jobs(patch, plan_jobs(patch, seeds="0"))
    out = io.StringIO()
    Console(file=out, width=80).print(dry_run_report(patch, ready), crop=False)
    lines = [line.strip() for line in out.getvalue().splitlines()]
    flags = [f for v in patch.variants for e in v.own for f in _flags(e)]
    assert len(flags) > 15 and all(flag in lines for flag in flags), out.getvalue()


def test_run_sweep_refuses_parallel_below_one(tmp_path, monkeypatch):
    from dapo_flow.errors import DapoFlowError
    from dapo_flow.experiments.sweep import run_sweep

    monkeypatch.chdir(tmp_path)
    patch = load_patch(LADDER)
    with pytest.raises(DapoFlowError, match="parallel must be >= 1"):
        run_sweep(patch, plan_jobs(patch, seeds="0"), executor="local", parallel=0)
    assert not (tmp_path / "dapo-flow-runs").exists()


def test_cli_sweep_errors_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    bad = write(tmp_path, "base: BASE\nvariants:\n  a: [{drop: overlng}]\n")
    assert cli.main(["sweep", str(bad), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "patch.yaml:3: unknown node 'overlng'" in err and "Traceback" not in err
    assert cli.main(["sweep", str(LADDER), "--dry-run", "--only", "grop"]) == 2
    assert "did you mean 'grpo'" in capsys.readouterr().err
    assert cli.main(["sweep", str(tmp_path / "none.yaml")]) == 2
    assert "none.yaml: no such file" in capsys.readouterr().err
    assert not (tmp_path / "dapo-flow-runs").exists()  # nothing was logged


TINY = """\
# tiny sweep for the tests: 4 prompts x 4 samples, 16 val prompts
base: BASE
experiment: tiny
settings:
  - "--set run.prompts_per_step=4 --set rollout.n=4 --set data.val.size=16 --set run.checkpoint_every=0"
variants:
  grpo: []
  rloo: [{set: {adv.estimator: rloo}}]
  broken: [{set: {data.train.source: missing.jsonl}}]
"""


@pytest.mark.slow
def test_real_sweep_then_compare_and_diff(tmp_path, monkeypatch, capsys, tiny_adder_path):
    """2 variants x 1 seed, 2 steps each, in-process; a third variant fails at run time."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    from dapo_flow.tracking import ERROR_TAG
    from dapo_flow.experiments.graphdiff import load_graph
    from dapo_flow.graph.diff import diff_graphs
    from dapo_flow.tracking import artifact_paths, child_runs, default_tracking_uri, latest_run

    patch = write(tmp_path, TINY, "tiny.yaml")
    rc = cli.main(["sweep", str(patch), "--steps", "2", "--executor", "local", "--seeds", "3"])
    out = capsys.readouterr().out
    assert rc == 1, out  # one variant failed: recorded, the others ran
    assert "broken/seed3 failed" in out and "missing.jsonl" in out
    uri = default_tracking_uri()
    parent = latest_run(uri, "tiny", "tags.`dapo_flow.sweep` = 'parent'")
    assert parent["status"] == "FAILED" and parent["params"]["sweep.variants"] == "grpo,rloo,broken"
    children = {c["name"]: c for c in child_runs(uri, parent["run_id"], ["val/acc"])}
    assert set(children) == {"grpo/seed3", "rloo/seed3", "broken/seed3"}
    rloo, broken = children["rloo/seed3"], children["broken/seed3"]
    assert rloo["status"] == "FINISHED" and rloo["params"]["seed"] == "3"
    assert rloo["params"]["sweep.variant"] == "rloo" and rloo["params"]["edit.4"] == "--set adv.estimator=rloo"
    assert [s for s, _ in rloo["history"]["val/acc"]] == [0, 2]
    assert "graph/effective.yaml" in artifact_paths(uri, rloo["run_id"], "graph")
    assert broken["status"] == "FAILED" and "missing.jsonl" in broken["tags"][ERROR_TAG]
    # compare reads the sweep back (it also ran at the end of the sweep: artifacts on the parent)
    assert {"compare.png", "compare.md"} <= set(artifact_paths(uri, parent["run_id"]))
    assert cli.main(["compare", "tiny", "-o", "cmp.png"]) == 0
    out = capsys.readouterr().out
    assert "grpo" in out and "rloo" in out and "broken/seed3 FAILED: " in out
    assert (tmp_path / "cmp.png").read_bytes().startswith(b"\x89PNG")
    # diff of two runs' effective graphs
    changes = diff_graphs(load_graph(children["grpo/seed3"]["run_id"])[1], load_graph(rloo["run_id"])[1])
    assert [c.render() for c in changes] == ["adv.estimator: grpo -> rloo"]
    assert cli.main(["diff", str(GRPO), rloo["run_id"]]) == 0
    assert "~ run.steps: 120 -> 2" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_run_with_edits_logs_them(tmp_path, monkeypatch, tiny_adder_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    from dapo_flow.tracking import default_tracking_uri, latest_run, read_artifact_text

    assert cli.main(["run", str(GRPO), "--executor", "local", "--steps", "1", "--set", "run.prompts_per_step=4",
                     "--set", "rollout.n=4", "--set", "data.val.size=8", "--set", "run.checkpoint_every=0",
                     "--set", "train.lr=5e-4", "--set", "tracking.experiment=edits"]) == 0
    run = latest_run(default_tracking_uri(), "edits")
    assert run["params"]["edit.4"] == "--set train.lr=0.0005" and run["params"]["nodes.train.params.lr"] == "0.0005"
    text = read_artifact_text(default_tracking_uri(), run["run_id"], "graph/effective.yaml")
    assert "#   --set train.lr=0.0005" in text and "lr: 0.0005" in text


def test_sweep_records_failures_and_stops_on_ctrl_c(tmp_path, monkeypatch):
    """The orchestration with a fake execute (no training): a run that raises after its MLflow
    run started is marked FAILED with the error tag, the sweep goes on; Ctrl-C stops it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    import dapo_flow.runtime as runtime
    from dapo_flow.tracking import ERROR_TAG
    from dapo_flow.errors import RunError
    from dapo_flow.experiments.sweep import run_sweep
    from dapo_flow.tracking import Tracker, child_runs, find_run

    calls = []

    def fake_execute(placed, **kw):
        """TEST-ONLY FAKE of runtime.execute: starts the child run like the runtime does."""
        calls.append(kw["run_name"])
        spec = placed.plan.spec
        t = Tracker(None, spec.tracking.experiment, run_name=kw["run_name"], parent_run_id=kw["parent_run_id"])
        t.log_params(kw["extra_params"])
        if placed.plan.node("adv").params.estimator == "rloo":
            t.finish("FAILED")
            raise ValueError("boom in rloo")
        t.log_metrics(0, {"val/acc": 0.5})
        t.finish()
        return {"run_id": t.run_id, "val_acc_start": 0.5, "val_acc_end": 0.5, "wall_seconds": 1.0}

    monkeypatch.setattr(runtime, "execute", fake_execute)
    patch = load_patch(LADDER)
    result = run_sweep(patch, plan_jobs(patch, only="rloo,grpo"), executor="local")
    assert calls == ["grpo/seed0", "rloo/seed0"]
    assert [r.ok for r in result.results] == [True, False]
    failed = find_run(result.tracking_uri, result.failed[0].run_id)
    assert failed["status"] == "FAILED" and failed["tags"][ERROR_TAG] == "ValueError: boom in rloo"
    assert len(child_runs(result.tracking_uri, result.parent_run_id)) == 2  # no duplicate run made
    assert find_run(result.tracking_uri, result.parent_run_id)["status"] == "FAILED"

    def fake_interrupted_execute(placed, **kw):
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise RunError("interrupted; ...") from None  # what the runtime does with Ctrl-C

    monkeypatch.setattr(runtime, "execute", fake_interrupted_execute)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(patch, plan_jobs(patch, only="grpo,rloo"), executor="local")
    from dapo_flow.tracking import default_tracking_uri, latest_run

    parent = latest_run(default_tracking_uri(), "dapo-ladder", "tags.`dapo_flow.sweep` = 'parent'")
    assert parent["status"] == "KILLED"


@pytest.mark.slow
def test_parallel_sweep_runs_each_variant_in_its_own_process(tmp_path, monkeypatch, capsys, tiny_adder_path):
    """--parallel 2: spawned processes, each given its share of the CPUs by threads.configure;
    the same runs as one after another."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    from dapo_flow.tracking import child_runs, default_tracking_uri, latest_run

    patch = write(tmp_path, TINY, "tiny.yaml")
    args = ["sweep", str(patch), "--steps", "1", "--executor", "local", "--only", "grpo,rloo"]
    assert cli.main([*args, "--parallel", "2"]) == 0, capsys.readouterr().out
    uri = default_tracking_uri()
    parent = latest_run(uri, "tiny", "tags.`dapo_flow.sweep` = 'parent'")
    children = {c["name"]: c for c in child_runs(uri, parent["run_id"], ["val/acc"])}
    assert {n: c["status"] for n, c in children.items()} == {"grpo/seed0": "FINISHED", "rloo/seed0": "FINISHED"}
    assert all((tmp_path / "dapo-flow-runs" / "sweeps" / parent["run_id"] / f"{v}_seed0.log").is_file()
               for v in ("grpo", "rloo"))
