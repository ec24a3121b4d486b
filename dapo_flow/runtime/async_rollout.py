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
        self.behind: int | None = None  # see _queue_behind
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
                            self._queue_behind()
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

    def step(self, state: LoopState, queue_next: bool = False) -> dict[str, float]:
        """One training step on the oldest batch collected (waiting for it), then the weight
        sync, then the producer may run one step further ahead. Returns the step's metrics
        (but for time/step and what follows it).

        Where calls queue (Ray) and weights go in between generations (no partial rollouts),
        the sync is queued behind the update at once and the producer moves on then (its next
        generation queued behind the sync); with ``queue_next``, the next batch, once collected
        (now, or by the producer while this update runs), has its update queued behind the sync:
        the trainer goes from one update to the next without waiting for the driver. Not where
        the trainer is a group of workers: the sync waits for the generations queued before it on
        the rollout actors, and the other workers would wait for it in the next update's
        collectives (bounded by their timeout, fsdp.COLLECTIVE_TIMEOUT_S)."""
        runner = self.runner
        with self.cond:
            update, runner.queued = runner.queued, None
            self.behind = None
        if update is None:
            update = runner.submit_update(self._take(), state.policy_version)
        rollout = update.rollout
        trained = rollout.batch is not None
        early = trained and runner.ex.queues_calls and not runner.run.partial_rollouts
        sync = self._submit_sync(update.version + 1) if early else None
        if early:
            with self.cond:
                self.steps_done += 1
                if queue_next and runner.senders_train_alone:
                    self.behind = update.version + 1
                    self._queue_behind()
                self.cond.notify_all()
        metrics = dict(rollout.metrics)
        metrics.update(runner.finish_update(state, update))
        if trained:
            metrics.update(runner.finish_sync(sync or self._submit_sync(state.policy_version)))
        if not early:
            with self.cond:
                self.steps_done += 1
                self.cond.notify_all()
        return metrics

    def _submit_sync(self, version: int):
        """Queue the weight sync; where a replacement of a lost rollout replica is up, with the
        producer paused (no generation call queued on the replicas) while it joins."""
        if not self.runner.replacements_due():
            return self.runner.submit_sync(version, admit=False)
        with self.paused():
            return self.runner.submit_sync(version)

    def _queue_behind(self) -> None:
        """(``cond`` held) Where the driver asked for it (``behind``: the version the next
        update trains) and a batch is collected, queue its update: behind the sync just queued."""
        if self.behind is not None and self.ready and self.runner.queued is None:
            self.runner.queued = self.runner.submit_update(self._pop(0.0), self.behind)
            self.behind = None

    def _take(self) -> Rollout:
        """The oldest batch collected (waiting for one), with how long the trainer waited for it
        and how many batches were collected beyond it (``time/trainer_wait``,
        ``rollout/buffer_depth``) in its metrics."""
        start = time.perf_counter()
        with self.cond:
            self._wait(lambda: bool(self.ready))
            return self._pop(time.perf_counter() - start)

    def _pop(self, waited: float) -> Rollout:
        """(``cond`` held) The oldest batch collected, out of the buffer, its metrics telling how
        long the trainer waited for it and how many batches were collected beyond it."""
        rollout = self.ready.popleft()
        rollout.metrics["rollout/buffer_depth"] = float(len(self.ready))
        rollout.metrics["time/trainer_wait"] = waited
        return rollout

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
