"""Runs on Ray heal themselves (run.max_failures): a training or rollout actor killed with
SIGKILL, or stopped with SIGSTOP (hung), is found, the actors restart and the run resumes from
its last checkpoint by itself, with every step in MLflow once, the recovery in faults/*, and the
weights an uninterrupted run ends with. The rules (how many, the same step twice, no checkpoint)
and the hang bound are checked on their own first."""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import time

import pytest

from dapo_flow.errors import ActorFault, RunError
from dapo_flow.runtime import watchdog
from dapo_flow.runtime.recovery import Recovered, heal
from dapo_flow.runtime.watchdog import StepWatchdog


class FakeSession:
    """Stands for run_session: fails at the given steps in turn (each an ActorFault of run
    'r1'), then finishes; records how it was called."""

    def __init__(self, failing_steps: list[int | None]):
        self.failing = list(failing_steps)
        self.calls: list[tuple] = []

    def __call__(self, *, resume, recovery, **_):
        self.calls.append((resume, recovery))
        if self.failing:
            fault = ActorFault("the actor of stage 'model:policy' died: killed")
            fault.run_id, fault.step = "r1", self.failing.pop(0)
            raise fault
        return {"run_id": "r1"}


def _heal(session, max_failures=3, has_checkpoint=lambda run_id: True):
    said: list[str] = []
    out = heal(session, max_failures=max_failures, resume=False, say=said.append, has_checkpoint=has_checkpoint)
    return out, said


def test_each_fault_resumes_the_same_run_until_it_finishes():
    session = FakeSession([5, 9])
    out, said = _heal(session)
    assert out == {"run_id": "r1"}
    assert [resume for resume, _ in session.calls] == [False, "r1", "r1"]
    assert [(r.step, r.count) for _, r in session.calls[1:]] == [(5, 1), (9, 2)]
    assert len(said) == 2 and "fault at step 5" in said[0] and "recovering (1 of at most 3)" in said[0]


def test_a_restart_that_loses_an_actor_again_is_the_same_recovery_tried_again():
    """Step 5 fails; the restart loses an actor before any step (step None: a node not yet known
    dead took one): tried again, the faults/* still for step 5, timed from the first fault."""
    session = FakeSession([5, None])
    _heal(session)
    (_, first), (_, second) = session.calls[1:]
    assert (second.step, second.count, second.at) == (5, 2, first.at)
    with pytest.raises(ActorFault):  # within the same limit
        _heal(FakeSession([5, None, None, None]))


@pytest.mark.parametrize("failing, max_failures, why", [
    ([3, 4, 5, 6], 3, "run.max_failures (3)"),
    ([4, 4], 3, "step 4 failed twice in a row"),
    ([2], 0, None),  # max_failures 0: the first fault stops the run, quietly
])
def test_a_run_stops_with_the_faults_error(failing, max_failures, why):
    session = FakeSession(failing)
    said: list[str] = []
    with pytest.raises(ActorFault, match="died"):
        heal(session, max_failures=max_failures, resume=False, say=said.append, has_checkpoint=lambda r: True)
    assert len(session.calls) == min(len(failing), max_failures + 1)
    assert (why is None and not said) or why in said[-1]


def test_without_a_checkpoint_there_is_nothing_to_resume():
    with pytest.raises(ActorFault):
        _heal(FakeSession([1]), has_checkpoint=lambda run_id: False)


def test_other_errors_are_not_faults():
    def broken(**_):
        raise RunError("a bad row")

    with pytest.raises(RunError, match="a bad row"):
        _heal(broken)


def test_fault_metrics_are_logged_once_at_the_step_that_failed():
    recovered = Recovered(step=5, at=time.monotonic() - 2.0, count=1, resumed_at=2)
    assert recovered.metrics(3) == {} and recovered.metrics(4) == {}
    got = recovered.metrics(5)
    assert got["faults/count"] == 1.0 and got["faults/steps_redone"] == 2.0 and got["faults/seconds_lost"] >= 2.0
    assert recovered.metrics(5) == {}  # once
    early = Recovered(step=None, at=time.monotonic(), count=2, resumed_at=4)  # failed before a step
    assert early.metrics(5)["faults/steps_redone"] == 0.0


def test_the_hang_bound_follows_the_slowest_step(monkeypatch):
    monkeypatch.delenv("DAPO_FLOW_CALL_TIMEOUT", raising=False)
    dog = StepWatchdog()
    assert dog.bound() == watchdog.DEFAULT_CALL_TIMEOUT_S  # the first step loads and warms up
    dog.observe(2.0)
    assert dog.bound() == watchdog.FLOOR_S
    dog.observe(30.0)
    dog.observe(10.0)
    assert dog.bound() == 300.0
    dog.observe(500.0)
    assert dog.bound() == watchdog.DEFAULT_CALL_TIMEOUT_S  # never past the call timeout
    monkeypatch.setenv("DAPO_FLOW_CALL_TIMEOUT", "60")
    assert StepWatchdog(fixed=90.0).bound() == 60.0 and StepWatchdog(fixed=20.0).bound() == 20.0


