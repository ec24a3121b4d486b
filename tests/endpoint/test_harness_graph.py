"""graphs/harness.yaml end to end, shortened: on the local executor, and on Ray (where the
endpoint and the harness calls live in the policy's actor)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dapo_flow import cli

pytestmark = [pytest.mark.models("tiny-agent"), pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
GRAPH = ROOT / "graphs" / "harness.yaml"
SHORT = ["--steps", "2", "--set", "run.prompts_per_step=4", "--set", "run.gen_prompts_per_batch=4",
         "--set", "rollout.n=4", "--set", "data.val.size=4", "--set", "run.val_n=2",
         "--set", "run.checkpoint_every=0", "--set", "dynamic_sampling.max_gen_batches=2",
         # the graph names its harness relative to the repository root, where it is run from
         "--set", f"rollout.harness={ROOT / 'graphs/harnesses/calculator_agent.py'}:run"]


def _run(tmp_path, monkeypatch, executor: str, experiment: str) -> dict:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    from dapo_flow.tracking import default_tracking_uri, latest_run

    assert cli.main(["run", str(GRAPH), "--executor", executor, *SHORT,
                     "--set", f"tracking.experiment={experiment}"]) == 0
    return latest_run(default_tracking_uri(), experiment)


def test_the_harness_graph_runs_locally(tmp_path, monkeypatch, capsys):
    run = _run(tmp_path, monkeypatch, "local", "harness-local")
    metrics = run["metrics"]
    assert "OpenAI-compatible endpoint http://127.0.0.1:" in capsys.readouterr().out
    assert metrics["harness/masked_frac"] == 0.0 and metrics["harness/engine_calls"] >= 1


@pytest.mark.shared_ray
def test_the_harness_graph_runs_on_ray(tmp_path, monkeypatch):
    run = _run(tmp_path, monkeypatch, "ray", "harness-ray")
    assert run["metrics"]["harness/masked_frac"] == 0.0
