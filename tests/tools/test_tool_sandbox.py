"""The python tool: results come back; loops, huge allocations, network use, floods of output
and background processes are stopped and reported; the temp dir goes away. Isolated (the
default, bubblewrap) unless a test names ``isolation="none"``; what the isolation keeps out is in
test_tool_escapes.py."""

from __future__ import annotations

import os
import signal
import socket
import tempfile
import time
from pathlib import Path

import pytest

from dapo_flow.tools.sandbox import Config, PythonSandbox


def run(code: str, **config):
    return PythonSandbox(Config(**config)).execute("r0", {"code": code})


def test_normal_code_prints_its_result():
    result = run("print(sum(range(10)) * 6)")
    assert result.text == "270\n"
    assert result.metrics == {"error": 0.0, "timeout": 0.0, "oom": 0.0, "killed": 0.0,
                              "returncode": 0.0, "truncated": 0.0}


def namespace_gone(ns: str) -> bool:
    """Whether no host process is left in the PID namespace ``ns`` (``pid:[N]``, as the program
    read it from /proc/self/ns/pid): the sandbox and all it started are gone. Waits up to a
    minute for killed processes to exit."""
    for _ in range(600):
        left = []
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and os.readlink(proc / "ns" / "pid") == ns:
                    left.append(proc.name)
            except OSError:
                pass  # exited meanwhile
        if not left:
            return True
        time.sleep(0.1)
    return False


PRINT_NS = "import os\nprint(os.readlink('/proc/self/ns/pid'), flush=True)\n"


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has ended (exited or killed, reaped or a zombie). A SIGKILLed
    process may take a moment to exit: waits up to a minute for it, and answers False then."""
    for _ in range(600):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("loop", ["pass", "time.sleep(0.01)"], ids=["busy", "sleeping"])
def test_an_infinite_loop_is_stopped_at_the_timeout_and_what_it_printed_is_kept(loop):
    # the sandbox's wall-clock timeout kills it (SIGKILL to its group), not the CPU-time limit
    # (that is SIGXCPU, and a sleeping loop never reaches it): the run returns, with the timeout
    # it was given, and the program is gone
    # 2 s: the sandbox and the interpreter start within it on a box busy with other tests
    result = run(PRINT_NS + f"import time\nprint('started')\nwhile True:\n    {loop}", timeout_s=2.0)
    assert result.metrics["timeout"] == 1.0 and result.metrics["error"] == 1.0
    assert result.metrics["returncode"] == -signal.SIGKILL
    ns, rest = result.text.split("\n", 1)
    assert rest == "started\nerror: timed out after 2 s; the program was killed"
    assert namespace_gone(ns)


def test_without_isolation_an_infinite_loop_and_its_child_are_killed_with_the_group(tmp_path):
    pid_file = tmp_path / "pid"
    code = (f"import os, subprocess, sys, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            f"open({str(pid_file)!r} + '.child', 'w').write(str(child.pid))\nwhile True:\n    pass")
    result = run(code, timeout_s=2.0, isolation="none")
    assert result.metrics["timeout"] == 1.0 and result.metrics["returncode"] == -signal.SIGKILL
    assert _gone(int(pid_file.read_text())) and _gone(int((tmp_path / "pid.child").read_text()))


def test_a_child_process_is_killed_with_the_sandbox():
    code = PRINT_NS + "import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
    result = run(code)
    assert result.metrics["error"] == 0.0, result.text
    assert namespace_gone(result.text.split()[0])  # the background child died with the call


def test_allocating_10_gb_is_a_memory_error():
    result = run("x = bytearray(10 * 2**30)\nprint('allocated')", memory_mib=256)
    assert result.metrics["oom"] == 1.0 and result.metrics["error"] == 1.0
    assert "MemoryError" in result.text and "allocated" not in result.text
    assert result.text.endswith("error: out of memory (the limit is 256 MiB)")


@pytest.mark.parametrize("isolation", ["bwrap", "none"])
def test_the_network_is_blocked(isolation):
    connect = run("import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)", isolation=isolation)
    raw = run("import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_STREAM)", isolation=isolation)
    for result in (connect, raw):
        assert result.metrics["error"] == 1.0
        assert "OSError: network access is disabled in the sandbox" in result.text
    if isolation == "bwrap":
        _assert_outside_the_hosts_network()


def _assert_outside_the_hosts_network():
    """The sandbox's own network namespace, not only the socket module's stubs: the program
    undoes them (``_socket`` is the C module under them), and still has a namespace other than
    the host's and no route to a listener on the host's loopback."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.setblocking(False)
    try:
        port = listener.getsockname()[1]
        code = ("import _socket, os\nprint(os.readlink('/proc/self/ns/net'))\n"
                "s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)\ns.settimeout(2)\n"
                f"try:\n    s.connect(('127.0.0.1', {port})); print('CONNECTED')\n"
                "except OSError as e:\n    print('refused', e.errno)")
        result = run(code, timeout_s=10.0)
        assert result.metrics["error"] == 0.0, result.text
        ns, outcome = result.text.splitlines()
        assert ns.startswith("net:[") and ns != os.readlink("/proc/self/ns/net"), result.text
        assert outcome.startswith("refused"), result.text
        with pytest.raises(BlockingIOError):  # nothing reached the host's listener
            listener.accept()
    finally:
        listener.close()


