"""run.rollout_mode: one_step_off (the next step's rollout beside this step's update) on the local
executor: what it needs of a graph, what it generates with, exact resume."""

from __future__ import annotations

import pytest
from rich.console import Console

from dapo_flow.errors import GraphError
from dapo_flow.graph.edits import edit_file, parse_cli_edits
from dapo_flow.graph.plan import Cluster
from dapo_flow.runtime import execute
from update_order import FakeQueueingLocalExecutor, queued_early, update_and_sync_order
from dapo_flow.tracking import read_run

CLUSTER = Cluster(cpus=2)
ONE_STEP_OFF = [("set", "run.rollout_mode=one_step_off"), ("set", "placement.mode=disaggregated")]
# the trainer recomputes old logprobs; rollout-correction logs how far they are from the sampler's
MISMATCH = [("insert", "corr:rollout-correction:after=old_logp")]
WALL_CLOCK = ("time/", "perf/", "gen/seconds", "gen/tokens_per_s")


def _placed(path, edits):
    return edit_file(str(path), parse_cli_edits(edits)).compile(CLUSTER)


def _history(workdir, placed, executor="local", **kw) -> dict:
    summary = execute(placed, executor=executor, console=Console(file=open(workdir / "log.txt", "a")), **kw)
    history = read_run(summary["tracking_uri"], summary["run_id"])["history"]
    return {k: v for k, v in history.items() if not k.startswith(WALL_CLOCK)}


@pytest.mark.parametrize("edits, says", [
    ([], r"(?s)small.yaml:8: run.rollout_mode: one_step_off runs the rollout phase while the model "
         r"trains, but node 'rollout' of the rollout phase runs in stage model:policy, which trains "
         r"\(placement colocated\).*fix: set placement: \{mode: disaggregated\}"),
    ([("set", "placement.mode=disaggregated"), ("drop", "filter")],
     r"(?s)small.yaml:8: run.rollout_mode: .*this graph has no group-filter.*fix: add a group-filter node"),
])
def test_what_one_step_off_needs_of_a_graph_is_a_validate_error(workdir, small_graph, edits, says):
    path = small_graph(workdir)
    path.write_text(path.read_text().replace("chunk_prompts: 4,", "chunk_prompts: 4, rollout_mode: one_step_off,"))
    with pytest.raises(GraphError, match=says) as info:
        _placed(path, edits)
    assert len(info.value.problems) == 1


def test_each_batch_after_the_first_is_generated_before_the_update_before_it(workdir, small_graph):
    """Step 1 trains what the initial weights generated, as a synchronous run does (same
    numbers); from step 2 the batch was sampled one version back: the trainer's recomputed old
    logprobs differ from the sampler's (in a synchronous run of this float32 model they agree to
    rounding, the first step here too). Every call of the plan runs, the rollout phase of the
    next step before the weight sync of this one."""
    from dapo_flow.graph.explain import explain

    path = small_graph(workdir, steps=3, ckpt=0)
    assert "one_step_off: runs for the next step while this step trains" in explain(_placed(path, ONE_STEP_OFF))
    off = _history(workdir, _placed(path, ONE_STEP_OFF + MISMATCH))
    sync = _history(workdir, _placed(path, [("set", "placement.mode=disaggregated")] + MISMATCH))
    assert off["rollout/staleness"] == [(1, 0.0), (2, 1.0), (3, 1.0)]
    assert sync["rollout/staleness"] == [(1, 0.0), (2, 0.0), (3, 0.0)]
    assert [abs(v) < 1e-5 for _, v in off["rollout_corr/kl_k1"]] == [True, False, False]
    assert all(abs(v) < 1e-5 for _, v in sync["rollout_corr/kl_k1"])
    for key in ("batch/reward_mean", "actor/pg_loss", "actor/grad_norm", "sampling/gen_batches"):
        assert off[key][0] == sync[key][0], key  # the same first batch and update
        assert off[key] != sync[key], key  # then other weights sampled
    assert [s for s, _ in off["val/acc"]] == [0, 2, 3]


