"""An MLflow server that goes away mid-run (its process killed): the run goes on, keeps the
metrics MLflow did not take (a warning), and writes them when the server is back; one that is
down at the run's end: the run says so and keeps them, and `--resume` writes them once it
answers. Every step reaches MLflow exactly once."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from rich.console import Console

from dapo_flow.errors import RunError
from dapo_flow.graph.compiler import compile_graph
from dapo_flow.graph.plan import Cluster
from dapo_flow.runtime import execute
from dapo_flow.runtime.loop import Runner
from dapo_flow.core.ports import free_port
from dapo_flow.tracking import read_run

pytestmark = pytest.mark.slow  # a real MLflow server started three times (~10-40 s each)

MLFLOW = str(Path(sys.executable).parent / "mlflow")
STEPS = 8


class MlflowServer:
    """`mlflow server` on the loopback, its store in ``where`` (kept across restarts)."""

    def __init__(self, where: Path):
        self.where, self.port, self.proc = where, free_port(), None

    @property
    def uri(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        log = open(self.where / "server.log", "a")
        self.proc = subprocess.Popen(
            [MLFLOW, "server", "--host", "127.0.0.1", "--port", str(self.port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{self.where / 'mlflow.db'}",
             "--artifacts-destination", str(self.where / "artifacts")],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{self.uri}/health", timeout=2):
                    return
            except OSError:
                assert self.proc.poll() is None, (self.where / "server.log").read_text()[-2000:]
                assert time.monotonic() < deadline, "the MLflow server did not start"
                time.sleep(0.3)

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


@pytest.fixture()
def server(tmp_path):
    store = tmp_path / "store"
    store.mkdir()
    srv = MlflowServer(store)
    srv.start()
    yield srv
    if srv.proc.poll() is None:
        srv.kill()


def test_metrics_survive_an_mlflow_server_that_goes_away(workdir, small_graph, server, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
    monkeypatch.setenv("DAPO_FLOW_MLFLOW_WAIT_S", "3")
    from dapo_flow.runtime import session

    monkeypatch.setattr(session, "OUTAGE_RETRY_S", 0.5)
    step = Runner.step

    def step_with_outages(self, state, *args, **kwargs):
        if state.step == 2:  # before step 3: gone for steps 3 and 4 (step 4's checkpoint, samples)
            server.kill()
        if state.step == 4:  # before step 5: back for step 6's checkpoint
            server.start()
        if state.step == 7:  # before the last step: gone at the run's end
            server.kill()
        return step(self, state, *args, **kwargs)

    monkeypatch.setattr(Runner, "step", step_with_outages)
    placed = compile_graph(small_graph(workdir, name="outage", steps=STEPS, ckpt=2), Cluster(cpus=2))
    out = io.StringIO()
    with pytest.raises(RunError, match=r"(?s)did not take its last metrics.*--resume"):
        execute(placed, executor="local", console=Console(file=out, width=300))
    log = out.getvalue()
    assert "did not take the metrics of steps 3-4" in log and "they are kept" in log, log
    assert "MLflow answers again" in log and "steps 3-6 written" in log.split("MLflow answers again")[1], log

    monkeypatch.setattr(Runner, "step", step)
    server.start()
    summary = execute(placed, executor="local", resume=True, console=Console(file=out, width=300))
    run = read_run(server.uri, summary["run_id"])
    assert run["status"] == "FINISHED"
    for key in ("batch/reward_mean", "actor/pg_loss"):  # every step exactly once
        assert [s for s, _ in run["history"][key]] == list(range(1, STEPS + 1)), key
    assert [s for s, _ in run["history"]["val/acc"]] == [0, 2, 4, 6, 8]
