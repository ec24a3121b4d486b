"""``run.rollout_mode: async``: the rollout phase in a thread of the driver that keeps collecting
training batches ahead of the trainer, at most ``run.max_staleness`` steps ahead, while each
update's weights go to the rollout actors as soon as it is done.

A batch for step s is started only once step s - 1 - max_staleness is trained and its weights
synced, so every generation batch in it was queued under weights at most max_staleness versions
older than those that train on it (``Runner.rollout_version`` tags each; ``rollout/staleness`` is
the oldest one's gap). Neither side waits for the other while the bound allows; which version
samples which batch depends on timing, so a run is not reproducible to the bit as sync and
one_step_off runs are. A checkpoint pauses the thread between batches and saves what it holds.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from typing import Iterator

from dapo_flow.runtime.loop import LoopState, Rollout, Runner

WAIT_SLICE_S = 0.5  # waits are sliced so that Ctrl-C reaches the driver's thread


class RolloutProducer:
    """Collects the batches of steps ``state.step + 1 .. total`` in order (``ahead``: those a
    checkpoint held, first). Only its thread touches the rollout side of ``state`` (sampler
    position, carry, keep rate) until :meth:`paused` holds it."""

    def __init__(self, runner: Runner, state: LoopState, total: int, ahead: list[Rollout]):
        self.runner, self.state, self.total = runner, state, total
        self.bound = runner.run.max_staleness
        self.cond = threading.Condition()
        self.ready: deque[Rollout] = deque(ahead)
        self.steps_done = state.step
        self.next_step = state.step + len(ahead) + 1  # the step the next batch is for
        self.collecting = False
        self.pauses = 0
        self.stopped = False
        self.error: BaseException | None = None
        # a daemon: a run stopped by Ctrl-C or an error does not wait for its generation
        self.thread = threading.Thread(target=self._run, daemon=True, name="dapo-flow-rollout-async")
        self.thread.start()

    def _may_collect(self) -> bool:
        return (not self.pauses and self.next_step <= self.total
                and self.next_step <= self.steps_done + 1 + self.bound)

    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    self.cond.wait_for(lambda: self.stopped or self._may_collect())
                    if self.stopped:
                        return
                    self.collecting = True
                rollout, start = None, time.perf_counter()
                try:
                    rollout = self.runner.collect(self.state)
                    rollout.metrics["time/rollout_phase"] = time.perf_counter() - start
                finally:
                    with self.cond:  # the batch and the sampler's position move together
                        self.collecting = False
                        if rollout is not None:
                            self.ready.append(rollout)
                            self.next_step += 1
                        self.cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - raised again in the driver's thread (take)
            with self.cond:
                self.error = exc
                self.cond.notify_all()

    def _wait(self, until) -> None:
        """Wait (sliced) until ``until()``; the producer's error, raised here once it has one."""
        while not until():
            if self.error is not None:
                raise self.error
            self.cond.wait(WAIT_SLICE_S)

    def step(self, state: LoopState) -> dict[str, float]:
        """One training step on the oldest batch collected (waiting for it), then the weight
        sync, then the producer may run one step further ahead. Returns the step's metrics
        (but for time/step and what follows it)."""
        start = time.perf_counter()
        with self.cond:
            self._wait(lambda: bool(self.ready))
            rollout = self.ready.popleft()
            depth = len(self.ready)
        metrics = dict(rollout.metrics)
        metrics["time/trainer_wait"] = time.perf_counter() - start
        metrics["rollout/buffer_depth"] = float(depth)  # batches collected beyond this one
        metrics.update(self.runner.update(state, rollout))
        if rollout.batch is not None:
            metrics.update(self.runner.sync(state.policy_version))
        with self.cond:
            self.steps_done += 1
            self.cond.notify_all()
        return metrics

    @contextlib.contextmanager
    def paused(self) -> Iterator[list[Rollout]]:
        """No batch in flight while the block runs (it waits for the one being collected); yields
        the batches collected and not trained yet, in order: with the state, what a checkpoint
        saves."""
        with self.cond:
            self.pauses += 1
            try:
                self._wait(lambda: not self.collecting)
            except BaseException:
                self.pauses -= 1
                raise
            held = list(self.ready)
        try:
            yield held
        finally:
            with self.cond:
                self.pauses -= 1
                self.cond.notify_all()

    def stop(self) -> None:
        """No new batch after the one in flight (which the thread, a daemon, may still finish)."""
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
