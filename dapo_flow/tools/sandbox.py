"""python: run the model's code in a fresh, isolated interpreter with time, memory and output limits.

Each call writes the code to ``main.py`` in a new temporary directory (removed afterwards) and
runs Python (``-I -u``; isolated, the base interpreter with the standard library only, not the
environment's packages) on it in its own process group, with a nearly empty environment (one
BLAS thread, HOME and TMPDIR in its working directory) and stdin closed. By default
(``isolation: bwrap``) the program runs in a bubblewrap sandbox
(:mod:`dapo_flow.tools.isolation`): no network, no view of the host's files (the user's home,
the project, checkpoints, the MLflow store), its own PID namespace, so nothing it starts
outlives the call, and, when dapo-flow runs as root, the uid ``nobody``. A machine without
bubblewrap refuses the graph at validate time, unless the tool says ``isolation: none``: then
the program runs as this user with the limits below only (a warning is logged every run). Limits:

- wall clock ``timeout_s``: then the whole process group is killed, children included;
- address space ``memory_mib`` (RLIMIT_AS): a big allocation raises MemoryError;
- CPU time ``ceil(timeout_s) + 1`` s (RLIMIT_CPU): threads burning several cores;
- ``max_file_mib`` per file written (RLIMIT_FSIZE), the captured output included, so a flood of
  prints cannot fill the disk or this process's memory; isolated, also the size of the only
  writable directory (a tmpfs), so many files cannot either;
- isolated, ``max_processes`` (RLIMIT_NPROC): a fork bomb stops there.

Output (stdout and stderr interleaved as a terminal shows them, unbuffered so what was printed
before a timeout is kept) is cut to ``max_output_chars``, keeping its head and tail. The limits
are set by the child's first statements, not in a ``preexec_fn``, which is unsafe in a process
with threads: the agent loop calls tools from worker threads. Linux only.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from dapo_flow.core.contract import PARAMS_CONFIG
from dapo_flow.tools import isolation
from dapo_flow.tools.base import ToolError, ToolResult, error_result

MIB = 2**20


class Config(BaseModel):
    model_config = PARAMS_CONFIG

    timeout_s: float = Field(5.0, gt=0, le=600)
    """Wall-clock limit; set by the tool's `timeout_s:` in the graph, not under `config:`."""
    memory_mib: int = Field(512, ge=64, le=1_048_576)
    """Address-space limit (RLIMIT_AS) of the process, interpreter included."""
    max_output_chars: int = Field(4000, ge=100, le=1_000_000)
    """Longest output the model sees; longer output keeps its head and its tail."""
    max_file_mib: int = Field(16, ge=1, le=65_536)
    """Largest file the code may write, its captured output included (RLIMIT_FSIZE); isolated,
    also the size of its writable directory."""
    isolation: Literal["bwrap", "none"] = "bwrap"
    """`bwrap`: each program in a bubblewrap sandbox (no network, no host files, nothing
    outlives the call). `none`: as this user with the limits only, for code you trust."""
    max_processes: int = Field(64, ge=1, le=4096)
    """Processes (and threads) the program may run at once, isolated only (RLIMIT_NPROC). Where
    dapo-flow runs as root the programs run as `nobody`, so the calls running at once share it."""


SCHEMA = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run a Python 3 program and return what it prints (stdout and stderr). "
                       "Each call starts a fresh interpreter; print the values you need.",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the program"}},
            "required": ["code"],
        },
    },
}

# Runs in the child before the code: limits first (then, isolated as root, nobody's uid), then
# the network stubs (isolated, a clear message where the sandbox has no network anyway), then
# main.py with its traceback shown from main.py on (the preamble's own frame is left out).
_PREAMBLE = """\
import os as _os, resource as _r, socket as _s, sys as _sys, traceback as _tb
for _what, _value in ((_r.RLIMIT_AS, {memory}), (_r.RLIMIT_CPU, {cpu}), (_r.RLIMIT_FSIZE, {fsize}),
                      (_r.RLIMIT_CORE, 0)) + {nproc}:
    _hard = _r.getrlimit(_what)[1]
    _value = _value if _hard == _r.RLIM_INFINITY else min(_value, _hard)
    _r.setrlimit(_what, (_value, _value))
if {drop_root}:
    _os.setgroups([]); _os.setresgid({nobody}, {nobody}, {nobody}); _os.setresuid({nobody}, {nobody}, {nobody})
def _no_network(*args, **kwargs):
    raise OSError("network access is disabled in the sandbox")
class _NoSocket(_s.socket):
    def __init__(self, *args, **kwargs):
        _no_network()
_s.socket = _s.SocketType = _NoSocket
_s.create_connection = _s.create_server = _s.socketpair = _s.fromfd = _s.getaddrinfo = _no_network
try:
    exec(compile(open("main.py").read(), "main.py", "exec"), {{"__name__": "__main__", "__file__": "main.py"}})
except SystemExit:
    raise
except BaseException as _e:
    _tb.print_exception(type(_e), _e, _e.__traceback__.tb_next)
    _sys.exit(1)
"""


