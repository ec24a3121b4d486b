"""A synchronous run on Ray whose generating actors are the trainer's queues the next step's first
generation call behind each update (Runner.prefetch): the actors go from the update to the
generation without waiting for the driver, and the run logs what it logs without."""

from __future__ import annotations

from pathlib import Path

import pytest

from dapo_flow.graph.edits import edit_file, parse_cli_edits
from dapo_flow.graph.plan import Cluster
from dapo_flow.runtime import execute
from dapo_flow.runtime.loop import Runner
from dapo_flow.tracking import read_run

pytestmark = [pytest.mark.slow, pytest.mark.shared_ray]

ROOT = Path(__file__).resolve().parents[2]
# 6 steps, validated and checkpointed at step 3 (no prefetch behind those steps) and at the end
SETS = ("run.steps=6", "run.prompts_per_step=8", "run.gen_prompts_per_batch=24", "data.val.size=16",
        "run.val_every=3", "run.checkpoint_every=3")


def _history(workdir: Path) -> dict:
    placed = edit_file(ROOT / "graphs/dapo.yaml", parse_cli_edits([("set", s) for s in SETS])).compile(Cluster(cpus=2))
    summary = execute(placed, executor="ray")
    history = read_run(summary["tracking_uri"], summary["run_id"])["history"]
    return {k: v for k, v in history.items() if not k.startswith(("time/", "perf/")) and "per_s" not in k
            and k != "gen/seconds"}


def test_the_next_generation_queued_behind_the_update_logs_what_waiting_does(workdir, monkeypatch):
    prefetched = []
    prefetch = Runner.prefetch
    monkeypatch.setattr(Runner, "prefetch", lambda self, state, version: prefetched.append(
        (state.step, version)) or prefetch(self, state, version))
    queued = _history(workdir)
    assert [s for s, _ in prefetched] == [0, 1, 3, 4]  # not behind step 3 (validation, checkpoint) nor the last
    assert all(version == step + 1 for step, version in prefetched)  # the weights the update leaves

    monkeypatch.setattr(Runner, "can_prefetch", lambda self: False)
    waited = _history(workdir)
    assert queued == waited and len(queued) > 20
