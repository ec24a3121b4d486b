"""agent-generate under run.partial_rollouts: a multi-turn rollout records the policy version of
every token (the model's turns as sampled, a tool's observation as the turn it answers), and a
weight sync may land between or inside its turns."""

from __future__ import annotations

from pathlib import Path

import pytest
from rich.console import Console

from dapo_flow.graph.edits import edit_file, parse_cli_edits
from dapo_flow.graph.plan import Cluster
from dapo_flow.runtime import execute
from dapo_flow.tracking import read_run

AGENT_GRAPH = Path(__file__).resolve().parents[2] / "graphs" / "agent.yaml"


@pytest.mark.slow  # a 3-step local run of the agent graph (~15 s)
@pytest.mark.models("tiny-agent")
def test_an_async_agent_run_with_partial_rollouts_keeps_each_tokens_version(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    edits = [("set", "run.steps=3"), ("set", "run.rollout_mode=async"), ("set", "run.partial_rollouts=true"),
             ("set", "placement.mode=disaggregated"), ("set", "run.val_every=0"), ("set", "run.checkpoint_every=0")]
    placed = edit_file(str(AGENT_GRAPH), parse_cli_edits(edits)).compile(Cluster(cpus=2))
    summary = execute(placed, executor="local", console=Console(file=open(tmp_path / "log.txt", "w")))
    history = read_run(summary["tracking_uri"], summary["run_id"])["history"]
    batch = [v for _, v in history["rollout/staleness"]]
    tokens = [v for _, v in history["rollout/token_staleness_max"]]
    assert len(batch) == 3 and all(0 <= t <= b <= 1 for t, b in zip(tokens, batch)), (tokens, batch)
    oldest = [v for _, v in history["batch/rollout_version_min"]]
    # step i+1 trains weights of version i on tokens at most 1 version older (the staleness bound)
    assert oldest[0] == 0 and all(max(0, i - 1) <= v <= i for i, v in enumerate(oldest)), oldest
    partial = [v for _, v in history["batch/partial_samples"]]
    assert partial[0] == 0.0 and all(0 <= v <= 1 for v in partial), partial  # step 1: before any sync
