"""`dapo-flow ui` serves the default store on 127.0.0.1 and answers the MLflow REST API."""

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

CLI = Path(sys.executable).with_name("dapo-flow")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_ui_serves_the_default_store(tmp_path, monkeypatch):
    from dapo_flow.tracking import Tracker, default_tracking_uri

    monkeypatch.chdir(tmp_path)
    tracker = Tracker(None, "ui-test", run_name="probe")
    tracker.log_metrics(1, {"val/acc": 0.5})
    tracker.finish()
    assert default_tracking_uri().startswith("sqlite:///")
    port = _free_port()
    proc = subprocess.Popen([str(CLI), "ui", "--port", str(port)], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        body = json.dumps({"experiment_ids": ["1"], "max_results": 5}).encode()
        deadline, runs = time.time() + 60, None
        while time.time() < deadline and runs is None:
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/api/2.0/mlflow/runs/search",
                                             data=body, headers={"Content-Type": "application/json"})
                runs = json.loads(urllib.request.urlopen(req, timeout=5).read())["runs"]
            except OSError:
                time.sleep(0.5)
        assert runs is not None, "the UI never answered"
        assert [r["info"]["run_id"] for r in runs] == [tracker.run_id]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