class FakeRay:
    """Ray whose ``get`` raises ``error`` (a real ray.exceptions instance), for RayExecutor._get."""

    def __init__(self, error: Exception):
        import ray

        self.exceptions, self.error = ray.exceptions, error

    def get(self, handle, timeout=None):
        raise self.error


def _lost_table():
    from ray.exceptions import ObjectLostError

    return ObjectLostError("ab" * 14, None, "call site")


@pytest.mark.parametrize("error, said", [
    (_lost_table, "the result of an actor was lost with its node: All copies of"),
    (lambda: __import__("ray").exceptions.NodeDiedError("node 1f2e died"),
     "the result of an actor was lost with its node"),
    (lambda: __import__("ray").exceptions.RayTaskError("f", "tb", _lost_table()),
     "an actor lost a table it read with the node that held it"),
])
def test_a_table_lost_with_its_node_is_a_fault_to_recover_from(error, said):
    from dapo_flow.runtime.executors import RayExecutor
    from dapo_flow.runtime.watchdog import StepWatchdog

    ex = object.__new__(RayExecutor)  # only what _get reads
    ex._ray, ex.actors, ex.watchdog = FakeRay(error()), {}, StepWatchdog()
    with pytest.raises(ActorFault, match="--resume") as info:
        ex._get(object(), 1.0)
    assert said in str(info.value) and not info.value.hung


# --- real runs: actors killed and stopped ------------------------------------------------------


def _actor_pid(executor, stage: str) -> int:
    """The process of ``stage``'s actor."""
    import ray

    return ray.get(executor.actors[stage].__ray_call__.remote(lambda _self: os.getpid()), timeout=60)


def _signal_after_checkpoint(workdir, started: list, stage: str, sig: int, step: int) -> threading.Thread:
    """A thread that sends ``sig`` to the process of ``stage``'s actor of the first executor
    started once the checkpoint of ``step`` is written (the run then trains the steps after it)."""

    def send() -> None:
        deadline = time.monotonic() + 300
        while not started and time.monotonic() < deadline:
            time.sleep(0.01)
        pid = _actor_pid(started[0], stage)  # asked now: later it would queue behind the step's calls
        while not list(workdir.glob(f"dapo-flow-runs/checkpoints/*/*/step_{step:06d}/manifest.json")):
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)
        os.kill(pid, sig)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


STEPS = 8
WALL_CLOCK = ("time/", "perf/", "faults/", "gen/seconds", "gen/tokens_per_s")


def _history(summary) -> dict:
    from dapo_flow.tracking import read_run

    return read_run(summary["tracking_uri"], summary["run_id"])["history"]


def _deterministic(history: dict) -> dict:
    return {k: v for k, v in history.items() if not k.startswith(WALL_CLOCK)}


def _run(workdir, path, executor: str, *edits, address: str | None = None):
    from rich.console import Console

    from dapo_flow.graph.edits import edit_file, parse_cli_edits
    from dapo_flow.graph.plan import Cluster
    from dapo_flow.runtime import execute

    placed = edit_file(str(path), parse_cli_edits([("set", e) for e in edits])).compile(Cluster(cpus=2))
    with open(workdir / f"{executor}.log", "a") as log:
        return execute(placed, executor=executor, address=address, console=Console(file=log, width=200))


def _assert_healed_once(healed: dict, straight: dict, log, steps: int = STEPS) -> int:
    """Every step once, the fault logged once, the weights as if uninterrupted; the steps redone."""
    history = _history(healed)
    for key in ("batch/reward_mean", "actor/pg_loss"):  # every step exactly once
        assert [s for s, _ in history[key]] == list(range(1, steps + 1)), key
    [(step, count)] = history["faults/count"]
    assert count == 1.0 and 2 < step <= steps
    [(_, redone)] = history["faults/steps_redone"]
    [resumed_at] = re.findall(r"resuming from \S*step_(\d+)", log.read_text())
    assert redone == step - 1 - int(resumed_at)  # the steps after the checkpoint, trained again
    assert _deterministic(history) == _deterministic(_history(straight))  # the weights came back exactly
    return int(redone)


