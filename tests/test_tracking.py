"""The MLflow store: concurrent first starts, experiment creation races, read-only stores, the
experiment kind tag."""

from __future__ import annotations

import multiprocessing
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from dapo_flow import tracking
from dapo_flow.tracking import StoreError, Tracker, search_runs

ROOT = Path(__file__).resolve().parents[1]


def _start_run(folder: str, i: int) -> str:
    """In a fresh process: open the store under ``folder`` and record one run."""
    os.chdir(folder)
    try:
        tracker = Tracker(None, "race", run_name=f"r{i}")
        tracker.log_metrics(1, {"x": float(i)})
        tracker.finish()
        return "ok"
    except Exception as exc:  # noqa: BLE001 - the test reports what each process hit
        return f"{type(exc).__name__}: {str(exc)[:200]}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_concurrent_first_starts_share_one_store(tmp_path):
    """Four processes open a store that does not exist yet and create runs in the same new
    experiment at once: MLflow's migrations and experiment creation race without the lock."""
    n = 4
    with multiprocessing.get_context("spawn").Pool(n) as pool:
        results = pool.starmap(_start_run, [(str(tmp_path), i) for i in range(n)])
    assert results == ["ok"] * n
    runs = search_runs(f"sqlite:///{tmp_path / tracking.RUNS_DIR / 'mlflow.db'}", "race")
    assert sorted(r["name"] for r in runs) == [f"r{i}" for i in range(n)]
    assert all(r["status"] == "FINISHED" and r["metrics"] == {"x": float(r["name"][1:])} for r in runs)


