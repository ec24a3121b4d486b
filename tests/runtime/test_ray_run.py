"""The runtime on real Ray, against a head started apart with `ray start --head` (the
multi-machine path, `--address`): a run gives the local executor's numbers, and a dead
or hung actor ends the run with a RunError (CLI exit 2) saying --resume continues.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from dapo_flow.graph.compiler import compile_graph
from dapo_flow.errors import RunError
from dapo_flow.graph.plan import Cluster
from dapo_flow.runtime import execute
from dapo_flow.core.ports import free_port
from dapo_flow.tracking import read_run, search_runs

pytestmark = pytest.mark.slow

CLUSTER = Cluster(cpus=2)
EXPERIMENT = "runtime-tests"  # the small graph's tracking.experiment
BIN = Path(sys.executable).parent
WAIT_S = 150  # generous: CI boxes are shared and 2-core

# A pass-through operator that misbehaves at its Nth call, in the model's actor (NEEDS_MODEL).
FAULTY_OP = '''
import os
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Params(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    at_call: int = Field(1, ge=1)
    """Misbehave on this call (counting from 1)."""
    action: Literal["exit", "sleep"] = "exit"
    """exit: os._exit(1) the hosting process (as an OOM kill would); sleep: hang."""
    seconds: float = Field(120.0, ge=0.0)
    """How long `sleep` hangs."""


class Faulty:
    Params = Params
    REQUIRES = {}
    PRODUCES = {}
    CARDINALITY = "map"
    NEEDS_MODEL = True

    def __init__(self, params, ctx):
        self.params = params
        self.calls = 0

    def __call__(self, batch):
        self.calls += 1
        if self.calls == self.params.at_call:
            if self.params.action == "exit":
                os._exit(1)
            time.sleep(self.params.seconds)
        return batch
'''


def _deterministic(history: dict) -> dict:
    """Metric histories without wall-clock ones (time/*, perf/*, generation speed)."""
    return {k: v for k, v in history.items()
            if not k.startswith(("time/", "perf/")) and k not in ("gen/seconds", "gen/tokens_per_s")}


def _faulty_graph(small_graph, where: Path, **params) -> Path:
    """The small graph with a Faulty node between rollout and verify, in the policy actor."""
    (where / "faulty_op.py").write_text(FAULTY_OP)
    path = small_graph(where, name="faulty", steps=4, ckpt=2)
    args = ", ".join(f"{k}: {v}" for k, v in params.items())
    text = path.read_text().replace(
        "{id: verify, op: score, inputs: [rollout]",
        "{id: faulty, op: custom, impl: faulty_op.py:Faulty, model: policy, inputs: [rollout], "
        f"params: {{{args}}}}}\n  - {{id: verify, op: score, inputs: [faulty]")
    assert "faulty_op.py" in text
    path.write_text(text)
    return path


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS")}
    return {**env, "RAY_AUTH_MODE": "disabled", "COLUMNS": "200"}


def _uri(where: Path) -> str:
    return f"sqlite:///{where / 'dapo-flow-runs' / 'mlflow.db'}"


def _free_ports(n: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        ports += [port] if port not in ports else []
    return ports


@pytest.fixture(scope="module")
def ray_head(tiny_adder_path):
    """`ray start --head` in a process of its own: the address of a cluster this test
    process did not start, as on a multi-machine setup.

    Stopped by signalling the processes it started, not `ray stop --force`, which kills
    every Ray process on the machine (other people's clusters and test runs included).
    """
    port, client_port, agent_port = _free_ports(3)
    temp = tempfile.mkdtemp(prefix="dfray")  # short: Ray's socket paths must fit 107 bytes
    log = Path(temp) / "head.log"
    cmd = [str(BIN / "ray"), "start", "--head", "--port", str(port), "--node-ip-address",
           "127.0.0.1", "--num-cpus", "2", "--include-dashboard", "false",
           "--disable-usage-stats", "--ray-client-server-port", str(client_port),
           "--dashboard-agent-listen-port", str(agent_port), "--temp-dir", temp, "--block"]
    head = subprocess.Popen(cmd, env=_env(), stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while "Ray runtime started" not in log.read_text():
            assert head.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"
    finally:
        head.send_signal(signal.SIGTERM)  # --block: the head then stops what it started
        try:
            head.wait(30)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(head.pid, signal.SIGKILL)  # stragglers in its session, if any
        except ProcessLookupError:
            pass
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.timeout(2 * WAIT_S)
def test_cli_run_on_a_ray_head_matches_the_local_executor(workdir, small_graph, ray_head):
    """`dapo-flow run --address` on a cluster started apart (the multi-machine path) gives
    the local executor's numbers. (The embedded cluster, no --address, is what
    test_kill_resume's Ray test starts, twice.)"""
    path = small_graph(workdir, steps=3, ckpt=2)
    r = subprocess.run([str(BIN / "dapo-flow"), "run", str(path), "--address", ray_head],
                       cwd=workdir, env=_env(), capture_output=True, text=True, timeout=WAIT_S)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    [run] = search_runs(_uri(workdir), EXPERIMENT)
    ray_run = read_run(_uri(workdir), run["run_id"])
    assert ray_run["status"] == "FINISHED"
    assert ray_run["params"]["executor"] == "ray"
    assert [s for s, _ in ray_run["history"]["batch/reward_mean"]] == [1, 2, 3]
    assert [s for s, _ in ray_run["history"]["val/acc"]] == [0, 2, 3]

    local = execute(compile_graph(path, CLUSTER), executor="local")
    local_run = read_run(local["tracking_uri"], local["run_id"])
    # Bit-identical, not just close: both executors build the same StageWorker with the same
    # seed and torch thread count (setup.num_threads, from the same 2-CPU placement), and the
    # hf backend seeds every generate call, so no float reduction runs in another order.
    assert _deterministic(ray_run["history"]) == _deterministic(local_run["history"])

    # tables by reference: the driver held the prompts it sampled (the update's metrics come in its report),
    # not the tables the calls made (a relaying driver held them all); steps 2 and 3 also fetch
    # a checkpoint's carried groups and validation results
    driver, made = (dict(ray_run["history"][k]) for k in ("perf/driver_bytes", "perf/stage_output_bytes"))
    assert driver[1] < made[1] / 4, (driver, made)
    assert all(driver[s] < made[s] for s in (2, 3)), (driver, made)


@pytest.mark.timeout(2 * WAIT_S)
def test_dead_actor_ends_the_run_with_exit_2_and_says_resume(workdir, small_graph, ray_head):
    # 2 chunks per generation batch: the 3rd call is in step 2, after step 1 trained
    path = _faulty_graph(small_graph, workdir, at_call=3, action="exit")
    r = subprocess.run(  # within WAIT_S, not a hang until the 900 s call timeout
        [str(BIN / "dapo-flow"), "run", str(path), "--address", ray_head],
        cwd=workdir, env=_env(), capture_output=True, text=True, timeout=WAIT_S)
    err = r.stderr.replace("\n", " ")
    assert r.returncode == 2, r.stdout[-3000:] + r.stderr[-3000:]
    assert "error:" in err and "Traceback" not in r.stderr
    assert "the actor of stage 'model:policy' died" in err
    assert "--resume" in err
    [run] = search_runs(_uri(workdir), EXPERIMENT)
    assert run["status"] == "FAILED"


@pytest.mark.timeout(2 * WAIT_S)
def test_hung_actor_times_out_with_a_run_error(workdir, small_graph, ray_head, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("DAPO_FLOW_CALL_TIMEOUT", "5")  # read per call; startup keeps its own
    import ray

    path = _faulty_graph(small_graph, workdir, at_call=1, action="sleep", seconds=300)
    with pytest.raises(RunError, match=r"the actor of stage 'model:policy' did not answer "
                                       r"within 5 s.*DAPO_FLOW_CALL_TIMEOUT.*--resume"):
        execute(compile_graph(path, CLUSTER), executor="ray", address=ray_head)
    assert not ray.is_initialized()  # disconnected; the hung actor was killed
    [run] = search_runs(_uri(workdir), EXPERIMENT)
    assert run["status"] == "FAILED"
