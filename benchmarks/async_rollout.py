"""Overlapped rollout: `run.rollout_mode` one_step_off and async against sync, same graph, one invocation.

Runs the graph (default graphs/dapo.yaml, the main job) on Ray with disaggregated placement,
one rollout actor and one training worker (`models.policy.train.workers=1`): synchronous, then
one_step_off, then async (`run.max_staleness` 1), then async with `run.partial_rollouts` (each
sync goes into the generation in flight), and reads each run's per-step timings back
from its MLflow history, over the steps after a warm-up of 2 (actor start-up and step 1, which
the overlapped modes run synchronously, excluded):

- ``generate_s``: the synchronous run's rollout phase per step (generation, scoring, dynamic
  sampling: `time/rollout_phase`), ``train_s`` its train phase (old logprobs, advantages, the
  update: `time/train_phase`); medians.
- ``sync_step_s``, ``one_step_off_step_s`` and ``async_step_s``: median `time/step` of each run
  (weight sync included, validation and checkpoints excluded: both are off here).
- ``overlap_ratio`` = one_step_off_step_s / max(generate_s, train_s): 1.0 is a perfect overlap
  (a step takes as long as its longer half); target <= 1.15. ``speedup`` = sync / one_step_off.
  The sync, one_step_off and async runs take turns ``--pairs`` times (default 3, ``--quick`` 1):
  a small box's speed drifts by tens of percent between runs minutes apart, so each one_step_off
  run is compared with the sync run just before it, and ``overlap_ratio`` is the median of those
  ratios (``overlap_ratios``: each turn's); ``async_vs_one_step_off`` likewise the median of each
  async step over the one_step_off step just before it (<= 1: async at least as fast). The other
  figures are medians over the runs.
- ``trainer_wait_s`` / ``rollout_idle_s``: median seconds per step the trainer waited for the
  next batch after its update, and the rollout actor sat idle waiting for the update
  (one_step_off); ``async_trainer_wait_s`` and ``async_staleness_mean`` for async.
- ``async_sync_wait_s`` / ``partial_sync_wait_s``: median `time/sync_wait` of async without and
  with partial rollouts, the seconds a sync waited for the driver to queue a generation batch;
  ``async_weight_sync_s`` / ``partial_weight_sync_s`` the transfer (without partial rollouts it
  queues behind the generate calls in flight on the rollout actor, so it includes their rest); ``partial_step_s`` the step, ``partial_samples`` the mean fraction of trained samples
  whose tokens span two policy versions, ``partial_token_staleness_mean`` how far tokens lag.

``--nodes 2`` runs both on a simulated 2-node Ray cluster (``ray.cluster_utils.Cluster``, one
CPU per node): the rollout and training actors on different nodes, the weights synced between
them over the network stack.

The runs learn differently (the overlapped modes train on batches one version stale), so their
rewards are printed, not compared: tests/runtime/test_one_step_off.py and test_async_rollout.py
check what each mode computes.

``--max-staleness K`` lets the async runs collect up to K steps ahead: with K >= 2 the producer
is often mid-generation when an update ends, which is where partial rollouts matter (without
them the sync, and so the trainer, waits for that generation batch).

Run: python benchmarks/async_rollout.py [--quick] [--steps N] [--pairs N] [--nodes 2] [--max-staleness K]
         [--set KEY=VALUE ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from pathlib import Path
from typing import Any, Iterator

from rich.table import Table

from _common import (DEFAULT_GRAPH, LoadSampler, fmt, make_console, run_graph, scratch_dir, step_history,
                     write_json)

WARMUP_STEPS = 2
TARGET_OVERLAP = 1.15
MODES = {"sync": ["run.rollout_mode=sync"], "one_step_off": ["run.rollout_mode=one_step_off"],
         "async": ["run.rollout_mode=async"],
         "async_partial": ["run.rollout_mode=async", "run.partial_rollouts=true"]}
SETS = ["placement.mode=disaggregated", "models.policy.train.workers=1", "run.val_every=0",
        "run.checkpoint_every=0"]


def _median(values) -> float | None:
    """Median of the values that are not None (None if none is)."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def medians(history: dict[str, dict[int, float]], warmup: int) -> dict[str, float]:
    """Median per step, after ``warmup`` steps, of the timings this benchmark reports."""
    keys = ("time/step", "time/rollout_phase", "time/train_phase", "time/weight_sync", "time/trainer_wait",
            "time/rollout_idle", "rollout/staleness", "time/sync_wait")
    out = {}
    for key in keys:
        values = [v for step, v in sorted(history.get(key, {}).items()) if step > warmup]
        out[key] = statistics.median(values) if values else None
    for key in ("batch/partial_samples", "rollout/token_staleness_mean"):  # mostly 0: means, not medians
        values = [v for step, v in sorted(history.get(key, {}).items()) if step > warmup]
        out[key] = statistics.fmean(values) if values else None
    staleness = list(history.get("rollout/staleness", {}).values())
    out["staleness_mean"] = statistics.fmean(staleness) if staleness else None
    rewards = list(history.get("batch/reward_mean", {}).values())
    out["reward_last"] = rewards[-1] if rewards else None
    return out