#: the training actor is killed as a step chosen at random (seeded) begins, not right after a
#: checkpoint: the steps since the checkpoint are trained again (CKPT 3: checkpoints 3, 6, 8)
CKPT = 3
KILL_AT = random.Random(2026).choice([k for k in range(CKPT + 2, STEPS + 1) if (k - 1) % CKPT])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_training_actor_killed_at_a_random_step_is_replaced_and_the_run_ends_as_if_not(workdir, small_graph,
                                                                                          at_step, executors_started):
    path = small_graph(workdir, name="healing", steps=STEPS, ckpt=CKPT)
    pid = []
    at_step(1, lambda ex: pid.append(_actor_pid(ex, "model:policy")))  # asked while it is idle
    at_step(KILL_AT, lambda ex: os.kill(pid[0], signal.SIGKILL))
    healed = _run(workdir, path, "ray")
    assert len(executors_started) == 2  # started again once
    assert "the actor of stage 'model:policy' died" in (workdir / "ray.log").read_text()
    redone = _assert_healed_once(healed, _run(workdir, path, "local"), workdir / "ray.log")
    assert redone == (KILL_AT - 1) % CKPT > 0  # the steps since the last checkpoint, trained twice


def _node_of(executor, stage: str) -> str:
    """The Ray node id of ``stage``'s actor."""
    import ray

    return ray.get(executor.actors[stage].__ray_call__.remote(
        lambda _self: __import__("ray").get_runtime_context().get_node_id()), timeout=60)


def _remove(cluster, node) -> None:
    """Remove ``node`` abruptly (its raylet and workers killed) and wait until Ray knows it is dead
    (missed heartbeats): a restart before that may place an actor on it, and recovers again (a
    unit test above), which this test would count as a second fault."""
    import ray

    cluster.remove_node(node, allow_graceful=False)
    deadline = time.monotonic() + 120
    while any(n["NodeID"] == node.node_id and n["Alive"] for n in ray.nodes()) and time.monotonic() < deadline:
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_node_removed_mid_run_heals_onto_the_node_left(workdir, small_graph, at_step, executors_started,
                                                         monkeypatch):
    """A simulated two-node cluster (ray.cluster_utils): the training actor starts on the second
    node (pinned there for the first start only: Ray would put it on the head), the node is
    removed mid-step, and the run heals onto the head: actors ask only for CPUs and GPUs (a
    training group's placement group is PACK or SPREAD, both soft), so nothing ties them to a
    node that is gone."""
    import ray
    import ray.actor
    from ray.cluster_utils import Cluster as RayCluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    assert not ray.is_initialized(), "a Ray of this process is up: an earlier test left it running"
    cluster = RayCluster(initialize_head=True, head_node_args={"num_cpus": 1})
    second = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    head = cluster.head_node.node_id
    options = ray.actor.ActorClass.options

    def pinned(self, **kw):  # the first start's CPU actors on the second node
        if not executors_started and kw.get("num_cpus") and "scheduling_strategy" not in kw:
            kw["scheduling_strategy"] = NodeAffinitySchedulingStrategy(second.node_id, soft=False)
        return options(self, **kw)

    monkeypatch.setattr(ray.actor.ActorClass, "options", pinned)
    steps, nodes = 4, []
    path = small_graph(workdir, name="node-lost", steps=steps, ckpt=2)
    at_step(1, lambda ex: nodes.append(_node_of(ex, "model:policy")))
    at_step(4, lambda ex: _remove(cluster, second))  # after checkpoint 2 and step 3
    at_step(3, lambda ex: nodes.append(_node_of(ex, "model:policy")), session=1)  # resumed from 2
    try:
        healed = _run(workdir, path, "ray", address=cluster.address)
    finally:
        ray.shutdown()
        cluster.shutdown()
    assert nodes == [second.node_id, head]
    assert len(executors_started) == 2
    assert _assert_healed_once(healed, _run(workdir, path, "local"), workdir / "ray.log", steps=steps) == 1


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_hung_rollout_actor_is_found_within_the_bound_and_replaced(workdir, small_graph, executors_started):
    """SIGSTOP: the process is there and answers nothing (a stuck kernel, a deadlock)."""
    path = small_graph(workdir, name="hanging", steps=STEPS, ckpt=2)
    disaggregated = ("placement.mode=disaggregated",)
    stopper = _signal_after_checkpoint(workdir, executors_started, "rollout:policy", signal.SIGSTOP, step=2)
    healed = _run(workdir, path, "ray", *disaggregated, "run.hang_timeout_s=20")
    stopper.join()
    assert len(executors_started) == 2
    assert "the actor of stage 'rollout:policy' did not answer within 20 s" in (workdir / "ray.log").read_text()
    _assert_healed_once(healed, _run(workdir, path, "local", *disaggregated), workdir / "ray.log")
