"""run.rollout_mode: async on the local executor: the staleness bound holds, every step trains
once, and a failed run resumes from what its checkpoint collected."""

from __future__ import annotations

import time

import pytest
from rich.console import Console

from dapo_flow.errors import GraphError
from dapo_flow.graph.edits import edit_file, parse_cli_edits
from dapo_flow.graph.plan import Cluster
from dapo_flow.runtime import execute
from dapo_flow.tracking import read_run
from update_order import FakeQueueingLocalExecutor, queued_early, update_and_sync_order

CLUSTER = Cluster(cpus=2)


def _async(bound: int) -> list:
    return [("set", "run.rollout_mode=async"), ("set", f"run.max_staleness={bound}"),
            ("set", "placement.mode=disaggregated")]


def _placed(path, edits):
    return edit_file(str(path), parse_cli_edits(edits)).compile(CLUSTER)


def _history(workdir, placed, executor="local", **kw) -> dict:
    summary = execute(placed, executor=executor, console=Console(file=open(workdir / "log.txt", "a")), **kw)
    run = read_run(summary["tracking_uri"], summary["run_id"])
    assert run["status"] == "FINISHED"
    return run["history"]


def test_max_staleness_is_for_async_only(workdir, small_graph):
    with pytest.raises(GraphError, match=r"max_staleness bounds rollout_mode async only \(this run is "
                                         r"one_step_off: staleness 1\)"):
        _placed(small_graph(workdir), [("set", "run.rollout_mode=one_step_off"), ("set", "run.max_staleness=2")])
    with pytest.raises(GraphError, match=r"async runs the rollout phase while the model trains"):
        _placed(small_graph(workdir), [("set", "run.rollout_mode=async")])


@pytest.mark.parametrize("bound, executor", [(1, "local"), (2, "local"), (1, "queueing")])
def test_every_step_trains_once_within_the_staleness_bound(workdir, small_graph, monkeypatch, bound, executor):
    """``queueing``: the path calls take on Ray, where each sync is queued behind its update at
    once and a batch collected already has its update queued behind that sync."""
    from dapo_flow.graph.explain import explain
    from dapo_flow.runtime import executors

    monkeypatch.setitem(executors.EXECUTORS, "queueing", FakeQueueingLocalExecutor)
    placed = _placed(small_graph(workdir, steps=5, ckpt=0), _async(bound))
    assert f"async: runs on in a thread of its own, up to {bound} step(s) ahead of training" in explain(placed)
    history = _history(workdir, placed, executor=executor)
    for key in ("batch/reward_mean", "actor/pg_loss", "rollout/staleness", "rollout/buffer_depth",
                "time/trainer_wait", "time/rollout_phase"):
        assert [s for s, _ in history[key]] == [1, 2, 3, 4, 5], key
    staleness = [v for _, v in history["rollout/staleness"]]
    assert staleness[0] == 0.0 and all(0 <= v <= bound for v in staleness), staleness
    # a sync waits for the generation batch in flight: every token was sampled by the weights its
    # batch was queued under (each rollout_version as the sync named it), so the oldest token
    # lags by the batch's staleness
    assert [v for _, v in history["rollout/token_staleness_max"]] == staleness
    assert [v for _, v in history["batch/partial_samples"]] == [0.0] * 5
    assert all(0 <= v <= bound for _, v in history["rollout/buffer_depth"])
    assert history["sampling/samples_generated_total"][-1][1] >= 5 * 4 * 4  # prompts x samples


@pytest.mark.slow  # two runs (~12 s)
def test_a_failed_run_resumes_from_what_its_checkpoint_collected(workdir, small_graph, fails_in_update):
    """The run fails in step 3's update; its checkpoint after step 2 holds the batches the
    producer had collected (paused between batches to take them): the resume trains them
    first, then collects on, and every step is logged once."""
    import json

    placed = _placed(small_graph(workdir, steps=5, ckpt=2), _async(2))
    with fails_in_update(3):
        _history(workdir, placed)
    [checkpoint] = list((workdir / "dapo-flow-runs" / "checkpoints").glob("*/*/step_000002"))
    held = json.loads((checkpoint / "driver.json").read_text())["ahead"]
    # generation batches, not steps: dynamic sampling may draw several for one step, so how many
    # the producer held is not bounded by max_staleness; each was queued under weights the
    # checkpoint had (version <= 2), and the resumed run's staleness is checked below
    assert all((checkpoint / f"ahead_{i}.arrow").is_file() for i in range(len(held)))
    assert all(0 <= h["policy_version"] <= 2 for h in held), [h["policy_version"] for h in held]
    history = _history(workdir, placed, resume=True)
    for key in ("batch/reward_mean", "actor/pg_loss", "rollout/staleness"):
        assert [s for s, _ in history[key]] == [1, 2, 3, 4, 5], key
    assert all(v <= 2 for _, v in history["rollout/staleness"])
    # the resumed actors know their weights' version (the checkpoint's): tokens lag as batches do
    assert history["rollout/token_staleness_max"] == history["rollout/staleness"]


