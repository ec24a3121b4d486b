"""The python tool's isolation: each program runs in a bubblewrap (``bwrap``) sandbox.

bubblewrap is the unprivileged sandboxing tool Flatpak runs on (Debian/Ubuntu: ``apt-get install
bubblewrap``). :func:`bwrap_argv` gives a program:

- new network, PID, IPC and UTS namespaces: no network (the namespace has its own loopback, on
  which nothing listens; the host's is out of reach), no process of the host visible or
  signallable, and when the program exits or is killed the namespace's init dies and the kernel
  kills whatever it left running, detached children included (``--die-with-parent`` kills the
  sandbox when the caller dies);
- a root file system of its own: ``/usr`` (and the ``/lib``, ``/bin`` links) and the Python
  installation read-only, a fresh ``/proc`` and minimal ``/dev``, and a size-capped tmpfs as its
  only writable place (``/tmp``, its working directory). The user's home, the project, the
  checkpoints and the MLflow store are not in it;
- an empty environment but for the variables the caller sets, every capability dropped, and a
  new session (no terminal to inject keystrokes into);
- as root, the program drops to ``nobody`` (65534) before its first statement, so the process
  limit (RLIMIT_NPROC, which does not bind root) stops a fork bomb; as another user it runs in a
  user namespace of its own, where that limit counts only the sandbox's processes.

:func:`problem` says, once per process, whether this machine can run it (the graph is refused at
validate time otherwise).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

INSTALL = ("install bubblewrap (Debian/Ubuntu: `apt-get install bubblewrap`; Fedora: `dnf install bubblewrap`), "
           "or set `isolation: none` under the python tool's config: to run programs without a sandbox "
           "(not a security boundary: only for code you trust)")
#: The uid/gid a program runs as when dapo-flow runs as root.
NOBODY = 65534
#: The sandbox's only writable directory, also its working directory.
WORKDIR = "/tmp"


def interpreter() -> Path:
    """The base Python interpreter (not a virtual environment's link to it: the sandbox holds
    the standard library only, none of the project's packages)."""
    return Path(os.path.realpath(getattr(sys, "_base_executable", sys.executable)))


def _system_dirs() -> list[str]:
    """Read-only binds (or links, on a merged-/usr system) of what a dynamically linked
    interpreter needs outside its own prefix."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("/lib", "/lib64", "/lib32", "/bin", "/sbin"):
        if os.path.islink(name):
            args += ["--symlink", os.readlink(name), name]
        elif os.path.isdir(name):
            args += ["--ro-bind", name, name]
    if os.path.isfile("/etc/ld.so.cache"):  # where the loader looks for shared libraries
        args += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    return args


def _python_prefix() -> list[str]:
    """The interpreter's installation, read-only, at its own path; the folders above it are made
    world-readable in the sandbox (bubblewrap makes them 0700, and they may be under /root)."""
    prefix = Path(os.path.realpath(sys.base_prefix))
    if prefix == Path("/usr") or Path("/usr") in prefix.parents:
        return []
    parents = [p for p in reversed(prefix.parents) if p != Path("/")]
    args = [a for p in parents for a in ("--perms", "0755", "--dir", str(p))]
    return args + ["--ro-bind", str(prefix), str(prefix)]


def bwrap_argv(main_py: Path, *, disk_bytes: int, env: dict[str, str]) -> list[str]:
    """The command that runs the Python program ``main_py`` (a host file, bound read-only as
    ``/tmp/main.py``) isolated; the caller appends the interpreter's arguments."""
    argv = [shutil.which("bwrap") or "bwrap",
            "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    # root keeps only what it needs to become nobody; another user gets a user namespace
    argv += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"] if drops_to_nobody() else ["--unshare-user"]
    argv += _system_dirs() + _python_prefix()
    argv += ["--proc", "/proc", "--dev", "/dev",
             "--perms", "1777", "--size", str(disk_bytes), "--tmpfs", WORKDIR,
             "--ro-bind", str(main_py), f"{WORKDIR}/main.py", "--chdir", WORKDIR, "--clearenv"]
    for key, value in env.items():
        argv += ["--setenv", key, value]
    return argv + ["--", str(interpreter())]


def drops_to_nobody() -> bool:
    """Whether the program must drop root itself (its first statements do)."""
    return os.geteuid() == 0


@functools.cache
def problem() -> str | None:
    """Why programs cannot run isolated on this machine, or None: bwrap missing, too old for
    ``--size``, or unable to make its namespaces (a container that forbids them). Tried once per
    process by running an empty program in the sandbox."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return f"bubblewrap (bwrap) is not installed; {INSTALL}"
    try:
        usage = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=30)
        if "--size" not in usage.stdout + usage.stderr:
            return f"the installed bubblewrap ({bwrap}) is too old: it has no --size (0.7 or newer has); {INSTALL}"
        empty = Path(os.devnull)
        probe = subprocess.run(bwrap_argv(empty, disk_bytes=2**20, env={}) + ["-I", "-c", "pass"],
                               capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bubblewrap ({bwrap}) could not be run: {exc}; {INSTALL}"
    if probe.returncode != 0:
        said = (probe.stderr or probe.stdout).strip().splitlines()
        return (f"bubblewrap ({bwrap}) cannot make its sandbox on this machine: {said[-1] if said else probe.returncode} "
                f"(in a container, allow user namespaces, or run the container with --privileged); "
                f"or set `isolation: none` under the python tool's config: (not a security boundary)")
    return None