def test_with_the_weights_unchanged_it_is_the_synchronous_run(workdir, small_graph):
    """lr 1e-30: each update rounds away in float32 (the weights stay bit for bit), so whichever
    version a batch was sampled with, it is the same: every logged number equals the synchronous run's (the seeds, prompts and order of
    generation calls are the same; only the overlap differs)."""
    path = small_graph(workdir, steps=3, ckpt=0)
    frozen = [("set", "train.lr=1e-30"), ("set", "placement.mode=disaggregated")]
    off = _history(workdir, _placed(path, frozen + ONE_STEP_OFF[:1]))
    sync = _history(workdir, _placed(path, frozen))
    # the versions that sampled each batch differ (one back after step 1): each token's, the batch's
    assert off.pop("rollout/token_staleness_max") == off.pop("rollout/staleness") == [(1, 0.0), (2, 1.0), (3, 1.0)]
    assert sync.pop("rollout/token_staleness_max") == sync.pop("rollout/staleness") == [(1, 0.0), (2, 0.0), (3, 0.0)]
    assert off.pop("batch/rollout_version_min") == [(1, 0.0), (2, 0.0), (3, 1.0)]
    assert sync.pop("batch/rollout_version_min") == [(1, 0.0), (2, 1.0), (3, 2.0)]
    for key in ("batch/rollout_version_mean", "rollout/token_staleness_mean"):  # equal to the min's
        off.pop(key), sync.pop(key)
    # the staleness histogram: every token of a batch as far behind as the batch
    assert off.pop("rollout/token_staleness_frac_0") == [(1, 1.0), (2, 0.0), (3, 0.0)]
    assert off.pop("rollout/token_staleness_frac_1") == [(2, 1.0), (3, 1.0)]
    assert sync.pop("rollout/token_staleness_frac_0") == [(1, 1.0), (2, 1.0), (3, 1.0)]
    # generated so far: one_step_off has generated the next step's batch at each step but the last
    total = "sampling/samples_generated_total"
    assert off.pop(total) == [(1, 96.0), (2, 160.0), (3, 160.0)] and sync.pop(total) == [(1, 64.0), (2, 96.0), (3, 160.0)]
    assert off == sync


def test_the_next_update_queued_behind_the_sync_computes_what_waiting_for_each_does(
        workdir, small_graph, monkeypatch):
    """Where calls queue (Ray), the rollout thread queues the step's weight sync and the next
    step's update as soon as the next batch is complete, so the trainer never waits for the
    driver between two updates; not before a step that validates, checkpoints or writes to
    MLflow (here: step 1's first write, and the last step). Every logged number is what the
    driver waiting for each call logs."""
    from dapo_flow.runtime import executors, session

    monkeypatch.setattr(session, "FLUSH_EVERY_S", 1e9)  # written at step 1 and the end only
    monkeypatch.setitem(executors.EXECUTORS, "queueing", FakeQueueingLocalExecutor)
    events = update_and_sync_order(monkeypatch)
    placed = _placed(small_graph(workdir, steps=5, ckpt=0), ONE_STEP_OFF + [("set", "run.val_every=0")])
    queued = _history(workdir, placed, executor="queueing")
    assert queued_early(events) == [2, 3, 4]  # the updates of steps 3, 4 and 5
    events.clear()
    waited = _history(workdir, placed)
    assert queued_early(events) == []
    assert queued == waited
    assert queued["rollout/staleness"] == [(1, 0.0), (2, 1.0), (3, 1.0), (4, 1.0), (5, 1.0)]


@pytest.mark.slow  # three runs (~10 s)
def test_a_resumed_run_trains_the_batch_it_had_collected(workdir, small_graph, fails_in_update):
    """The checkpoint after step 2 holds step 3's batch, collected already (ahead_0.arrow): a run
    that fails in step 3's update and resumes logs what 4 steps straight do, and generates no
    batch twice."""
    path = small_graph(workdir, steps=4, ckpt=2)
    straight = _history(workdir, _placed(path, ONE_STEP_OFF))
    placed = _placed(path, ONE_STEP_OFF)
    with fails_in_update(3):
        _history(workdir, placed)
    [checkpoint] = [c for c in (workdir / "dapo-flow-runs" / "checkpoints").glob("*/*/step_000002")
                    if not (c.parent / "step_000004").exists()]  # the failed run's
    assert (checkpoint / "ahead_0.arrow").is_file()
    resumed = _history(workdir, placed, resume=True)
    assert resumed == straight
    assert [s for s, _ in straight["rollout/staleness"]] == [1, 2, 3, 4]
