"""MLflow tracking: the only module that imports mlflow.

Default store: a sqlite database plus an artifact folder under ./dapo-flow-runs in the
working directory (embedded, no server). Metrics are logged in one `log_batch` per step:
200 single-metric calls cost ~1.5 s on sqlite, one batch of 1200 ~0.13 s.

Every client is made by `_client`: opening a sqlite store creates or migrates its tables, which
MLflow does without any lock, so two processes starting at once in a fresh folder corrupt each
other's migration. `_client` holds a file lock beside the database while the store opens.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

from dapo_flow.errors import DapoFlowError

RUNS_DIR = "dapo-flow-runs"
MAX_PARAM_LEN = 6000  # mlflow's param value limit is 6000 chars
# The MLflow UI opens an experiment without this tag in its GenAI view ("Evaluation runs");
# training runs belong in its model-training view.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
# The tags dapo-flow sets on runs and reads back (compare, sweep, eval).
PARENT_TAG = "dapo_flow.sweep"  # "parent" on a sweep's (or eval sweep's) parent run
ERROR_TAG = "dapo_flow.error"  # the error text on a failed child run
PATCH_TAG = "dapo_flow.patch"  # the patch file a sweep ran
SWEEP_FAILED_TAG = "dapo_flow.sweep_failed"  # how many of a sweep's jobs failed
EVAL_TAG = "dapo_flow.eval"  # "1" on an evaluation run
STORE_LOCK_TIMEOUT_S = 300  # a fresh store migrates in seconds; a holder that long is stuck


class StoreError(DapoFlowError):
    """The MLflow tracking store cannot be opened or written."""


def runs_dir() -> Path:
    return Path.cwd() / RUNS_DIR


def default_tracking_uri() -> str:
    """`MLFLOW_TRACKING_URI` if set, else the embedded sqlite store under ./dapo-flow-runs."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return f"sqlite:///{runs_dir() / 'mlflow.db'}"


def _quiet_env() -> None:
    import logging

    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
    # a server that went away fails a request in seconds (MLflow's own default retries for
    # minutes, holding the run's driver): a run keeps its metrics meanwhile and writes them later
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    # migrations and store set-up log at INFO on every new database: noise for a CLI user
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)


def flatten(obj: Any, prefix: str = "") -> dict[str, str]:
    """Nested mappings/lists as dotted keys -> strings (for MLflow params)."""
    out: dict[str, str] = {}
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(obj, (list, tuple)) and obj and all(isinstance(v, Mapping) for v in obj):
        for i, v in enumerate(obj):
            key = v.get("id", i) if isinstance(v, Mapping) else i
            out.update(flatten(v, f"{prefix}{key}."))
    else:
        out[prefix.rstrip(".")] = str(obj)[:MAX_PARAM_LEN]
    return out


