"""A run whose score node scores on `dapo-flow serve-reward`: the server is SIGKILLed while it
holds a request and restarted on the same port, and the run goes on (retries bridge the gap)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from dapo_flow.graph.edits import edit_file, parse_cli_edits
from dapo_flow.graph.plan import Cluster
from dapo_flow.runtime import execute
from dapo_flow.tracking import read_run
from reward_servers import free_port, serve_reward, stop

# addition's verdict, but the 20th row this server scores hangs (once: the marker file says so)
REWARD = '''
import os, time
from dapo_flow.data.tasks import verify_addition
ROWS = [0]
def reward(text, truth, extra):
    ROWS[0] += 1
    if ROWS[0] == 20 and not os.path.exists("hung"):
        open("hung", "w").close()
        time.sleep(600)  # killed in here
    return verify_addition(text, truth, correct=1.0, wrong=-1.0)
'''


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_goes_on_when_its_reward_server_is_killed_mid_request_and_restarted(workdir, small_graph):
    (workdir / "rewards.py").write_text(REWARD)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    servers = [serve_reward("rewards.py:reward", port, workdir, "--concurrency", "1")]

    def kill_and_restart():
        while not (workdir / "hung").exists():
            time.sleep(0.05)
        stop(servers[0])  # SIGKILL while it holds the request
        servers.append(serve_reward("rewards.py:reward", port, workdir))

    killer = threading.Thread(target=kill_and_restart, daemon=True)
    killer.start()
    try:
        edits = parse_cli_edits([("set", f"verify.reward={url}"),
                                 ("set", "verify.server={batch_size: 8, timeout_s: 60, retries: 10, backoff_s: 0.25}")])
        placed = edit_file(small_graph(workdir, steps=3, ckpt=0), edits).compile(Cluster(cpus=2))
        summary = execute(placed, executor="local")
        killer.join(timeout=10)
        assert not killer.is_alive() and len(servers) == 2
        assert summary["steps"] == 3
        history = read_run(summary["tracking_uri"], summary["run_id"])["history"]
        retries = next(points for key, points in history.items() if key.endswith("score/server_retries"))
        assert sum(value for _, value in retries) >= 1  # the killed request was sent again
        masked = next(points for key, points in history.items() if key.endswith("score/masked"))
        assert [value for _, value in masked] == [0] * len(masked)  # bridged, nothing masked
        health = httpx.get(f"{url}/health", trust_env=False).json()
        assert health["rows_scored"] > 0  # the restarted server scored the rest
    finally:
        for proc in servers:
            stop(proc)
