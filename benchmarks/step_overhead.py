"""Step overhead of the Ray executor against the in-process (local) one, same graph, same run.

Runs the graph (default graphs/dapo.yaml) twice in one invocation, with `--executor local`
and `--executor ray`, and reads each run's per-step timings back from its MLflow history:

- steps/s over the steps after a warm-up of 2 (actor start-up excluded; reported apart as
  start-up seconds: ray.init + actor creation + model load), and the Ray/local ratio of
  step time (target: Ray adds at most 15% at the default graph);
- per executor, the share of step time spent outside operator compute,
  1 - sum(time/<node>) / time/step, averaged over the same steps: scheduling, argument
  serialization and round trips to the actor, driver-side table glue, weight sync;
- per node, the seconds of operator compute per step on each executor (a node that is
  slower inside the actor than in-process points at threads, not at transport).

`time/<node>` is the seconds of that node over all of a step's calls (a `Seconds` metric is
summed over calls: a step that draws several generation batches counts each). Validation and
checkpoint writes are outside `time/step` on both executors.

Run: python benchmarks/step_overhead.py [--steps 30] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from _common import (DEFAULT_GRAPH, LoadSampler, fmt, make_console, pin_torch_threads, run_graph, scratch_dir,
                     step_history, write_json)

WARMUP_STEPS = 2
TARGET_RAY_OVERHEAD = 0.15  # Ray step time at most 15% above local
EXECUTORS = ("local", "ray")


def analyse(summary: dict, placed, warmup: int) -> dict:
    """Per-step timings of one run -> steps/s, overhead share, per-node seconds per step."""
    hist = step_history(summary)
    plan = placed.plan
    step_times = hist["time/step"]
    steps = sorted(s for s in step_times if s > warmup)
    if not steps:
        raise SystemExit(f"need more than {warmup} steps to measure (got {len(step_times)})")
    node_secs: dict[str, list[float]] = {n.id: [] for n in plan.nodes}
    outside: list[float] = []
    for s in steps:
        total_ops = 0.0
        for n in plan.nodes:
            t = hist.get(f"time/{n.id}", {}).get(s)
            if t is None:
                continue
            node_secs[n.id].append(t)
            total_ops += t
        outside.append(1.0 - total_ops / step_times[s])
    times = [step_times[s] for s in steps]
    sync = hist.get("time/weight_sync", {})
    return {
        "steps_measured": len(steps),
        "startup_s": next(iter(hist.get("time/startup", {}).values()), None),
        "steps_per_s": len(times) / sum(times),
        "mean_step_s": statistics.fmean(times),
        "median_step_s": statistics.median(times),
        "op_compute_s": statistics.fmean([t * (1 - o) for t, o in zip(times, outside)]),
        "outside_ops_share": statistics.fmean(outside),
        "weight_sync_s": statistics.fmean([sync.get(s, 0.0) for s in steps]),
        "node_s": {nid: statistics.fmean(v) for nid, v in node_secs.items() if v},
        "samples_per_s": statistics.fmean([hist["perf/samples_per_s"][s] for s in steps])
        if "perf/samples_per_s" in hist else None,
        "stage_of": dict(placed.node_stage),
        "step_seconds": {s: step_times[s] for s in sorted(step_times)},
        "wall_seconds": summary["wall_seconds"],
        "run_id": summary["run_id"],
    }


def print_tables(console: Console, res: dict[str, dict], graph: str, steps: int) -> dict:
    loc, ray = res["local"], res["ray"]
    ratio_mean = ray["mean_step_s"] / loc["mean_step_s"]
    ratio_median = ray["median_step_s"] / loc["median_step_s"]
    t = Table(title=f"step overhead: {Path(graph).name}, {steps} steps "
                    f"(steps {WARMUP_STEPS + 1}..{steps} measured)")
    for col in ("executor", "start-up s", "steps/s", "step s", "median s", "ops s", "outside ops",
                "sync s", "load"):
        t.add_column(col, justify="right" if col != "executor" else "left")
    for name in EXECUTORS:
        r = res[name]
        t.add_row(name, fmt(r["startup_s"], ".1f"), fmt(r["steps_per_s"]), fmt(r["mean_step_s"]),
                  fmt(r["median_step_s"]), fmt(r["op_compute_s"]), f"{r['outside_ops_share']:.1%}",
                  fmt(r["weight_sync_s"], ".4f"), fmt(r["load_avg"], ".1f"))
    console.print(t)
    console.print("[dim]step s: mean time/step; ops s: sum of time/<node> per step; outside ops: "
                  "1 - ops s / step s (mean over steps); load: 1-min load average during the run "
                  "(> CPU count means the timings are inflated by other processes)[/]")

    nodes = Table(title="operator compute per step (s), mean over measured steps")
    for col in ("node", "stage (ray)", "local", "ray", "ray/local"):
        nodes.add_column(col, justify="left" if col in ("node", "stage (ray)") else "right")
    for nid, lt in loc["node_s"].items():
        rt = ray["node_s"].get(nid)
        nodes.add_row(nid, ray["stage_of"].get(nid, "?"), f"{lt:.4f}", fmt(rt, ".4f"),
                      fmt(rt / lt if rt is not None and lt > 0 else None, ".2f"))
    nodes.add_row("[bold]outside ops[/]", "", f"{loc['mean_step_s'] - loc['op_compute_s']:.4f}",
                  f"{ray['mean_step_s'] - ray['op_compute_s']:.4f}", "")
    console.print(nodes)

    met = ratio_mean <= 1 + TARGET_RAY_OVERHEAD
    colour = "green" if met else "red"
    console.print(f"Ray/local step time: [{colour}]{ratio_mean:.3f}x mean[/], {ratio_median:.3f}x median "
                  f"(target <= {1 + TARGET_RAY_OVERHEAD:.2f}x: {'met' if met else 'NOT met'}); "
                  f"Ray/local steps/s = {ray['steps_per_s'] / loc['steps_per_s']:.3f}")
    return {"ray_over_local_step_time_mean": ratio_mean, "ray_over_local_step_time_median": ratio_median,
            "target_met": met}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--graph", default=str(DEFAULT_GRAPH), help="graph YAML (default graphs/dapo.yaml)")
    ap.add_argument("--steps", type=int, default=30, help="steps per executor (default 30)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: 4 steps and a 16-prompt validation set")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="PATH=VALUE",
                    help="graph edit applied to both runs, as `dapo-flow run --set`")
    ap.add_argument("--torch-threads", type=int, metavar="N",
                    help="experiment: give the model stage N torch threads on both executors instead "
                         "of the library's choice (all CPUs / actors; see runtime/setup.py)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--workdir", help="keep the MLflow store and checkpoints here (default: temp dir)")
    args = ap.parse_args(argv)
    console = make_console()
    steps = WARMUP_STEPS + 2 if args.quick else args.steps
    if steps <= WARMUP_STEPS:
        ap.error(f"--steps must be > {WARMUP_STEPS} (the warm-up)")
    # checkpoint only at the end; in quick mode a small validation set keeps it to seconds
    sets = [f"run.checkpoint_every={steps}", *args.sets]
    if args.quick:
        sets.append("data.val.size=16")
    if args.torch_threads:
        pin_torch_threads(args.torch_threads)
    results: dict[str, dict] = {}
    with scratch_dir(args.workdir, console):
        for name in EXECUTORS:
            console.rule(f"[bold]{name} executor[/]: {steps} steps")
            with LoadSampler() as load:
                summary, placed = run_graph(Path(args.graph), sets, executor=name, steps=steps,
                                            console=console)
            results[name] = {**analyse(summary, placed, WARMUP_STEPS), "load_avg": load.mean}
    console.rule("[bold]results")
    verdict = print_tables(console, results, args.graph, steps)
    write_json(args.json, {"graph": args.graph, "steps": steps, "warmup_steps": WARMUP_STEPS,
                           "torch_threads": args.torch_threads or "library default",
                           "edits": sets, "executors": results, **verdict}, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
