"""A Ray actor's compute beside busy processes, at the niceness Ray gives its workers (15) and at
the one dapo-flow's actors run at (0), in one invocation.

Each round starts a local Ray cluster whose raylet gets ``RAY_worker_niceness`` (15: Ray's
default; 0: what ``dapo-flow run`` sets), one 1-CPU actor, and times a fixed block of 1-thread
matmuls inside it (~50 ms on an idle core) and a no-op round trip: first on a quiet box, then
beside as many busy-loop processes (nice 0) as the box has CPUs. The nice-0 round's actor is
brought to normal priority by dapo-flow's own ``normal_priority()``, as every stage actor is.

    python benchmarks/actor_priority.py            # 10 timed blocks per case (~1 min)
    python benchmarks/actor_priority.py --quick    # 3 per case
    python benchmarks/actor_priority.py --json out.json

Reported: median ms per block quiet and loaded, and loaded/quiet (the slowdown). At nice 15 a
busy nice-0 process takes ~97% of a shared core (CFS weights 36 vs 1024), so the actor crawls.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import make_console, write_json  # noqa: E402

from rich.table import Table  # noqa: E402


def _actor_class(reset_priority: bool):
    import ray

    @ray.remote(num_cpus=1)
    class Matmuls:
        def __init__(self):
            import torch

            if reset_priority:
                from dapo_flow.runtime.executors import normal_priority

                normal_priority()
            torch.set_num_threads(1)
            self.a, self.w = torch.randn(960, 64), torch.randn(64, 256)

        def nice(self) -> int:
            return os.getpriority(os.PRIO_PROCESS, 0)

        def block(self) -> float:
            start = time.perf_counter()
            for _ in range(130):
                self.a @ self.w
            return time.perf_counter() - start

    return Matmuls


def _busy_loops(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def _measure(actor, reps: int) -> dict:
    import ray

    ray.get(actor.block.remote())  # warm-up
    blocks = [ray.get(actor.block.remote()) for _ in range(reps)]
    start = time.perf_counter()
    for _ in range(reps * 5):
        ray.get(actor.nice.remote())
    ping = (time.perf_counter() - start) / (reps * 5)
    return {"block_ms": 1e3 * statistics.median(blocks), "ping_ms": 1e3 * ping}


def run_case(niceness: int, reps: int, busy: int) -> dict:
    import ray

    os.environ["RAY_worker_niceness"] = str(niceness)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=max(2, busy), include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        actor = _actor_class(reset_priority=niceness == 0).remote()
        nice = ray.get(actor.nice.remote())
        quiet = _measure(actor, reps)
        loops = _busy_loops(busy)
        try:
            time.sleep(1.0)
            loaded = _measure(actor, reps)
        finally:
            for p in loops:
                p.kill()
                p.wait()
    finally:
        ray.shutdown()
    return {"ray_worker_niceness": niceness, "actor_nice": nice, "busy_loops": busy,
            "quiet_block_ms": quiet["block_ms"], "loaded_block_ms": loaded["block_ms"],
            "slowdown": loaded["block_ms"] / quiet["block_ms"],
            "quiet_ping_ms": quiet["ping_ms"], "loaded_ping_ms": loaded["ping_ms"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 timed blocks per case")
    parser.add_argument("--reps", type=int, default=10, help="timed blocks per case (default 10)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    reps = 3 if args.quick else max(1, args.reps)
    busy = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
    console = make_console()
    rows = [run_case(n, reps, busy) for n in (15, 0)]
    table = Table(title=f"1-CPU actor, 130 1-thread matmuls per block, beside {busy} busy loop(s)")
    for col in ("Ray worker niceness", "actor nice", "quiet ms", "loaded ms", "slowdown",
                "ping quiet ms", "ping loaded ms"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["ray_worker_niceness"]), str(r["actor_nice"]), f"{r['quiet_block_ms']:.1f}",
                      f"{r['loaded_block_ms']:.1f}", f"{r['slowdown']:.1f}x", f"{r['quiet_ping_ms']:.2f}",
                      f"{r['loaded_ping_ms']:.2f}")
    console.print(table)
    console.print(f"nice 15 / nice 0 loaded block time: {rows[0]['loaded_block_ms'] / rows[1]['loaded_block_ms']:.1f}x")
    write_json(args.json, {"busy_loops": busy, "reps": reps, "cases": rows}, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
