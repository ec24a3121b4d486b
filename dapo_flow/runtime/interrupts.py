"""Ctrl-C for a training run: never lost, never in the middle of a write."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class CtrlC:
    """Ctrl-C raises KeyboardInterrupt as usual and is also remembered: Python drops an
    exception raised while a finalizer (a weakref callback, ``__del__``) runs, and the run would
    then carry on, so the loop raises it again at the next step boundary (``check``).

    Inside ``held()`` (checkpoint and MLflow writes) Ctrl-C is only remembered and raised when
    the block ends: an interrupt in the middle of a sqlite commit leaves the database locked
    for the rest of the process, and the run could then not even be marked KILLED."""

    def __init__(self) -> None:
        self.pressed = False
        self._holding = 0
        self._previous = None
        self._unraisable = sys.unraisablehook

    def __enter__(self) -> CtrlC:
        if threading.current_thread() is threading.main_thread():  # signals go to the main thread
            self._previous = signal.signal(signal.SIGINT, self._handle)
            sys.unraisablehook = self._quiet_dropped_interrupt
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            sys.unraisablehook = self._unraisable

    def _quiet_dropped_interrupt(self, unraisable) -> None:  # noqa: ANN001 - sys.UnraisableHookArgs
        # the interrupt is remembered and re-raised by `check`: no "Exception ignored" traceback
        if not (self.pressed and issubclass(unraisable.exc_type, KeyboardInterrupt)):
            self._unraisable(unraisable)

    def _handle(self, signum, frame) -> None:  # noqa: ANN001 - signal handler signature
        self.pressed = True
        if not self._holding:
            raise KeyboardInterrupt

    def check(self) -> None:
        if self.pressed:
            raise KeyboardInterrupt

    @contextmanager
    def held(self, then_raise: bool = True) -> Iterator[None]:
        """Ctrl-C inside is raised when the block ends (``then_raise``) or only remembered."""
        self._holding += 1
        try:
            yield
        finally:
            self._holding -= 1
        if then_raise and not self._holding:
            self.check()
