"""Serve an OpenEnv app on a loopback port, in a process of its own, for as long as its owner lives.

An OpenEnv environment ships a FastAPI app (``create_app(EnvClass, ActionClass,
ObservationClass)`` in its ``server/app.py``), which it runs with ``uvicorn server.app:app``.
:class:`LoopbackServer` does that for a graph that names the app (``app: pkg.module:app`` or
``path/to/file.py:app``): ``python -m dapo_flow.envs.serve REF PORT`` binds 127.0.0.1 only, and
the owner waits for its ``GET /health`` before the first episode. The process dies with its
owner: stopped when the owner is collected or the interpreter exits, and sent SIGTERM by the
kernel if the owner's process is killed outright (Linux's parent-death signal, which fires when
the *thread* that started the server ends: start it from a thread that lives as long as it should).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

import httpx

from dapo_flow.tools.base import ToolError

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """In the server: SIGTERM when ``parent`` dies (set here, not in a preexec_fn, which is unsafe
    in a threaded parent such as a Ray actor); a parent already gone is checked after."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the owner's finalizer and atexit still stop it
        return
    if os.getppid() != parent:
        sys.exit("error: the process that started this server is gone")


class LoopbackServer:
    """``app_ref`` served at :attr:`url` (``http://127.0.0.1:PORT``) once the constructor returns."""

    def __init__(self, app_ref: str, start_timeout_s: float = 60.0):
        from dapo_flow.core.ports import free_port

        port = free_port()
        self.app_ref, self.url = app_ref, f"http://127.0.0.1:{port}"
        self._log = tempfile.TemporaryFile()  # the child's output (a file: a pipe could fill and block it)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dapo_flow.envs.serve", app_ref, str(port), str(os.getpid())],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT)
        self._finalizer = weakref.finalize(self, _stop, self.proc)
        self._wait_healthy(start_timeout_s)

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ToolError(f"the OpenEnv app {self.app_ref} did not start: its server exited with code "
                                f"{self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(0.2)
        self.stop()
        raise ToolError(f"the OpenEnv app {self.app_ref} did not answer GET {self.url}/health within "
                        f"{timeout_s:g} s (raise start_timeout_s if it starts slowly):\n{self.output()}")

    def output(self, limit: int = 2000) -> str:
        """The tail of what the server printed."""
        self._log.seek(0)
        return self._log.read().decode("utf-8", errors="replace")[-limit:]

    def stop(self) -> None:
        self._finalizer()


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str]) -> None:
    """``REF PORT PARENT_PID``: import the app ``REF`` names and serve it on 127.0.0.1:PORT."""
    ref, port, parent = argv
    _die_with_parent(int(parent))
    import uvicorn

    from dapo_flow.core.imports import ImportSpecError, load_object

    try:
        app = load_object(ref, base_dir=Path(os.getcwd()))
    except ImportSpecError as exc:
        sys.exit(f"error: {exc}")
    uvicorn.run(app, host="127.0.0.1", port=int(port), log_level="warning")


if __name__ == "__main__":
    main(sys.argv[1:])
