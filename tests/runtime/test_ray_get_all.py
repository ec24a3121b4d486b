"""RayExecutor.get of several calls at once (both sides of a weight sync): the first that fails is
raised when it fails, while the other side still waits (on a dead peer, in a collective, until its
own timeout)."""

from __future__ import annotations

import os
import time

import pytest

from dapo_flow.errors import RunError
from dapo_flow.runtime.executors import GroupCall, RayExecutor


def _executor_shell(ray, actors: dict) -> RayExecutor:
    """A RayExecutor with no stages started, only what ``get`` reads (its actors by stage, for
    names): a test-only shell."""
    from dapo_flow.runtime.watchdog import StepWatchdog

    ex = object.__new__(RayExecutor)
    ex._ray, ex.actors, ex.watchdog = ray, actors, StepWatchdog()
    return ex


@pytest.mark.slow  # a Ray cluster's start-up (5-40 s on 2 busy cores)
@pytest.mark.shared_ray
@pytest.mark.timeout(120)  # waiting for the sleeping side (600 s) would time the test out
def test_a_side_that_dies_is_named_while_the_other_still_waits():
    import ray

    @ray.remote(num_cpus=0)
    class Side:
        def wait(self, seconds: float) -> float:
            time.sleep(seconds)
            return seconds

        def die(self) -> None:
            os._exit(1)

    trainer, rollout, other = Side.remote(), Side.remote(), Side.remote()
    ex = _executor_shell(ray, {"model:policy": trainer, "rollout:policy": rollout})
    try:
        with pytest.raises(RunError, match=r"the actor of stage 'rollout:policy' died.*--resume"):
            ex.get((trainer.wait.remote(600), rollout.die.remote()))
        group = GroupCall("model:policy", [other.wait.remote(0.2), other.wait.remote(0.1)], join=list)
        assert ex.get((group, other.wait.remote(0.0))) == ([0.2, 0.1], 0.0)  # rank order, call order
    finally:
        for actor in (trainer, rollout, other):
            ray.kill(actor)


@pytest.mark.slow  # a Ray cluster's start-up
@pytest.mark.shared_ray
@pytest.mark.timeout(120)
def test_a_worker_killed_mid_collective_is_named_not_the_error_its_peer_saw_first():
    """Rank 1 dies; rank 0, in a collective with it, fails first with its own error (gloo: the
    connection reset by the dead peer): the run names the dead worker. A failure with every peer
    alive is reported as it is."""
    import ray

    @ray.remote(num_cpus=0)
    class Worker:
        def reset_by_peer(self) -> None:
            raise RuntimeError("gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer")

        def die_after(self, seconds: float) -> None:
            time.sleep(seconds)
            os._exit(1)

        def wait(self, seconds: float) -> float:
            time.sleep(seconds)
            return seconds

    survivor, killed, alive = Worker.remote(), Worker.remote(), Worker.remote()
    ex = _executor_shell(ray, {})
    try:
        group = GroupCall("model:policy", [survivor.reset_by_peer.remote(), killed.die_after.remote(0.5)], join=list)
        with pytest.raises(RunError, match=r"worker 1 of the training group of stage 'model:policy' died.*--resume"):
            ex.get(group)
        group = GroupCall("model:policy", [survivor.reset_by_peer.remote(), alive.wait.remote(0.1)], join=list)
        with pytest.raises(RunError, match="an operator failed inside an actor: .*Connection reset by peer"):
            ex.get(group)
    finally:
        for actor in (survivor, killed, alive):
            ray.kill(actor)
