"""A TCP port to listen on: a process group's master, a weight bus, a test's server.

Asking the kernel for port 0 returns one from its ephemeral range, the same range every
outbound connection draws its local port from. Between closing that probe socket and the real
listener binding, any connection on the machine (Ray's processes open many) can take the port,
and the listener fails with EADDRINUSE. A port below the ephemeral range is never handed out
to connections, so a probe that binds one leaves it free unless a process binds it by number.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 20000  # below: Ray's worker ports (10002-19999 by default), its client port 10001, GCS 6379
TRIES = 64


def ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux's default 32768 elsewhere)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that binds on ``host`` now and that no outbound connection will take: drawn at
    random below the ephemeral range (the kernel's pick from port 0 if none binds)."""
    top = ephemeral_start() - 1
    for port in random.sample(range(LOWEST, top), min(TRIES, max(top - LOWEST, 0))):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]