class PythonSandbox:
    """The built-in ``python`` tool: stateless, no reward of its own."""

    Config = Config
    name = "python"
    schema = SCHEMA

    def __init__(self, config: Config | None = None):
        self.config = config or Config()
        self._warned = False
        if self.config.isolation == "bwrap":
            why = isolation.problem()  # at validate time too: the graph builds its tools to check them
            if why:
                raise ToolError(f"the python tool runs each program isolated (isolation: bwrap), but {why}")

    def create(self, instance_id: str, **create_kwargs: Any) -> None:
        pass

    def execute(self, instance_id: str, arguments: dict[str, Any]) -> ToolResult:
        if self.config.isolation == "none" and not self._warned:  # once per run: each run builds its tools
            self._warned = True
            logging.getLogger("dapo_flow").warning(
                "the python tool runs programs without isolation (isolation: none): they run as this user "
                "and can reach its files and the network; only for code you trust")
        code = arguments.get("code")
        if not isinstance(code, str):
            return error_result("give the program as a string argument 'code'")
        try:
            return run_python(code, self.config)
        except (OSError, ValueError) as exc:  # no process, no temp dir, unencodable code: the call fails
            return error_result(f"the sandbox could not run the program: {exc}")

    def calc_reward(self, instance_id: str) -> float:
        return 0.0

    def release(self, instance_id: str) -> None:
        pass


def run_python(code: str, cfg: Config) -> ToolResult:
    """Run ``code`` under ``cfg``'s limits; the outcome, failures included, as a ToolResult."""
    cpu_s = math.ceil(cfg.timeout_s) + 1  # the wall clock fires first for one busy thread
    isolated = cfg.isolation == "bwrap"
    nproc = f"((_r.RLIMIT_NPROC, {cfg.max_processes}),)" if isolated else "()"
    preamble = _PREAMBLE.format(memory=cfg.memory_mib * MIB, cpu=cpu_s, fsize=cfg.max_file_mib * MIB, nproc=nproc,
                                drop_root=isolated and isolation.drops_to_nobody(), nobody=isolation.NOBODY)
    with tempfile.TemporaryDirectory(prefix="dapo-flow-python-", ignore_cleanup_errors=True) as root:
        work, out_path = Path(root) / "work", Path(root) / "output.txt"
        work.mkdir()
        (work / "main.py").write_text(code, encoding="utf-8")
        home = isolation.WORKDIR if isolated else str(work)
        env = {"PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LC_ALL": "C.UTF-8",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        args = ["-I", "-u", "-c", preamble]
        if isolated:
            argv = isolation.bwrap_argv(work / "main.py", disk_bytes=cfg.max_file_mib * MIB, env=env) + args
        else:
            argv = [sys.executable, *args]
        with open(out_path, "wb") as out:
            proc = subprocess.Popen(argv, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            finished = _wait_unreaped(proc.pid, cfg.timeout_s)
            _kill_group(proc.pid)  # on timeout, and any children left running in the background
            returncode = proc.wait()
        if isolated and returncode > 128 and (returncode - 128) in _SIGNALS:
            returncode = 128 - returncode  # bwrap exits 128 + N for a program killed by signal N
        output, truncated = _read_output(out_path, cfg.max_output_chars)
        wrote_limit = out_path.stat().st_size >= cfg.max_file_mib * MIB
    return _report(output, returncode, timed_out=not finished, truncated=truncated,
                   output_limit=wrote_limit, cfg=cfg, cpu_s=cpu_s)


_SIGNALS = {int(s) for s in signal.Signals}


def _report(output: str, returncode: int, *, timed_out: bool, truncated: bool, output_limit: bool,
            cfg: Config, cpu_s: int) -> ToolResult:
    oom = returncode != 0 and not timed_out and "MemoryError" in output
    cpu = returncode == -signal.SIGXCPU
    killed = returncode < 0 and not timed_out
    problem = ""
    if timed_out:
        problem = f"timed out after {cfg.timeout_s:g} s; the program was killed"
    elif oom:
        problem = f"out of memory (the limit is {cfg.memory_mib} MiB)"
    elif cpu:
        problem = f"CPU time limit of {cpu_s} s exceeded; the program was killed"
    elif output_limit:
        problem = f"output or a file reached the size limit of {cfg.max_file_mib} MiB"
    elif killed:
        problem = f"the program was killed by {signal.Signals(-returncode).name}"
    elif returncode > 0 and not output.strip():
        problem = f"the program exited with code {returncode}"
    text = output if not problem else f"{output.rstrip()}\nerror: {problem}".lstrip()
    metrics = {"error": float(returncode != 0 or timed_out), "timeout": float(timed_out),
               "oom": float(oom), "killed": float(killed), "returncode": float(returncode),
               "truncated": float(truncated)}
    return ToolResult(text=text, metrics=metrics)


def _wait_unreaped(pid: int, timeout_s: float) -> bool:
    """Whether the process exits within ``timeout_s``. It is left a zombie: its pid, which is its
    group's id, stays taken until ``wait``, so killing the group after cannot hit a stranger."""
    deadline, delay = time.monotonic() + timeout_s, 0.001
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(2 * delay, 0.02)
    return True


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nobody left in the group


def _read_output(path: Path, max_chars: int) -> tuple[str, bool]:
    """The output cut to ``max_chars`` (head and tail kept), and whether it was cut. Reads at most
    a few times ``max_chars`` bytes, whatever the file's size."""
    size, budget = path.stat().st_size, 4 * max_chars  # a character is at most 4 UTF-8 bytes
    with open(path, "rb") as f:
        if size <= budget:
            text = f.read().decode("utf-8", errors="replace")
            if len(text) <= max_chars:
                return text, False
            head, tail = text, text
        else:
            head = f.read(budget // 2).decode("utf-8", errors="ignore")
            f.seek(size - budget // 2)
            tail = f.read().decode("utf-8", errors="ignore")
    half = max_chars // 2
    return f"{head[:half]}\n[... output cut: {size} bytes in all ...]\n{tail[-half:]}", True
