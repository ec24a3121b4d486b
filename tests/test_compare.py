"""compare: aggregation over synthetic run records (no training), then the MLflow round trip
with runs logged by hand (a parent and its children, as a sweep leaves them)."""

from __future__ import annotations

import math

import pytest

from dapo_flow.experiments import compare as C
from dapo_flow.errors import DapoFlowError


def fake_child_run(variant: str, seed: int, val: list[float], reward: list[float], *, status: str = "FINISHED",
                   step_time: float = 2.0, samples: float = 100.0, error: str = "") -> dict:
    """TEST-ONLY FAKE of what tracking.child_runs returns for one child run of a sweep:
    val/acc at steps 0, 10, 20, ..., reward (score/mean) at steps 1, 2, ..."""
    history = {
        C.VAL: [(10 * i, v) for i, v in enumerate(val)],
        C.REWARD: [(i + 1, r) for i, r in enumerate(reward)],
        C.STEP_TIME: [(i + 1, step_time) for i in range(len(reward))],
        C.SAMPLES: [(len(reward), samples)],
    }
    return {"run_id": f"{variant}-{seed}", "name": f"{variant}/seed{seed}", "status": status,
            "params": {"sweep.variant": variant, "sweep.seed": str(seed)},
            "tags": {C.ERROR_TAG: error} if error else {}, "metrics": {}, "history": history,
            "start_time": 0, "end_time": 1000}


def records(*runs: dict) -> list[C.RunRecord]:
    return [C.RunRecord.from_run(r) for r in runs]


def test_stat():
    assert C.Stat.of([]).fmt() == "-"
    assert C.Stat.of([0.5]).fmt() == "0.500"
    s = C.Stat.of([0.5, 0.7, None, float("nan")])
    assert s.n == 2 and s.mean == pytest.approx(0.6) and s.std == pytest.approx(math.sqrt(0.02))
    assert s.fmt() == "0.600 ± 0.141"


def test_aggregate_mean_std_over_seeds():
    recs = records(
        fake_child_run("grpo", 0, val=[0.1, 0.4, 0.5], reward=[-0.5, 0.0], samples=256),
        fake_child_run("grpo", 1, val=[0.1, 0.8, 0.7], reward=[-0.5, 0.2], samples=256),
        fake_child_run("dapo", 0, val=[0.1, 0.9], reward=[0.4], step_time=4.0, samples=700),
        fake_child_run("dapo", 1, val=[], reward=[], status="FAILED", error="RunError: cap reached"),
    )
    grpo, dapo = C.aggregate(recs, order=["grpo", "dapo"])
    assert (grpo.variant, grpo.runs, grpo.failed) == ("grpo", 2, 0)
    assert grpo.final_val.mean == pytest.approx(0.6) and grpo.final_val.std == pytest.approx(math.sqrt(0.02))
    assert grpo.best_val.mean == pytest.approx(0.65)  # per-seed best (0.5, 0.8), then the mean
    assert grpo.final_reward.mean == pytest.approx(0.1)
    assert grpo.wall.mean == pytest.approx(4.0) and grpo.samples.mean == 256
    assert (dapo.runs, dapo.failed) == (1, 1)  # the failed run is counted, not averaged
    assert dapo.final_val.fmt() == "0.900" and dapo.wall.mean == pytest.approx(4.0)
    assert C._cells(dapo, C.columns([grpo, dapo]))[1] == "1 (+1 failed)"
    assert C.columns([grpo, dapo]) == C.COLUMNS  # no pass@k logged: no pass@k column