class Tracker:
    """One MLflow run: params once, metrics batched per step, artifacts."""

    def __init__(self, uri: str | None, experiment: str, *, run_id: str | None = None,
                 run_name: str | None = None, tags: Mapping[str, str] | None = None,
                 parent_run_id: str | None = None):
        self.uri = uri or default_tracking_uri()
        self.client = _client(self.uri, write=True)
        if run_id is not None:  # resume: same run, mark it running again
            self.run_id = run_id
            self.client.update_run(run_id, status="RUNNING")
            return
        exp_id = _experiment_id(self.client, self.uri, experiment)
        all_tags = dict(tags or {})
        if parent_run_id:
            all_tags["mlflow.parentRunId"] = parent_run_id
        self.run_id = self.client.create_run(exp_id, run_name=run_name, tags=all_tags).info.run_id

    def log_params(self, params: Mapping[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:MAX_PARAM_LEN]) for k, v in params.items()]
        for i in range(0, len(items), 100):  # mlflow caps params per batch at 100
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def set_tags(self, tags: Mapping[str, str]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        self.log_steps([(step, metrics)])

    def log_steps(self, entries: Iterable[tuple[int, Mapping[str, float]]]) -> None:
        """The metrics of many steps in as few requests as MLflow takes (1000 metrics each): a
        request has a fixed cost in the store (a sqlite store spends ~15 ms of CPU on a request of
        one step's ~55 metrics, ~5 ms a step when 18 steps share one), paid by the driver."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, step) for step, metrics in entries for k, v in metrics.items()]
        for i in range(0, len(items), 1000):  # mlflow caps metrics per batch at 1000
            self.client.log_batch(self.run_id, metrics=items[i : i + 1000])

    def log_artifact(self, path: Path | str, subdir: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), subdir)

    def log_text(self, text: str, name: str) -> None:
        self.client.log_text(self.run_id, text, name)

    def log_file(self, content: str | bytes, name: str) -> None:
        """An artifact ``name`` (``dir/file.ext``) holding ``content``: text or bytes (a picture)."""
        if isinstance(content, str):
            self.log_text(content, name)
            return
        import tempfile

        folder, _, filename = name.rpartition("/")
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / filename
            path.write_bytes(content)
            self.client.log_artifact(self.run_id, str(path), folder or None)

    def log_table(self, rows: Iterable[Mapping[str, Any]], name: str) -> None:
        import pandas as pd

        self.client.log_table(self.run_id, pd.DataFrame(list(rows)), name)

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)


def read_run(uri: str, run_id: str) -> dict[str, Any]:
    """Params, tags, latest metrics and metric histories of a run (for tests and compare)."""
    client = _client(uri)
    run = client.get_run(run_id)
    history = {k: [(m.step, m.value) for m in client.get_metric_history(run_id, k)] for k in run.data.metrics}
    artifacts = [a.path for a in client.list_artifacts(run_id)]
    return {
        "params": dict(run.data.params),
        "tags": dict(run.data.tags),
        "metrics": dict(run.data.metrics),
        "history": history,
        "status": run.info.status,
        "artifacts": artifacts,
        "experiment_id": run.info.experiment_id,
    }


def search_runs(uri: str, experiment: str, filter_string: str = "") -> list[dict[str, Any]]:
    """Runs of an experiment as dicts (id, name, params, metrics, tags)."""
    client = _client(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    runs = client.search_runs([exp.experiment_id], filter_string=filter_string, max_results=10000)
    return [
        {"run_id": r.info.run_id, "name": r.info.run_name, "params": dict(r.data.params),
         "metrics": dict(r.data.metrics), "tags": dict(r.data.tags), "status": r.info.status}
        for r in runs
    ]


# --- opening the store: one lock around creation and migration ---------------------------

STORE_URI_FIX = ("set tracking.uri in the graph (or $MLFLOW_TRACKING_URI) to a tracking server's "
                 "http(s):// address, a sqlite:///PATH.db file, or leave both unset for ./dapo-flow-runs/mlflow.db")
#: How long a tracking server has to answer once: MLflow's client retries a server that is down
#: for minutes (7 retries, exponential backoff) before it fails.
SERVER_ANSWER_TIMEOUT_S = 10.0
_answered: set[str] = set()  # servers that answered in this process


def _check_server_answers(uri: str) -> None:
    """StoreError unless an http(s) tracking server at ``uri`` answers (any HTTP status)."""
    if not uri.startswith(("http://", "https://")) or uri in _answered:
        return
    import ssl
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=SERVER_ANSWER_TIMEOUT_S).close()
    except urllib.error.HTTPError:
        pass  # it answered (a proxy's or an auth layer's status is still an answer)
    except (OSError, ValueError) as exc:  # URLError, a timeout, a bad host or port
        reason = getattr(exc, "reason", None) or exc
        if isinstance(reason, ssl.SSLError):  # it answered; TLS settings are MLflow's to apply
            _answered.add(uri)
            return
        raise StoreError(f"the MLflow tracking server at {uri!r} does not answer ({reason})\n"
                         f"    fix: start it (`mlflow server --host 0.0.0.0 --port 5000`), or {STORE_URI_FIX}") from None
    _answered.add(uri)


def _client(uri: str, *, write: bool = False):
    """An MlflowClient on ``uri``. Constructing it opens the store, which on sqlite creates or
    migrates the tables; a file lock beside the database makes that one process at a time.
    ``write``: the caller will write, so a read-only store is refused here, up front."""
    _quiet_env()
    from mlflow import MlflowClient

    _quiet_env()  # again: importing mlflow installs its own logger configuration
    db = _sqlite_file(uri)
    if db is None:  # a server or another database: its own concurrency control
        _check_server_answers(uri)
        try:
            return MlflowClient(tracking_uri=uri)
        except Exception as exc:  # an MlflowException: a URI it cannot use
            raise StoreError(f"MLflow cannot open the tracking store {uri!r}: {str(exc).splitlines()[0]}\n"
                             f"    fix: {STORE_URI_FIX}") from None
    if write or not db.exists():
        require_writable(uri)
    elif _unwritable(db):  # read-only and complete: nothing to create or migrate, no lock needed
        return _open(MlflowClient, uri, db)
    from filelock import FileLock, Timeout

    db.parent.mkdir(parents=True, exist_ok=True)
    try:
        with FileLock(f"{db}.lock", timeout=STORE_LOCK_TIMEOUT_S):
            if not db.exists():
                _copy_empty_store(db)
            return _open(MlflowClient, uri, db)
    except Timeout:
        raise StoreError(f"{db}: another process has held the store's lock ({db}.lock) for "
                         f"{STORE_LOCK_TIMEOUT_S} s while opening it\n"
                         f"    fix: stop that process, or wait for it and retry") from None


def _copy_empty_store(db: Path) -> None:
    """Start a new sqlite store as a copy of an empty one of this MLflow version
    (:func:`_empty_store`): MLflow creates a store by running its ~60 migrations (1-2.5 s of
    CPU, every new run folder, every test's store); a copy takes milliseconds. Where the
    template cannot be made or copied, MLflow creates the store as usual."""
    import shutil
    import sqlite3

    try:
        shutil.copyfile(_empty_store(), db)
    except (OSError, sqlite3.Error):
        db.unlink(missing_ok=True)  # MLflow creates it


def _empty_store() -> Path:
    """An empty store of this MLflow version, migrated once and kept under
    $DAPO_FLOW_HOME/mlflow. It holds no experiment, so MLflow makes the Default one on opening a
    copy, with that store's artifact location."""
    import contextlib
    import sqlite3
    import tempfile

    import mlflow
    from filelock import FileLock

    from dapo_flow.home import dapo_flow_home

    template = dapo_flow_home() / "mlflow" / f"empty-store-{mlflow.__version__}.db"
    if template.exists():
        return template
    template.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{template}.lock", timeout=STORE_LOCK_TIMEOUT_S):
        if template.exists():  # another process made it while this one waited
            return template
        with tempfile.TemporaryDirectory(dir=template.parent) as tmp:
            made = Path(tmp) / "store.db"
            mlflow.MlflowClient(tracking_uri=f"sqlite:///{made}").search_experiments()
            # its Default experiment's artifacts would point into tmp
            with contextlib.closing(sqlite3.connect(made)) as con, con:
                con.execute("DELETE FROM experiments")
            os.replace(made, template)
    return template


def open_store(uri: str) -> None:
    """Open the store once (creating or migrating it under the lock); a StoreError if it cannot
    be opened. For a process that then hands the store to another program (`mlflow ui`)."""
    _client(uri)


def require_writable(uri: str | None) -> None:
    """Raise StoreError when runs cannot be recorded in ``uri``'s sqlite store (read-only file or
    folder). Cheap (no mlflow import): a run checks before it loads models."""
    db = _sqlite_file(uri or default_tracking_uri())
    problem = db and _unwritable(db)
    if problem:
        raise StoreError(f"{db}: the MLflow store {problem}, so runs cannot be recorded there\n"
                         f"    fix: make it writable (chmod u+w), run from another folder, or set "
                         f"MLFLOW_TRACKING_URI to a writable store")


def _sqlite_file(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI (None for other stores)."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri.removeprefix("sqlite:///").split("?", 1)[0]
    return None if path in ("", ":memory:") else Path(path).absolute()


def _unwritable(db: Path) -> str | None:
    """Why sqlite could not write ``db`` (it also writes a journal beside it), or None."""
    if db.exists():
        if not os.access(db.parent, os.W_OK | os.X_OK):
            return "folder is read-only (sqlite writes its journal beside the database)"
        if not os.access(db, os.W_OK):
            return "database file is read-only"
        return None
    folder = db.parent
    while not folder.exists():  # the first folder that exists is where we would create one
        folder = folder.parent
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        return f"cannot be created: {folder} is read-only"
    return None


def _open(client_cls, uri: str, db: Path):
    """Construct the client, turning a store MLflow cannot open into a StoreError."""
    from mlflow.exceptions import MlflowException
    from sqlalchemy.exc import SQLAlchemyError

    try:
        return client_cls(tracking_uri=uri)
    except (MlflowException, SQLAlchemyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StoreError(f"{db}: MLflow cannot open this store: {first}\n"
                         f"    fix: if a run was killed while creating it, move the folder aside "
                         f"and run again (a new store is created); `mlflow db upgrade "
                         f"sqlite:///{db}` migrates an old one") from None


def _experiment_id(client, uri: str, name: str) -> str:
    """The id of experiment ``name``, created when missing (another process creating it at the
    same moment is fine: we use theirs) and tagged as a training experiment."""
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is None:
        db = _sqlite_file(uri)  # keep artifacts beside the db, not in the working directory
        artifacts = (db.parent / "artifacts").as_uri() if db else None
        try:
            return client.create_experiment(name, artifact_location=artifacts,
                                            tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        exp = client.get_experiment_by_name(name)
    if EXPERIMENT_KIND_TAG not in exp.tags:  # created by an older dapo-flow
        client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    return exp.experiment_id


# --- sweeps and comparisons: parent/child runs, artifacts of finished runs ----------------


def _record(client, run, history_keys: Iterable[str] = ()) -> dict[str, Any]:
    history = {k: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)]
               for k in history_keys if k in run.data.metrics}
    return {"run_id": run.info.run_id, "name": run.info.run_name, "status": run.info.status,
            "experiment_id": run.info.experiment_id, "params": dict(run.data.params),
            "metrics": dict(run.data.metrics), "tags": dict(run.data.tags), "history": history,
            "start_time": run.info.start_time, "end_time": run.info.end_time}


def find_run(uri: str, run_id: str) -> dict[str, Any] | None:
    """A run as a dict (run_id, name, status, params, metrics, tags, times), None if unknown."""
    from mlflow.exceptions import MlflowException

    client = _client(uri)
    try:
        return _record(client, client.get_run(run_id))
    except MlflowException:
        return None


def child_runs(uri: str, parent_run_id: str, history_keys: Iterable[str] = ()) -> list[dict[str, Any]]:
    """Child runs of a parent (oldest first), with metric histories of ``history_keys``."""
    client = _client(uri)
    parent = client.get_run(parent_run_id)
    runs = client.search_runs([parent.info.experiment_id],
                              filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'",
                              max_results=10000, order_by=["attributes.start_time ASC"])
    keys = tuple(history_keys)
    return [_record(client, r, keys) for r in runs]


def latest_run(uri: str, experiment: str, filter_string: str = "") -> dict[str, Any] | None:
    """The most recently started run of an experiment matching the filter, or None."""
    client = _client(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return None
    runs = client.search_runs([exp.experiment_id], filter_string=filter_string, max_results=1,
                              order_by=["attributes.start_time DESC"])
    return _record(client, runs[0]) if runs else None


def newest_experiment(uri: str) -> tuple[str, str] | None:
    """(id, name) of the experiment whose latest run started last, or None without runs."""
    client = _client(uri)
    ids = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(ids, max_results=1, order_by=["attributes.start_time DESC"]) if ids else []
    if not runs:
        return None
    exp_id = runs[0].info.experiment_id
    return exp_id, client.get_experiment(exp_id).name


def experiments_with(uri: str, filter_string: str) -> list[str]:
    """Names of the experiments holding at least one run that matches ``filter_string``."""
    client = _client(uri)
    return [e.name for e in client.search_experiments()
            if client.search_runs([e.experiment_id], filter_string=filter_string, max_results=1)]


def experiment_names(uri: str) -> list[str]:
    return [e.name for e in _client(uri).search_experiments()]


def experiment_name(uri: str, experiment_id: str) -> str:
    return _client(uri).get_experiment(experiment_id).name


def add_to_run(uri: str, run_id: str, *, texts: Mapping[str, str] | None = None,
               files: Mapping[str, str | None] | None = None, tags: Mapping[str, str] | None = None) -> None:
    """Log text artifacts (name -> text), files (path -> artifact dir) and tags to an existing
    run without touching its status (a Tracker with ``run_id`` would mark it RUNNING)."""
    from mlflow.entities import RunTag

    client = _client(uri, write=True)
    for name, text in (texts or {}).items():
        client.log_text(run_id, text, name)
    for path, subdir in (files or {}).items():
        client.log_artifact(run_id, str(path), subdir)
    if tags:
        client.log_batch(run_id, tags=[RunTag(k, str(v)[:5000]) for k, v in tags.items()])


def set_run_status(uri: str, run_id: str, status: str) -> None:
    _client(uri, write=True).set_terminated(run_id, status=status)


def read_artifact_text(uri: str, run_id: str, path: str) -> str | None:
    """The text of one artifact of a run, or None when the run has no such artifact."""
    import tempfile

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    client = _client(uri)
    folder = str(Path(path).parent) if Path(path).parent != Path(".") else None
    names = {a.path for a in client.list_artifacts(run_id, folder)}
    if path not in names:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        local = client.download_artifacts(run_id, path, tmp)
        return Path(local).read_text(encoding="utf-8")


def artifact_paths(uri: str, run_id: str, folder: str | None = None) -> list[str]:
    return [a.path for a in _client(uri).list_artifacts(run_id, folder)]
