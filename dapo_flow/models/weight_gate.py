"""A rollout engine's weights and their policy version, shared by a generation and a weight load.

Generation runs one decode step at a time inside :meth:`WeightGate.step`; a weight load (a sync
from the trainer, in another thread: ``run.partial_rollouts``) runs inside
:meth:`WeightGate.loading`. The two never overlap: a load waits for the decode step in flight
(milliseconds), then holds the next one until every weight is in; so every token is sampled from
one whole set of weights, and the version that step reads is the version of those weights. A
generation in flight when new weights arrive goes on with them from its next token (the partial
rollouts of AReaL / verl's fully async trainer).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator


class WeightGate:
    """The version of the weights an engine holds, and the lock between its decode steps and its
    weight loads. Versions count the RL steps trained into the weights (0: as loaded)."""

    def __init__(self, version: int = 0):
        self.version = version
        self._cond = threading.Condition()
        self._stepping = False
        self._loads = 0  # loads waiting or running: a step waits for them (loads go first)

    @contextlib.contextmanager
    def step(self) -> Iterator[int]:
        """One decode step (an engine step); yields the version of the weights it computes
        with, which no load changes until it exits."""
        with self._cond:
            self._cond.wait_for(lambda: not self._loads and not self._stepping)
            self._stepping = True
        try:
            yield self.version
        finally:
            with self._cond:
                self._stepping = False
                self._cond.notify_all()

    @contextlib.contextmanager
    def loading(self, version: int | None) -> Iterator[None]:
        """A weight load: waits for the decode step in flight, keeps the next from starting until
        it exits, then the weights are ``version`` (None: the version stays as it is, e.g. a
        load of weights that are not the trainer's)."""
        with self._cond:
            self._loads += 1
            self._cond.wait_for(lambda: not self._stepping)
            self._stepping = True
        try:
            yield
            if version is not None:
                self.version = version
        finally:
            with self._cond:
                self._loads -= 1
                self._stepping = False
                self._cond.notify_all()

    @property
    def waiting_loads(self) -> int:
        """Loads waiting for (or holding) the gate."""
        with self._cond:
            return self._loads

    def set_version(self, version: int) -> None:
        """The weights changed in place (a colocated trainer's optimizer step): now ``version``."""
        with self._cond:
            self.version = version