def test_final_pass_at_k_column_when_runs_logged_it():
    runs = [fake_child_run("grpo", seed, [0.1, 0.4], [0.0]) for seed in (0, 1)]
    runs[0]["metrics"] = {"val/pass_at_2": 0.5, "val/pass_at_4": 0.625, "val/acc": 0.4}
    runs[1]["metrics"] = {"val/pass_at_2": 0.6, "val/pass_at_4": 0.875}
    other = fake_child_run("rloo", 0, [0.1, 0.3], [0.0])  # logged none (val_n: 1)
    rows = C.aggregate(records(*runs, other))
    assert rows[0].pass_k == 4 and rows[0].final_pass.mean == pytest.approx(0.75)
    assert C.columns(rows)[4] == "final pass@4"
    md = C.markdown(rows)
    assert "| grpo | 2 | 0.400 ± 0.000 | 0.400 ± 0.000 | 0.750 ± 0.177 |" in md and "| rloo | 1 | 0.300 | 0.300 | - |" in md
    runs[1]["metrics"] = {"val/pass_at_8": 0.9}  # different k per variant: each cell says its k
    runs[1]["params"]["sweep.variant"] = "wide"
    rows = C.aggregate(records(*runs))
    assert C.columns(rows)[4] == "final pass@k" and C._cells(rows[1], C.columns(rows))[4] == "0.900 (@8)"


def test_order_given_then_first_seen():
    recs = records(fake_child_run("b", 0, [0.1], [0.0]), fake_child_run("a", 0, [0.1], [0.0]),
                   fake_child_run("c", 0, [0.1], [0.0]))
    assert [r.variant for r in C.aggregate(recs, order=["c", "x"])] == ["c", "b", "a"]


def test_curves_mean_over_seeds_by_step():
    recs = records(fake_child_run("v", 0, val=[0.0, 0.4], reward=[1.0, 2.0]),
                   fake_child_run("v", 1, val=[0.2, 0.6, 0.9], reward=[3.0]))
    val = C.curves(recs, C.VAL)["v"]
    assert [(s, round(m, 6)) for s, m, _ in val] == [(0, 0.1), (10, 0.5), (20, 0.9)]
    assert val[2][2] == 0.0  # one seed has step 20: no spread
    assert C.curves(recs, C.REWARD)["v"][0][:2] == (1, 2.0)


def test_sample_curves_put_val_acc_at_samples_spent():
    a = fake_child_run("auto", 0, val=[0.2, 0.4], reward=[0.0] * 10)
    b = fake_child_run("auto", 1, val=[0.2, 0.6], reward=[0.0] * 10)
    a["history"][C.SAMPLES] = [(i, 30.0 * i) for i in range(1, 11)]  # 30 samples a step
    b["history"][C.SAMPLES] = [(i, 50.0 * i) for i in range(1, 11)]
    fixed = fake_child_run("fixed", 0, val=[0.2, 0.5], reward=[0.0] * 10)
    fixed["history"][C.SAMPLES] = [(i, 96.0 * i) for i in range(1, 11)]
    pts = C.sample_curves(records(a, b, fixed))
    # step 0: nothing spent; step 10: mean of 300 and 500 samples, mean val 0.5
    assert [(x, round(m, 6)) for x, m, _ in pts["auto"]] == [(0.0, 0.2), (400.0, 0.5)]
    assert [(x, m) for x, m, _ in pts["fixed"]] == [(0.0, 0.2), (960.0, 0.5)]


def test_record_fallbacks():
    run = fake_child_run("v", 0, [0.5], [0.1])
    run["history"] = {C.VAL: [(0, 0.5)], C.REWARD_FALLBACK: [(1, -0.25)]}
    run["name"], run["params"] = "v2/seed3", {}
    r = C.RunRecord.from_run(run)
    assert (r.variant, r.wall_seconds, r.curve(C.REWARD)) == ("v2", 1.0, ((1, -0.25),))


def test_markdown_and_plot(tmp_path):
    recs = records(fake_child_run("grpo", 0, [0.1, 0.3], [-0.5, 0.0]),
                   fake_child_run("grpo", 1, [0.2, 0.5], [0.0, 0.5]),
                   fake_child_run("+dynamic-sampling", 0, [0.1, 0.6], [0.1, 0.3]))
    rows = C.aggregate(recs)
    md = C.markdown(rows, "ladder")
    assert md.startswith("# ladder") and "| grpo | 2 | 0.400 ± 0.141 |" in md
    png = C.plot(recs, tmp_path / "sub" / "c.png", title="ladder")
    assert png.read_bytes().startswith(b"\x89PNG")