@contextlib.contextmanager
def simulated_cluster(nodes: int) -> Iterator[tuple[Any, str | None]]:
    """(None, None) for this machine; else a Ray cluster of ``nodes`` 1-CPU nodes on it and the
    ``Cluster`` to place the graph on."""
    if nodes <= 1:
        yield None, None
        return
    from ray.cluster_utils import Cluster as RayCluster

    from dapo_flow.graph.plan import Cluster

    ray_cluster = RayCluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for _ in range(nodes - 1):
        ray_cluster.add_node(num_cpus=1)
    ray_cluster.wait_for_nodes()
    try:
        yield Cluster(cpus=float(nodes), nodes=nodes), ray_cluster.address
    finally:
        import ray

        ray.shutdown()
        ray_cluster.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--graph", type=Path, default=DEFAULT_GRAPH)
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 20; --quick 8)")
    ap.add_argument("--quick", action="store_true", help="8 steps per run, one turn of each mode")
    ap.add_argument("--pairs", type=int, default=None,
                    help="sync / one_step_off / async turns (default 3; --quick 1)")
    ap.add_argument("--json", default=None, help="write the figures to this file")
    ap.add_argument("--keep", default=None, help="working directory to keep (MLflow store, logs)")
    ap.add_argument("--nodes", type=int, default=1, help="a simulated Ray cluster of this many 1-CPU nodes")
    ap.add_argument("--max-staleness", type=int, default=1, help="run.max_staleness of the async runs")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an edit of the graph for every run (e.g. run.gen_prompts_per_batch=144: generation-bound)")
    args = ap.parse_args()
    steps = args.steps or (8 if args.quick else 20)
    pairs = args.pairs or (1 if args.quick else 3)
    order = [mode for _ in range(pairs) for mode in ("sync", "one_step_off", "async")] + ["async_partial"]
    console = make_console()
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    with scratch_dir(args.keep, console), simulated_cluster(args.nodes) as (cluster, address), \
            LoadSampler() as load:
        for mode in order:
            console.rule(f"{mode}: {args.graph.name}, {steps} steps, {args.nodes} node(s)")
            bound = [f"run.max_staleness={args.max_staleness}"] if mode.startswith("async") else []
            summary, _ = run_graph(args.graph, [*SETS, *args.set, *MODES[mode], *bound], executor="ray",
                                   steps=steps, console=console, cluster=cluster, address=address)
            runs[mode].append(medians(step_history(summary), WARMUP_STEPS))
    ratios = [off["time/step"] / max(sync["time/rollout_phase"], sync["time/train_phase"])
              for sync, off in zip(runs["sync"], runs["one_step_off"])]
    async_ratios = [a["time/step"] / off["time/step"] for off, a in zip(runs["one_step_off"], runs["async"])]
    by_mode = {mode: {key: _median(r[key] for r in runs[mode]) for key in runs[mode][0]} for mode in MODES}
    sync, off, asy, partial = by_mode.values()
    generate_s, train_s = sync["time/rollout_phase"], sync["time/train_phase"]
    result = {
        "graph": str(args.graph), "nodes": args.nodes, "steps": steps, "pairs": pairs, "max_staleness": args.max_staleness, "sets": args.set, "warmup_steps": WARMUP_STEPS, "load_avg": load.mean,
        "generate_s": generate_s, "train_s": train_s,
        "sync_step_s": sync["time/step"], "one_step_off_step_s": off["time/step"], "async_step_s": asy["time/step"],
        "async_speedup": sync["time/step"] / asy["time/step"], "async_trainer_wait_s": asy["time/trainer_wait"],
        "async_staleness_mean": asy["staleness_mean"], "async_weight_sync_s": asy["time/weight_sync"],
        "partial_step_s": partial["time/step"], "partial_weight_sync_s": partial["time/weight_sync"],
        "async_sync_wait_s": asy["time/sync_wait"], "partial_sync_wait_s": partial["time/sync_wait"],
        "partial_samples": partial["batch/partial_samples"],
        "partial_token_staleness_mean": partial["rollout/token_staleness_mean"],
        "overlap_ratio": statistics.median(ratios), "overlap_ratios": ratios,
        "async_vs_one_step_off": statistics.median(async_ratios), "async_vs_one_step_off_turns": async_ratios,
        "speedup": sync["time/step"] / off["time/step"],
        "weight_sync_s": off["time/weight_sync"], "trainer_wait_s": off["time/trainer_wait"],
        "rollout_idle_s": off["time/rollout_idle"],
        "reward_last": {mode: runs[mode][-1]["reward_last"] for mode in MODES},
        "target_overlap_ratio": TARGET_OVERLAP,
    }
    table = Table(title=f"seconds per step (median of steps {WARMUP_STEPS + 1}-{steps}, and of {pairs} sync / "
                        f"one_step_off / async runs; load {fmt(load.mean, '.2f')})")
    for column in ("", "step", "rollout phase", "train phase", "weight sync", "sync waits", "trainer waits",
                   "rollout idle"):
        table.add_column(column, justify="right")
    for mode in MODES:
        r = by_mode[mode]
        table.add_row(mode, *(fmt(r[k]) for k in ("time/step", "time/rollout_phase", "time/train_phase",
                                                  "time/weight_sync", "time/sync_wait", "time/trainer_wait",
                                                  "time/rollout_idle")))
    console.print(table)
    verdict = "meets" if result["overlap_ratio"] <= TARGET_OVERLAP else "misses"
    console.print(f"one_step_off: {result['speedup']:.2f}x the synchronous step; overlap ratio "
                  f"{result['overlap_ratio']:.3f} ({verdict} the target {TARGET_OVERLAP}; pairs: "
                  f"{', '.join(f'{r:.2f}' for r in ratios)}); async: "
                  f"{result['async_speedup']:.2f}x ({result['async_vs_one_step_off']:.2f}x one_step_off's step; "
                  f"turns: {', '.join(f'{r:.2f}' for r in async_ratios)}), staleness {fmt(result['async_staleness_mean'], '.2f')} "
                  f"on average; a sync waits {fmt(result['async_sync_wait_s'])} s for the generation in flight, "
                  f"{fmt(result['partial_sync_wait_s'])} s with partial rollouts, where "
                  f"{fmt(result['partial_samples'], '.2f')} of the trained samples span two policy versions",
                  highlight=False)
    write_json(args.json, result, console)


if __name__ == "__main__":
    main()
