"""Reward servers for tests, all on loopback: `dapo-flow serve-reward` as a real subprocess,
or an app (the real one, or a Fake*) served by uvicorn in a thread of the test process."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx

START_S = 120.0  # a loaded 2-core box imports dapo_flow slowly; past this the test fails, never hangs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_reward(ref: str, port: int, cwd: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    """`dapo-flow serve-reward REF --port PORT` started and answering /health."""
    proc = subprocess.Popen([sys.executable, "-m", "dapo_flow.cli", "serve-reward", ref, "--port", str(port), *args],
                            cwd=cwd, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"serve-reward exited {proc.returncode}: {proc.stdout.read()}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2, trust_env=False).status_code == 200:
                return proc
        time.sleep(0.1)
    stop(proc)
    raise AssertionError(f"serve-reward did not answer /health within {START_S:.0f} s")


def stop(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, sig)
    proc.wait(timeout=30)
    if proc.stdout:
        proc.stdout.close()


@contextlib.contextmanager
def threaded(app) -> Iterator[str]:
    """``app`` served by uvicorn in a thread on a free loopback port; yields its URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + START_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