def _log_fake_sweep(uri: str) -> tuple[str, str]:
    """A parent run and two finished children + one failed, logged through the Tracker."""
    from dapo_flow.tracking import Tracker

    parent = Tracker(uri, "fake-sweep", run_name="sweep fake", tags={C.PARENT_TAG: "parent"})
    parent.log_params({"sweep.variants": "b,a"})
    child = None
    for variant, seed, acc in (("a", 0, 0.5), ("b", 0, 0.25), ("b", 1, 0.75)):
        child = Tracker(uri, "fake-sweep", run_name=f"{variant}/seed{seed}", parent_run_id=parent.run_id)
        child.log_params({"sweep.variant": variant, "sweep.seed": str(seed)})
        child.log_metrics(0, {C.VAL: 0.0})
        child.log_metrics(1, {C.REWARD: acc - 1, C.STEP_TIME: 3.0, C.SAMPLES: 64})
        child.log_metrics(2, {C.VAL: acc, C.REWARD: acc, C.STEP_TIME: 3.0, C.SAMPLES: 128})
        child.finish()
    failed = Tracker(uri, "fake-sweep", run_name="a/seed1", parent_run_id=parent.run_id)
    failed.log_params({"sweep.variant": "a", "sweep.seed": "1"})
    failed.set_tags({C.ERROR_TAG: "DataError: no such file"})
    failed.finish("FAILED")
    parent.finish()
    return parent.run_id, child.run_id


