"""`dapo-flow ui` serves the default store on 127.0.0.1 and answers the MLflow REST API; it owns
the MLflow server (stopping it stops the server) and refuses busy or invalid ports."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from dapo_flow.core.ports import free_port

CLI = Path(sys.executable).with_name("dapo-flow")


def _mlflow_pids(port: int) -> list[int]:
    """Processes serving MLflow on ``port`` (mlflow ui and its uvicorn child)."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:  # gone, or not a process folder
            continue
        if any(b"mlflow" in a for a in argv) and str(port).encode() in argv:
            pids.append(int(proc.name))
    return pids


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _search_runs(port: int, deadline_s: float = 90) -> list | None:
    """The UI's answer to a runs search of experiment 1, or None if it never answers."""
    body = json.dumps({"experiment_ids": ["1"], "max_results": 5}).encode()
    deadline = time.time() + deadline_s
    while time.time() < deadline:
        try:
            req = urllib.request.Request(f"http://127.0.0.1:{port}/api/2.0/mlflow/runs/search",
                                         data=body, headers={"Content-Type": "application/json"})
            return json.loads(urllib.request.urlopen(req, timeout=5).read())["runs"]
        except OSError:
            time.sleep(0.5)
    return None


@pytest.mark.slow
def test_ui_serves_the_default_store(tmp_path, monkeypatch):
    from dapo_flow.tracking import Tracker, default_tracking_uri

    monkeypatch.chdir(tmp_path)
    tracker = Tracker(None, "ui-test", run_name="probe")
    tracker.log_metrics(1, {"val/acc": 0.5})
    tracker.finish()
    assert default_tracking_uri().startswith("sqlite:///")
    port = free_port()
    proc = subprocess.Popen([str(CLI), "ui", "--port", str(port)], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        runs = _search_runs(port)
        assert runs is not None, "the UI never answered"
        assert [r["info"]["run_id"] for r in runs] == [tracker.run_id]
        assert _mlflow_pids(port), "expected mlflow processes while the UI runs"
        # SIGTERM to dapo-flow alone (not its group) stops the server it started
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        deadline = time.time() + 10
        while time.time() < deadline and (_listening(port) or _mlflow_pids(port)):
            time.sleep(0.2)
        assert not _listening(port), f"port {port} still served after SIGTERM"
        assert _mlflow_pids(port) == [], "mlflow processes outlived `dapo-flow ui`"
    finally:
        for pid in [proc.pid, *_mlflow_pids(port)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=20)


@pytest.mark.timeout(120)
def test_ui_refuses_a_busy_port(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run([str(CLI), "ui", "--port", str(port)], cwd=tmp_path, capture_output=True,
                           text=True, timeout=100)
    assert r.returncode == 2, r.stderr
    assert f"cannot serve on 127.0.0.1:{port}" in r.stderr and "fix: pick a free port" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "dapo-flow-runs").exists()  # refused before touching the store


@pytest.mark.parametrize("port", ["70000", "0", "-1", "http"])
def test_ui_refuses_an_invalid_port(port, capsys):
    from dapo_flow import cli

    with pytest.raises(SystemExit) as info:
        cli.main(["ui", "--port", port])
    assert info.value.code == 2
    assert "argument --port:" in capsys.readouterr().err


def test_the_ui_opens_on_the_charts_of_the_newest_experiments_runs(tmp_path, monkeypatch):
    """Not on MLflow's landing page (its GenAI overview) nor the runs table: the runs of the
    experiment run last, in the chart view (the curves first)."""
    from dapo_flow import cli
    from dapo_flow.tracking import Tracker, default_tracking_uri, newest_experiment

    monkeypatch.chdir(tmp_path)
    uri = default_tracking_uri()
    for experiment in ("older", "newer"):
        tracker = Tracker(None, experiment, run_name="probe")
        tracker.finish()
        time.sleep(0.01)  # start times in milliseconds
    exp_id, name = newest_experiment(uri)
    assert name == "newer"
    assert cli.ui_url("127.0.0.1", 5000, (exp_id, name)) == (
        f"http://127.0.0.1:5000/#/experiments/{exp_id}/runs?compareRunsMode=CHART")
    assert cli.ui_url("0.0.0.0", 5001, None) == "http://127.0.0.1:5001"
    assert cli.ui_url("::1", 5000, None) == "http://[::1]:5000"


def test_serving_beyond_loopback_is_a_warning():
    from dapo_flow import cli

    for host in ("127.0.0.1", "::1", "localhost", "127.0.0.2"):
        assert cli.ui_host_warning(host) is None, host
    for host in ("0.0.0.0", "10.1.2.3", "myhost.example"):
        warning = cli.ui_host_warning(host)
        assert warning and "no login" in warning and "ssh -L" in warning, host


def test_a_host_this_machine_cannot_serve_on_exits_2_before_the_store(tmp_path, monkeypatch, capsys):
    from dapo_flow import cli

    monkeypatch.chdir(tmp_path)
    port = free_port()
    assert cli.main(["ui", "--host", "192.0.2.1", "--port", str(port)]) == 2  # TEST-NET-1: no interface has it
    err = capsys.readouterr().err
    assert f"cannot serve on 192.0.2.1:{port}" in err and "Traceback" not in err
    assert not (tmp_path / "dapo-flow-runs").exists()