def test_runs_in_a_fresh_temp_dir_that_is_removed_afterwards(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the call makes its host temp dir
    first = run("import os\nopen('scratch.txt', 'w').write('x')\nprint(os.getcwd(), sorted(os.listdir('.')))")
    assert first.text == "/tmp ['main.py', 'scratch.txt']\n"
    assert run("import os\nprint(sorted(os.listdir('.')))").text == "['main.py']\n"  # nothing kept
    assert list(tmp_path.iterdir()) == []
    plain = run("import os\nopen('scratch.txt', 'w').write('x')\nprint(os.getcwd())", isolation="none")
    cwd = Path(plain.text.strip())
    assert cwd.name == "work" and cwd.parent.name.startswith("dapo-flow-python-")
    assert not cwd.parent.exists()


def test_the_environment_is_nearly_empty():
    os.environ["DAPO_FLOW_SECRET_FOR_TEST"] = "1"
    try:
        result = run("import os\nprint(sorted(os.environ))")
    finally:
        del os.environ["DAPO_FLOW_SECRET_FOR_TEST"]
    assert "DAPO_FLOW_SECRET_FOR_TEST" not in result.text and "HOME" in result.text


def test_an_exception_shows_its_traceback_from_main_py():
    result = run("def f():\n    return 1 / 0\nf()")
    assert result.metrics["returncode"] == 1.0
    assert result.text.startswith('Traceback (most recent call last):\n  File "main.py", line 3')
    assert result.text.rstrip().endswith("ZeroDivisionError: division by zero")


def test_a_silent_failure_says_its_exit_code():
    assert run("import sys; sys.exit(3)").text == "error: the program exited with code 3"


def test_a_signal_is_reported():
    result = run("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    assert result.metrics["killed"] == 1.0 and result.text == "error: the program was killed by SIGKILL"


def test_long_output_keeps_head_and_tail():
    result = run("print('HEAD')\nfor i in range(20000):\n    print(i)\nprint('TAIL')", max_output_chars=200)
    assert result.metrics["truncated"] == 1.0 and result.metrics["error"] == 0.0
    assert result.text.startswith("HEAD\n") and result.text.rstrip().endswith("TAIL")
    assert "output cut" in result.text and len(result.text) < 300


def test_a_flood_of_output_hits_the_file_size_limit_not_the_parents_memory():
    result = run("while True:\n    print('x' * 10**6)", max_file_mib=1, max_output_chars=100, timeout_s=5.0)
    assert result.metrics["timeout"] == 0.0 and result.metrics["error"] == 1.0
    assert "size limit of 1 MiB" in result.text and len(result.text) < 300


def test_a_missing_code_argument_is_an_error_result():
    assert PythonSandbox().execute("r0", {}).metrics["error"] == 1.0


def test_calls_from_several_threads_run_side_by_side(tmp_path):
    # the agent loop calls tools from worker threads. Each call checks in, then waits until all
    # four have: calls made one after another would never all check in (the first times out),
    # so this proves they overlap without timing them (a timed bound failed on a busy box)
    from concurrent.futures import ThreadPoolExecutor

    tool = PythonSandbox(Config(timeout_s=30.0, isolation="none"))  # they meet in a host folder
    wait = ("import os, time\nopen(os.path.join({d!r}, '{i}'), 'w').close()\n"
            "while len(os.listdir({d!r})) < 4:\n    time.sleep(0.01)\nprint({i})")
    codes = [wait.format(d=str(tmp_path), i=i) for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda c: tool.execute("r", {"code": c}), codes))
    assert [r.text for r in results] == [f"{i}\n" for i in range(4)]