def test_compare_reads_mlflow_and_logs_to_the_parent(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    from dapo_flow.tracking import artifact_paths, default_tracking_uri

    with pytest.raises(DapoFlowError, match="no MLflow store"):
        C.compare("fake-sweep")
    uri = default_tracking_uri()
    parent_id, child_id = _log_fake_sweep(uri)
    rows = C.compare("fake-sweep", out=tmp_path / "c.png")  # experiment name -> latest sweep
    assert [r.variant for r in rows] == ["b", "a"]
    b, a = rows
    assert b.final_val.fmt() == "0.500 ± 0.354" and b.best_val.mean == 0.5 and b.wall.mean == 6.0
    assert (a.runs, a.failed, a.samples.mean) == (1, 1, 128)
    assert b.is_baseline and a.delta.diff == pytest.approx(0.0)  # the sweep's first variant
    assert C.compare("fake-sweep", out=None, baseline="a")[0].delta.diff == pytest.approx(0.0)
    with pytest.raises(DapoFlowError, match="did you mean 'a'"):
        C.compare("fake-sweep", out=None, baseline="aa")
    assert (tmp_path / "c.png").read_bytes().startswith(b"\x89PNG")
    assert {"compare.png", "compare.md"} <= set(artifact_paths(uri, parent_id))
    out = capsys.readouterr().out
    assert "a/seed1 FAILED: DataError: no such file" in out
    assert C.resolve(child_id, uri) == parent_id  # a child's id means its sweep
    assert C.resolve(parent_id, uri) == parent_id
    with pytest.raises(DapoFlowError, match="did you mean 'fake-sweep'"):
        C.resolve("fake-swep", uri)
    # an experiment of plain runs is no sweep: never suggested, and the error says what compare needs
    from dapo_flow.tracking import Tracker

    Tracker(uri, "fake-sweeps-runs", run_name="plain").finish()
    with pytest.raises(DapoFlowError) as info:
        C.resolve("fake-sweeps", uri)
    assert "neither a run id nor an experiment" in str(info.value)
    assert "fix: did you mean 'fake-sweep'?" in str(info.value)  # not 'fake-sweeps-runs'
    with pytest.raises(DapoFlowError) as info:
        C.resolve("fake-sweeps-runs", uri)
    assert "an experiment without a sweep" in str(info.value) and C.NEEDS in str(info.value)
    with pytest.raises(DapoFlowError, match="has no child runs"):
        C.report(uri, child_id, out=None)


def test_no_sweep_yet_suggests_no_dead_end(tmp_path):
    """Only plain runs in the store (the README's first run): `compare dapo` used to suggest
    'dapo-flow', an experiment compare cannot show."""
    from dapo_flow.tracking import Tracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    Tracker(uri, "dapo-flow", run_name="dapo").finish()
    with pytest.raises(DapoFlowError) as info:
        C.resolve("dapo", uri)
    text = str(info.value)
    assert "'dapo-flow'" not in text and C.NEEDS in text
    assert "fix: no sweeps in this store yet: run `dapo-flow sweep PATCH` first" in text


def test_table_keeps_every_number_whole_at_80_columns():
    import io
    import re

    from rich.console import Console

    recs = []
    for variant in ("grpo", "+overlong-filter", "+clip-higher", "+dynamic-sampling", "dr-grpo"):
        for seed in range(3):
            run = fake_child_run(variant, seed, [0.1, 0.3 + 0.01 * seed, 0.35 + 0.02 * seed],
                                 [-0.5, 0.123 * seed], samples=1234.0 + seed)
            run["metrics"] = {"val/pass_at_16": 0.9 + 0.01 * seed}
            recs.append(run)
    rows = C.aggregate(records(*recs), baseline="grpo")
    numbers = {n for row in rows for cell in C._cells(row, C.columns(rows))
               for n in re.findall(r"[-+]?\d+(?:\.\d+)?", cell)}
    assert len(numbers) > 8
    for width in (80, 200):
        out = io.StringIO()
        Console(file=out, width=width).print(C.table(rows, "sweep dapo-ladder (abcdef12)"))
        text = out.getvalue()
        assert "…" not in text and max(len(line) for line in text.splitlines()) <= width
        shown = set(re.findall(r"[-+]?\d+(?:\.\d+)?", text))
        assert numbers <= shown, (numbers - shown, text)  # a cut number is another token


def test_cli_compare_errors_exit_2(tmp_path, monkeypatch, capsys):
    from dapo_flow import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert cli.main(["compare", "nothing-here"]) == 2
    assert "no MLflow store" in capsys.readouterr().err


def test_delta_to_baseline_with_welch_interval():
    recs = records(*(fake_child_run("grpo", i, [0.1, v], [0.0]) for i, v in enumerate([0.30, 0.34, 0.32])),
                   *(fake_child_run("dapo", i, [0.1, v], [0.0]) for i, v in enumerate([0.40, 0.36, 0.41])),
                   fake_child_run("one-seed", 0, [0.1, 0.5], [0.0]))
    grpo, dapo, one = C.aggregate(recs, baseline="grpo")
    assert grpo.is_baseline and grpo.delta is None
    # hand-worked: means 0.32 and 0.39 -> +0.07; variances 0.0004 and 0.0007 over 3 seeds each:
    # se^2 = 0.0004/3 + 0.0007/3 = 0.000367; Welch dof = se^4 / ((0.0004/3)^2/2 + (0.0007/3)^2/2)
    # = 3.72; t(0.975, 3.72) = 2.857 -> half-width 2.857 * 0.01915 = 0.0547
    assert dapo.delta.diff == pytest.approx(0.07)
    assert (dapo.delta.low, dapo.delta.high) == pytest.approx((0.07 - 0.0547, 0.07 + 0.0547), abs=5e-4)
    assert one.delta.diff == pytest.approx(0.18) and one.delta.low is None  # one seed: no interval
    cols = C.columns([grpo, dapo, one])
    assert cols[4] == "Δ val acc vs grpo [95% CI]"
    assert [C._cells(r, cols)[4] for r in (grpo, dapo, one)] == [
        "(baseline)", "+0.070 [+0.015, +0.125]", "+0.180"]
    assert not any(c.startswith("Δ") for c in C.columns(C.aggregate(recs)))  # no baseline: no column
