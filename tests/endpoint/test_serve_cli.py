"""`dapo-flow serve`: a real process serving graphs/harness.yaml's model (once, and as two replicas
behind one address); a client with the printed address and token is served, one without the
token is refused; bad input exits 2."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from dapo_flow import cli

pytestmark = pytest.mark.models("tiny-agent")
ROOT = Path(__file__).resolve().parents[2]
GRAPH = str(ROOT / "graphs" / "harness.yaml")


def _served_as_printed(url: str, token: str, replicas: int) -> None:
    """A client with the printed address and token is served (through the router where there
    are replicas), one without the token is refused."""
    raw = openai.OpenAI(base_url=url, api_key=token, max_retries=0).chat.completions.with_raw_response.create(
        model="policy", messages=[{"role": "user", "content": "12*34="}], max_tokens=8)
    assert raw.parse().choices[0].message.role == "assistant"
    assert ("x-dapo-flow-replica" in raw.headers) == (replicas > 1)  # served through the router
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url, api_key="guess", max_retries=0).models.list()


def test_serve_in_process_prints_an_address_and_token_that_serve_the_model(monkeypatch, capsys):
    """One replica, `dapo-flow serve` run in this process (a process of its own costs its imports:
    the subprocess test below starts one for two replicas): the printed address and token serve
    the model, and a Ctrl-C in its wait stops it as the CLI reports an interrupt."""
    import threading
    import time

    sleep, seen, out = time.sleep, [], []

    def wait_then_ctrl_c(seconds):  # the CLI's wait once it printed; any other sleep (a server's) goes on
        out.append(capsys.readouterr().out)
        line = "".join(out)
        if threading.current_thread() is not threading.main_thread() or "endpoint on" not in line:
            return sleep(seconds)
        seen.append(line)
        found = re.search(r"endpoint on (http://127\.0\.0\.1:\d+/v1)  model 'policy'  token (\S+)", line)
        assert found, line
        assert "replicas behind it" not in line
        _served_as_printed(*found.groups(), replicas=1)
        raise KeyboardInterrupt

    monkeypatch.setattr(time, "sleep", wait_then_ctrl_c)
    assert cli.main(["serve", GRAPH]) == 130
    monkeypatch.setattr(time, "sleep", sleep)
    assert len(seen) == 1


def test_serve_prints_an_address_and_token_that_serve_the_model():
    replicas = 2  # one replica: the in-process test above
    # SIGINT's default handler back: a test runner in the background starts children with it ignored
    start = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
             "from dapo_flow.cli import main; sys.exit(main())")
    proc = subprocess.Popen([sys.executable, "-c", start, "serve", GRAPH, "--replicas", str(replicas)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if found := re.search(r"endpoint on (http://127\.0\.0\.1:\d+/v1)  model 'policy'  token (\S+)", line):
                break
        assert found, "".join(lines)
        url, token = found.groups()
        assert "2 replicas behind it" in line
        _served_as_printed(url, token, replicas)
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130  # Ctrl-C: stopped, as the CLI reports an interrupt


def test_serve_bad_input_exits_2(capsys):
    assert cli.main(["serve", GRAPH, "--model", "critic"]) == 2
    assert "--model critic is not in the graph" in capsys.readouterr().err
    assert cli.main(["serve", GRAPH, "--checkpoint", str(ROOT)]) == 2
    assert "no config.json" in capsys.readouterr().err
