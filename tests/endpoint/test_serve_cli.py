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


@pytest.mark.parametrize("replicas", [1, 2])
def test_serve_prints_an_address_and_token_that_serve_the_model(replicas):
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
        assert ("2 replicas behind it" in line) == (replicas == 2)
        raw = openai.OpenAI(base_url=url, api_key=token, max_retries=0).chat.completions.with_raw_response.create(
            model="policy", messages=[{"role": "user", "content": "12*34="}], max_tokens=8)
        assert raw.parse().choices[0].message.role == "assistant"
        assert ("x-dapo-flow-replica" in raw.headers) == (replicas == 2)  # served through the router
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="guess", max_retries=0).models.list()
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130  # Ctrl-C: stopped, as the CLI reports an interrupt


def test_serve_bad_input_exits_2(capsys):
    assert cli.main(["serve", GRAPH, "--model", "critic"]) == 2
    assert "--model critic is not in the graph" in capsys.readouterr().err
    assert cli.main(["serve", GRAPH, "--checkpoint", str(ROOT)]) == 2
    assert "no config.json" in capsys.readouterr().err
