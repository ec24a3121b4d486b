"""What a hostile program run by the python tool tries, and that each attempt stays inside the
bubblewrap sandbox: the network by every route, the host's files, the parent's environment and
/proc, signals to the host's processes, children that detach, fork bombs, floods of output and
writes that would fill the disk. Each test checks the outcome on the host side, not only what
the program reports."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from dapo_flow.tools import isolation
from dapo_flow.tools.sandbox import Config, PythonSandbox
from test_tool_sandbox import PRINT_NS, namespace_gone

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def bubblewrap_works():
    """bubblewrap is required (the README's setup installs it): its absence fails, not skips."""
    assert isolation.problem() is None, isolation.problem()


def run(code: str, **config):
    return PythonSandbox(Config(**config)).execute("r0", {"code": code})


class Listener:
    """A TCP server on the host's loopback that counts the connections it accepts."""

    def __init__(self, family=socket.AF_INET, host="127.0.0.1"):
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.bind((host, 0))
        self.sock.listen()
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
                self.accepted += 1
                conn.close()
            except OSError:
                pass

    def close(self):
        self._stop.set()
        self._thread.join()
        self.sock.close()


def test_no_route_reaches_a_listener_on_the_hosts_loopback():
    """The socket module's stubs are undone first (``_socket`` is the C module under them)."""
    tcp = Listener()
    try:
        tcp6 = Listener(socket.AF_INET6, "::1")
    except OSError:  # a host without IPv6 loopback: that route does not exist to begin with
        tcp6 = None
    targets = [("AF_INET", "127.0.0.1", tcp.port)] + ([("AF_INET6", "::1", tcp6.port)] if tcp6 else [])
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.settimeout(0.5)
    try:
        code = f"""
import _socket
for family, host, port in {targets!r}:
    family = getattr(_socket, family)
    s = _socket.socket(family, _socket.SOCK_STREAM)
    s.settimeout(2)
    try:
        s.connect((host, port)); print('CONNECTED', host)
    except OSError as e:
        print('refused', host, e.errno)
u = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM)
try:
    u.sendto(b'leak', ('127.0.0.1', {udp.getsockname()[1]})); print('sent udp')
except OSError as e:
    print('udp', e.errno)
try:
    _socket.getaddrinfo('example.com', 80); print('RESOLVED')
except OSError as e:
    print('no dns')
import os
print(sorted(os.listdir('/sys/class/net')) if os.path.isdir('/sys/class/net') else 'no /sys')
"""
        result = run(code, timeout_s=10.0)
        assert "CONNECTED" not in result.text and "RESOLVED" not in result.text, result.text
        assert result.text.count("refused") == len(targets), result.text
        with pytest.raises(TimeoutError):  # a datagram "sent" inside went nowhere
            udp.recvfrom(16)
        assert tcp.accepted == 0 and (tcp6 is None or tcp6.accepted == 0)
    finally:
        for listener in (tcp, tcp6):
            if listener is not None:
                listener.close()
        udp.close()


def test_a_unix_socket_of_the_host_is_out_of_reach(tmp_path):
    path = tmp_path / "host.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen()
    try:
        code = f"import _socket\ns = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)\ns.connect({str(path)!r})\nprint('CONNECTED')"
        result = run(code)
        assert "CONNECTED" not in result.text and "FileNotFoundError" in result.text, result.text
    finally:
        server.close()


def test_the_hosts_files_are_out_of_sight(tmp_path):
    """The user's home, the project, a folder like a checkpoint or MLflow store: not there to
    read; a write to a host path fails and leaves nothing on the host."""
    secret = tmp_path / "secret.txt"
    secret.write_text("the key")
    in_home = Path.home() / f".dapo-flow-escape-test-{os.getpid()}"
    in_home.write_text("the home key")
    code = f"""
import os
for path in ({str(secret)!r}, {str(in_home)!r}, {str(ROOT / 'pyproject.toml')!r}, '/etc/passwd', '/etc/shadow'):
    try:
        print(path, open(path).read()[:20])
    except OSError as e:
        print(path, type(e).__name__)
try:
    print(sorted(os.listdir({str(Path.home())!r})))
except OSError as e:
    print([])
for path in ({str(tmp_path / 'planted.txt')!r}, '/usr/planted.txt', {str(isolation.interpreter().parent / 'planted')!r}):
    try:
        open(path, 'w').write('x'); print('WROTE', path)
    except OSError as e:
        print('no write', type(e).__name__)
print(sorted(os.listdir('/')))
"""
    try:
        result = run(code)
    finally:
        in_home.unlink()
    lines = result.text.splitlines()
    assert "key" not in result.text and "WROTE" not in result.text, result.text
    assert "[build-system]" not in result.text and "root:" not in result.text
    # of the home, at most the folders down to the Python installation (pyenv's, say) are there
    prefix = Path(os.path.realpath(sys.base_prefix))
    assert set(eval(lines[5])) <= {p.name for p in prefix.parents} | {prefix.name}, lines[5]  # noqa: S307
    assert result.text.count("no write") == 3
    assert not (tmp_path / "planted.txt").exists() and not Path("/usr/planted.txt").exists()
    top = eval(lines[-1])  # noqa: S307 - the listing the program printed
    assert set(top) <= {"usr", "lib", "lib64", "lib32", "bin", "sbin", "etc", "proc", "dev", "tmp",
                        *(p.name for p in prefix.parents)}, top


def test_neither_the_parents_environment_nor_its_proc_entries_are_visible(monkeypatch):
    monkeypatch.setenv("DAPO_FLOW_SECRET_FOR_TEST", "hunter2")
    code = f"""
import os
pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
seen = []
for pid in pids:
    try:
        seen.append((pid, open(f'/proc/{{pid}}/environ', 'rb').read()))
    except OSError:
        pass
print(pids)
print(any(b'hunter2' in env for _, env in seen), 'hunter2' in str(os.environ))
print(os.path.exists('/proc/{os.getpid()}'), os.path.exists('/proc/{os.getppid()}'))
"""
    pids, leaked, host = run(code).text.strip().splitlines()
    assert leaked == "False False" and host == "False False"
    assert 0 < max(eval(pids)) < 10  # noqa: S307 - the sandbox's own few processes, none of the host's


def test_signals_cannot_reach_the_host():
    """kill(-1) signals every process the sender may: here only the sandbox's own."""
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        code = f"""
import os, signal
for pid in ({victim.pid}, {os.getpid()}):
    try:
        os.kill(pid, signal.SIGKILL); print('KILLED', pid)
    except ProcessLookupError:
        print('no such process')
os.kill(-1, signal.SIGKILL)
"""
        result = run(code)
        assert "KILLED" not in result.text and result.text.count("no such process") == 2, result.text
        assert victim.poll() is None  # still running
    finally:
        victim.kill()
        victim.wait()


def test_a_detached_child_does_not_outlive_the_call():
    code = PRINT_NS + """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(600)
    os._exit(0)
print('parent done')
"""
    result = run(code)
    assert result.metrics["error"] == 0.0 and "parent done" in result.text
    assert namespace_gone(result.text.split()[0])


def test_a_fork_bomb_stops_at_the_process_limit_and_leaves_nothing_behind():
    code = PRINT_NS + """
import os, time
n = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(600)
            os._exit(0)
        n += 1
except OSError as e:
    print('stopped after', n, type(e).__name__)
"""
    result = run(code, max_processes=16, timeout_s=20.0)
    assert result.metrics["timeout"] == 0.0, result.text
    ns, stopped = result.text.splitlines()[:2]
    # RLIMIT_NPROC counts the processes of the program's user; as root the programs run as
    # nobody, whom other sandboxes running at once (another test process) also count against
    assert stopped.startswith("stopped after") and int(stopped.split()[2]) < 16, result.text
    assert namespace_gone(ns)
    assert subprocess.run(["true"]).returncode == 0  # the host still starts processes


def test_writes_that_would_fill_the_disk_stop_at_the_sandboxs_size():
    code = """
import os
written = 0
try:
    for i in range(10**6):
        with open(f'f{i}', 'wb') as f:
            f.write(b'x' * 2**20)
        written += 1
except OSError as e:
    print('stopped at', written, 'MiB', e.strerror)
"""
    result = run(code, max_file_mib=8, timeout_s=20.0)
    assert "No space left on device" in result.text or "File too large" in result.text, result.text
    assert int(result.text.split()[2]) <= 8


def test_a_flood_of_output_stops_at_its_limit():
    result = run("import sys\nwhile True:\n    sys.stdout.write('x' * 10**6)", max_file_mib=1, max_output_chars=100)
    assert result.metrics["error"] == 1.0 and "size limit of 1 MiB" in result.text and len(result.text) < 300


def test_without_bubblewrap_the_graph_is_refused_with_the_install_command(monkeypatch):
    from dapo_flow.tools.base import ToolError, ToolSpec
    from dapo_flow.tools.registry import load_tool

    monkeypatch.setattr(isolation.shutil, "which", lambda name: None)
    isolation.problem.cache_clear()
    try:
        with pytest.raises(ToolError, match=r"tool 'python': .*bubblewrap \(bwrap\) is not installed.*"
                                            r"apt-get install bubblewrap.*isolation: none"):
            load_tool(ToolSpec(name="python"))
        tool = load_tool(ToolSpec(name="python", config={"isolation": "none"}))  # said explicitly: runs
        assert tool.execute("r", {"code": "print(6 * 7)"}).text == "42\n"
    finally:
        isolation.problem.cache_clear()


def test_the_isolation_that_runs_is_in_the_nodes_params_as_mlflow_logs_them():
    """An agent node's tools carry their whole validated config (defaults filled), so `explain`
    and the run's MLflow params (flattened as the session logs them) say which isolation ran."""
    from dapo_flow.tools.base import ToolSpec
    from dapo_flow.tracking import flatten
    from dapo_flow.operators.agent_generate import Params

    params = Params(tools=[ToolSpec(name="calculator"), ToolSpec(name="python", timeout_s=3.0)])
    logged = flatten(params.model_dump(mode="json"), "nodes.rollout.params.")
    assert logged["nodes.rollout.params.tools.1.config.isolation"] == "bwrap"
    assert logged["nodes.rollout.params.tools.1.timeout_s"] == "3.0"
    assert "nodes.rollout.params.tools.1.config.timeout_s" not in logged  # set on the entry only
    plain = Params(tools=[ToolSpec(name="python", config={"isolation": "none"})])
    assert flatten(plain.model_dump(mode="json"))["tools.0.config.isolation"] == "none"
    assert Params.model_validate(params.model_dump(mode="json")) == params  # what explain shows validates again