def test_a_new_store_is_a_copy_of_an_empty_migrated_one(tmp_path, monkeypatch):
    """MLflow's migrations run once per MLflow version, into a template under $DAPO_FLOW_HOME;
    each new store copies it and still gets a Default experiment of its own location."""
    import mlflow

    monkeypatch.setenv("DAPO_FLOW_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    template = tmp_path / "home" / "mlflow" / f"empty-store-{mlflow.__version__}.db"
    stores = []
    for name in ("a", "b"):
        uri = f"sqlite:///{tmp_path / name / 'mlflow.db'}"
        tracker = Tracker(uri, "exp", run_name=name)
        tracker.log_metrics(1, {"x": 1.0})
        tracker.finish()
        stores.append(uri)
        assert template.is_file()
    for name, uri in zip("ab", stores):
        assert [r["name"] for r in search_runs(uri, "exp")] == [name]
        client = tracking._client(uri)
        default = client.get_experiment("0")
        assert default.name == "Default" and str(tmp_path / "home") not in default.artifact_location
    assert sorted(p.name for p in template.parent.iterdir()) == [template.name, f"{template.name}.lock"]


def test_an_unwritable_home_still_creates_the_store(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.write_text("a file where the cache folder would be")
    monkeypatch.setenv("DAPO_FLOW_HOME", str(home))
    uri = f"sqlite:///{tmp_path / 's' / 'mlflow.db'}"
    Tracker(uri, "exp", run_name="r").finish()
    assert [r["name"] for r in search_runs(uri, "exp")] == ["r"]


def test_experiment_created_by_another_process_is_used(tmp_path, monkeypatch):
    """create_experiment losing the race (RESOURCE_ALREADY_EXISTS) fetches the winner's."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    winner = Tracker(uri, "shared", run_name="first")
    client = tracking._client(uri)
    real_get = type(client).get_experiment_by_name
    calls = []

    def stale_then_real(self, name):  # the first lookup happens before the other process commits
        calls.append(name)
        return None if len(calls) == 1 else real_get(self, name)

    monkeypatch.setattr(type(client), "get_experiment_by_name", stale_then_real)
    second = Tracker(uri, "shared", run_name="second")
    assert len(calls) == 2
    assert (tracking.read_run(uri, second.run_id)["experiment_id"]
            == tracking.read_run(uri, winner.run_id)["experiment_id"])


def test_experiments_are_tagged_as_model_training(tmp_path):
    """The MLflow UI opens untagged experiments in its GenAI view; ours are training runs."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    Tracker(uri, "fresh")
    client = tracking._client(uri)
    assert client.get_experiment_by_name("fresh").tags[tracking.EXPERIMENT_KIND_TAG] == "custom_model_development"
    # an experiment made before the tag existed gets it when its next run starts
    old = client.create_experiment("old")
    assert tracking.EXPERIMENT_KIND_TAG not in client.get_experiment(old).tags
    Tracker(uri, "old")
    assert client.get_experiment(old).tags[tracking.EXPERIMENT_KIND_TAG] == "custom_model_development"
    # a kind the user chose is kept
    client.set_experiment_tag(old, tracking.EXPERIMENT_KIND_TAG, "finetuning")
    Tracker(uri, "old")
    assert client.get_experiment(old).tags[tracking.EXPERIMENT_KIND_TAG] == "finetuning"


def test_steps_logged_together_land_whole_in_few_requests(tmp_path, monkeypatch):
    """Many steps' metrics go in requests of MLflow's 1000-metric cap, not one request a step;
    every value lands at its own step."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(uri, "batched")
    requests = []
    log_batch = tracker.client.log_batch

    def counted(run_id, **kw):
        requests.append(len(kw.get("metrics", ())))
        return log_batch(run_id, **kw)

    monkeypatch.setattr(tracker.client, "log_batch", counted)
    tracker.log_steps([(step, {f"m/{k}": step * 100.0 + k for k in range(60)}) for step in range(1, 21)])
    assert requests == [1000, 200]  # 20 steps x 60 metrics
    history = tracking.read_run(uri, tracker.run_id)["history"]
    assert len(history) == 60
    assert history["m/7"] == [(step, step * 100.0 + 7) for step in range(1, 21)]


def test_sample_text_never_names_an_artifact(tmp_path):
    """Logged samples (prompts, responses, ground truths: data and model text) go into a JSON
    artifact named by the step alone; text shaped like a path stays text inside it."""
    import json

    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    tracker = Tracker(uri, "samples")
    hostile = ["../../../../escaped.txt", "/etc/passwd", "..\\..\\x", "samples/../../y.json", "\x00nul"]
    rows = [{"prompt": text, "response": text, "ground_truth": text} for text in hostile]
    tracker.log_table(rows, "samples/step_000001.json")
    tracker.finish()
    artifacts = tmp_path / "store"
    written = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file())
    assert [Path(w).name for w in written if not w.startswith("store/mlflow.db")] == ["step_000001.json"], written
    assert all(w.startswith("store/") for w in written), written
    [logged] = artifacts.rglob("step_000001.json")
    assert [r["response"] for r in _table_rows(json.loads(logged.read_text()))] == hostile
    assert not (tmp_path.parent / "escaped.txt").exists() and not list(tmp_path.rglob("y.json"))


def _table_rows(doc: dict) -> list[dict]:
    """MLflow's table artifact ({"columns": [...], "data": [[...], ...]}) as row dicts."""
    return [dict(zip(doc["columns"], row)) for row in doc["data"]]


def test_half_migrated_store_is_a_clear_error(tmp_path):
    """A store whose migration was interrupted: StoreError naming the file and the fix."""
    import sqlite3

    db = tmp_path / "mlflow.db"
    uri = f"sqlite:///{db}"
    # a whole store as a new one starts (a copy of the empty migrated one), not opened here: this
    # process caches every store it has opened, and would not look at its version again
    tracking._copy_empty_store(db)
    assert db.is_file()
    with sqlite3.connect(db) as con:
        con.execute("UPDATE alembic_version SET version_num = '451aebb31d03'")
    with pytest.raises(StoreError, match=r"mlflow\.db: MLflow cannot open this store.*\n.*fix: "):
        tracking._client(uri)


def _read_only(path: Path, argv: list[str]) -> list[str]:
    """``argv`` run where ``path`` (a file or folder) cannot be written. Root writes through file
    modes, so as root ``path`` is bind-mounted read-only in a private mount namespace."""
    if os.geteuid() != 0:
        for p in ([path, *path.rglob("*")] if path.is_dir() else [path]):
            p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
        return argv
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("running as root without mount namespaces: nothing is read-only to root")
    script = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && shift && exec "$@"'
    return ["unshare", "-m", "sh", "-c", script, "sh", str(path), *argv]


# a read-only folder is the same check a level up: the whole suite runs it
@pytest.mark.parametrize("read_only", ["file", pytest.param("folder", marks=pytest.mark.slow)])
def test_read_only_store_exits_2_with_the_fix(tmp_path, read_only):
    """`dapo-flow run` on a read-only mlflow.db (or folder): exit 2 before loading anything, with
    what/where/fix and no traceback; reading the store (what compare does) still works."""
    store = tmp_path / tracking.RUNS_DIR
    uri = f"sqlite:///{store / 'mlflow.db'}"
    Tracker(uri, "ro", run_name="kept").finish()
    code = ("import sys; from dapo_flow import cli; from dapo_flow.tracking import search_runs; "
            f"print('read:', [r['name'] for r in search_runs({uri!r}, 'ro')]); "
            "sys.exit(cli.main(['run', sys.argv[1], '--executor', 'local', '--steps', '1']))")
    argv = _read_only(store / "mlflow.db" if read_only == "file" else store,
                      [sys.executable, "-c", code, str(ROOT / "graphs" / "grpo.yaml")])
    r = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    assert "read: ['kept']" in r.stdout, r.stderr
    assert r.returncode == 2, r.stderr
    what = "database file is read-only" if read_only == "file" else "folder is read-only"
    assert f"{store / 'mlflow.db'}: the MLflow store {what}" in r.stderr
    assert "fix: make it writable" in r.stderr