def test_partial_rollouts_are_for_async_and_an_engine_that_takes_weights_mid_generation(workdir, small_graph,
                                                                                        monkeypatch):
    from dataclasses import replace

    from dapo_flow.models.engines import BACKENDS

    with pytest.raises(GraphError, match=r"partial_rollouts lets weight syncs into a generation in flight, "
                                         r"which only rollout_mode async has \(this run is one_step_off"):
        _placed(small_graph(workdir), [("set", "run.rollout_mode=one_step_off"), ("set", "run.partial_rollouts=true"),
                                       ("set", "placement.mode=disaggregated")])
    # a backend whose engine cannot take weights mid-generation (hf and vllm both can)
    monkeypatch.setitem(BACKENDS, "oneshot", replace(BACKENDS["hf"], partial_rollouts=False))
    with pytest.raises(GraphError, match=r"backend 'oneshot' of model 'policy' cannot do(.|\n)*set models.policy.backend to one that can \(hf, vllm\)"):
        _placed(small_graph(workdir, backend="oneshot"), _async(1) + [("set", "run.partial_rollouts=true")])


def test_with_partial_rollouts_a_sync_goes_into_the_generation_in_flight(workdir, small_graph, monkeypatch):
    """Generation slowed (a test-only sleep per decode step) to ~10x a training step: each sync
    lands in the middle of the next batch's generation, which goes on with the new weights. The
    tokens say so (rollout_version), within the staleness bound, never older than their batch."""
    from dapo_flow.graph.explain import explain
    from dapo_flow.models.hf import HFPolicy

    sample = HFPolicy._sample

    def slow_sample(logits, cfg, u):
        time.sleep(0.03)
        return sample(logits, cfg, u)

    monkeypatch.setattr(HFPolicy, "_sample", staticmethod(slow_sample))
    placed = _placed(small_graph(workdir, steps=4, ckpt=0), _async(1) + [("set", "run.partial_rollouts=true")])
    assert "partial rollouts: a weight sync goes into the generation in flight" in explain(placed)
    history = _history(workdir, placed)
    batch = [v for _, v in history["rollout/staleness"]]
    tokens = [v for _, v in history["rollout/token_staleness_max"]]
    assert all(0 <= t <= b <= 1 for t, b in zip(tokens, batch)), (tokens, batch)
    partial = [v for _, v in history["batch/partial_samples"]]
    assert partial[0] == 0.0 and max(partial[1:]) > 0, partial  # step 1's batch ran before any sync
    means = [v for _, v in history["rollout/token_staleness_mean"]]
    assert all(0 <= m <= t for m, t in zip(means, tokens)), (means, tokens)
    # the staleness histogram: fractions of each step's tokens, 0 to the most versions behind
    hist = {int(k.rsplit("_", 1)[1]): dict(v) for k, v in history.items()
            if k.startswith("rollout/token_staleness_frac_")}
    for step, (most, mean) in enumerate(zip(tokens, means), start=1):
        fracs = [hist[lag].get(step) for lag in range(int(most) + 1)]
        assert None not in fracs and sum(fracs) == pytest.approx(1.0) and fracs[-1] > 0, (step, fracs)
        assert sum(lag * f for lag, f in enumerate(fracs)) == pytest.approx(mean), (step, fracs, mean)
        assert all(step not in hist[lag] for lag in hist if lag > most)


def test_the_next_update_is_queued_early_only_behind_a_trainer_of_one_worker(workdir, small_graph, monkeypatch):
    """Async: a sync may wait for generations queued before it; a training group's other workers
    would wait for their sender in the next update's collectives (which time out), so the next
    update is not queued behind the sync there (the local executor runs a DDP group as its one
    worker, with the plan's group of 2: here, calls that say they queue)."""
    from dapo_flow.runtime import executors, session
    from dapo_flow.runtime.loop import Runner

    path = small_graph(workdir, steps=4, ckpt=0)
    alone = edit_file(str(path), parse_cli_edits(_async(1))).compile(Cluster(cpus=4))
    group = edit_file(str(path), parse_cli_edits([*_async(1), ("set", "models.policy.train.workers=2"),
                                                  ("set", "models.policy.train.strategy=ddp"),
                                                  ("set", "run.val_every=0")])).compile(Cluster(cpus=4))
    assert [group.stage(s.source).workers for s in group.syncs] == [2]
    assert Runner(alone, None, None).senders_train_alone
    assert not Runner(group, None, None).senders_train_alone
    monkeypatch.setattr(session, "FLUSH_EVERY_S", 1e9)
    monkeypatch.setitem(executors.EXECUTORS, "queueing", FakeQueueingLocalExecutor)
    events = update_and_sync_order(monkeypatch)
    history = _history(workdir, group, executor="queueing")
    assert [s for s, _ in history["actor/pg_loss"]] == [1, 2, 3, 4]
    assert [kind for kind, _ in events].count("update") == 4 and queued_early(events) == []
