"""run.rollout_mode: one_step_off on Ray: the rollout actor generates while the training actor
updates, and computes what the local executor does; a rollout actor that dies is named and the
run heals by itself with every step trained once."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest
from figures import RESULTS, assert_learned
from rich.console import Console

from dapo_flow.graph.compiler import compile_graph
from dapo_flow.graph.edits import edit_file, parse_cli_edits
from dapo_flow.graph.plan import Cluster
from dapo_flow.runtime import execute
from dapo_flow.tracking import read_run
from update_order import queued_early, update_and_sync_order

pytestmark = pytest.mark.slow  # Ray runs (~20 s each)

ONE_STEP_OFF = [("set", "run.rollout_mode=one_step_off"), ("set", "placement.mode=disaggregated")]
WALL_CLOCK = ("time/", "perf/", "gen/seconds", "gen/tokens_per_s")


def _placed(path):
    return edit_file(str(path), parse_cli_edits(ONE_STEP_OFF)).compile(Cluster(cpus=2))


def _history(summary) -> dict:
    history = read_run(summary["tracking_uri"], summary["run_id"])["history"]
    return {k: v for k, v in history.items() if not k.startswith(WALL_CLOCK)}


@pytest.mark.shared_ray
@pytest.mark.timeout(400)
def test_on_ray_it_computes_what_the_local_executor_does(workdir, small_graph, monkeypatch):
    """On Ray the next update is queued behind the weight sync, which is queued behind the update
    in flight (steps 3 and 4 here: not after step 1's first MLflow write, nor after the last
    step), and every number is the local executor's, which waits for each call."""
    from dapo_flow.runtime import session

    monkeypatch.setattr(session, "FLUSH_EVERY_S", 1e9)  # written at step 1 and the end only
    events = update_and_sync_order(monkeypatch)
    log = Console(file=open(workdir / "log.txt", "w"))
    placed = edit_file(str(small_graph(workdir, steps=4, ckpt=0)),
                       parse_cli_edits(ONE_STEP_OFF + [("set", "run.val_every=0")])).compile(Cluster(cpus=2))
    on_ray = execute(placed, executor="ray", console=log)
    assert queued_early(events) == [2, 3]
    local = execute(placed, executor="local", console=log)
    assert _history(on_ray) == _history(local)
    generate = [c for c in on_ray["call_log"] if c[1] == "rollout:policy" and c[0] == "rollout"]
    syncs = [c for c in on_ray["call_log"] if c[0] == "sync"]
    assert len(syncs) == 4 and len(generate) >= 4


@pytest.mark.shared_ray
@pytest.mark.timeout(400)
def test_a_dead_rollout_actor_is_named_and_the_run_heals(workdir, small_graph, executors_started):
    """The rollout actor is killed once the checkpoint of step 2 is written (it is then
    generating step 3's or 4's batch): the run names its stage, starts the actors again and
    resumes by itself (run.max_failures), training every step exactly once."""
    import ray

    started = executors_started

    def kill_after_step_2() -> None:
        deadline = time.monotonic() + 300
        while not list(workdir.glob("dapo-flow-runs/checkpoints/*/*/step_000002/manifest.json")):
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        ray.kill(started[0].actors["rollout:policy"], no_restart=True)

    placed = _placed(small_graph(workdir, steps=6, ckpt=2))
    killer = threading.Thread(target=kill_after_step_2, daemon=True)
    killer.start()
    with open(workdir / "log.txt", "w") as log:
        healed = execute(placed, executor="ray", console=Console(file=log, width=200))
    killer.join()
    assert "the actor of stage 'rollout:policy' died" in (workdir / "log.txt").read_text()
    history = read_run(healed["tracking_uri"], healed["run_id"])["history"]
    for key in ("batch/reward_mean", "actor/pg_loss", "rollout/staleness"):
        assert [s for s, _ in history[key]] == [1, 2, 3, 4, 5, 6], key
    assert [count for _, count in history["faults/count"]] == [1.0]
    assert read_run(healed["tracking_uri"], healed["run_id"])["status"] == "FINISHED"


@pytest.mark.shared_ray
@pytest.mark.figures
@pytest.mark.timeout(600)  # ~1 min on 2 cores
def test_dapo_async_learns_as_docs_results_says(tmp_path, monkeypatch, tiny_adder_path):
    """graphs/dapo-async.yaml as it is, on Ray: docs/results.md's val acc start -> end to the
    digit on the CPU type it names, and a gain of at least half of it elsewhere."""
    graph = Path(__file__).resolve().parents[2] / "graphs" / "dapo-async.yaml"
    printed = {m: (a, b) for m, a, b in re.findall(
        r"`dapo-flow run graphs/dapo-async\.yaml` on a 2-core (.+?) VM: val acc (\d+\.\d+) -> (\d+\.\d+)",
        RESULTS.read_text(encoding="utf-8").replace("\n", " "))}
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    summary = execute(compile_graph(graph, Cluster(cpus=2)), executor="ray",
                      console=Console(file=open(tmp_path / "log.txt", "w")))
    assert_learned(summary, printed, "graphs/dapo-async.yaml val acc start -> end")
    history = _history(summary)
    assert {v for _, v in history["rollout/staleness"]} == {0.0, 1.0}
