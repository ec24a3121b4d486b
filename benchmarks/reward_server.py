"""Reward server: scores/s through `dapo-flow serve-reward` against in-process scoring.

Two reward functions, each scored by one `score` call on one Arrow table:
- `builtin:math` on the math rollouts of reward_pool.py (CPU-bound, ~50 µs a row in-process):
  what the HTTP hop costs (JSON both ways, the loopback round trip);
- a judge (benchmarks/_judge.py: 5 ms a verdict, waiting as on a remote model's API): what a
  server's threads and concurrent requests buy for an I/O-bound reward.
Settings per function: in-process (`workers: 0`, row by row, the baseline, measured in the same
run); the server at the same batch (one request of `--batch` rows in flight); the server under
64-way concurrency (the table in 64 requests sent at once, the server running 64 threads; its
CPU-bound function still shares one interpreter). Every server result is checked equal to the
in-process table before anything is timed; timed calls are interleaved across settings.

Run: python benchmarks/reward_server.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from _common import REPO, LoadSampler, make_console, write_json
from reward_pool import math_rows

JUDGE = str(REPO / "benchmarks" / "_judge.py") + ":judge"
CONCURRENT = 64


def start_server(ref: str, concurrency: int) -> tuple[subprocess.Popen, str]:
    import socket

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "dapo_flow.cli", "serve-reward", ref, "--port", str(port),
                             "--concurrency", str(concurrency)], cwd=tempfile.gettempdir(),
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(1200):
        if proc.poll() is not None:
            raise SystemExit(f"serve-reward {ref} exited {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"serve-reward {ref} did not start")


def measure(ref: str, rows, batch: int, reps: int) -> dict[str, dict]:
    from dapo_flow.core.contract import OpContext
    from dapo_flow.operators.score import Score

    concurrent_batch = max(1, -(-rows.num_rows // CONCURRENT))
    procs = []
    try:
        same, url_same = start_server(ref, 1)
        wide, url_wide = start_server(ref, CONCURRENT)
        procs = [same, wide]
        params = {"in-process": dict(reward=ref),
                  f"server, batch {batch}": dict(reward=url_same, server={"batch_size": batch, "concurrency": 1}),
                  f"server, {CONCURRENT}-way": dict(reward=url_wide, server={"batch_size": concurrent_batch,
                                                                            "concurrency": CONCURRENT})}
        ops = {name: Score(Score.Params(**p), OpContext(name)) for name, p in params.items()}
        expected = ops["in-process"](rows)
        for name, op in ops.items():  # warm-up, and the server's columns against in-process
            if not op(rows).equals(expected):
                raise SystemExit(f"{ref}: '{name}' scored differently from in-process")
        times: dict[str, list[float]] = {name: [] for name in ops}
        for _ in range(reps):
            for name, op in ops.items():
                start = time.perf_counter()
                op(rows)
                times[name].append(time.perf_counter() - start)
        for op in ops.values():
            op.close()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    base = rows.num_rows / statistics.median(times["in-process"])
    return {name: {"scores_per_s_median": rows.num_rows / statistics.median(t),
                   "scores_per_s_best": rows.num_rows / min(t),
                   "ratio_to_in_process": rows.num_rows / statistics.median(t) / base} for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke test: 256 math / 128 judge rows, 2 repetitions (default 1024 each, 3)")
    ap.add_argument("--batch", type=int, default=256, help="rows per request at concurrency 1 (default 256)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    n_math, n_judge, reps = (256, 128, 2) if args.quick else (1024, 1024, 3)
    import pyarrow as pa

    console = make_console()
    results = {}
    with LoadSampler() as load:
        for what, ref, n in (("builtin:math", "builtin:math", n_math), ("judge (5 ms)", JUDGE, n_judge)):
            rows = math_rows(n)
            rows = rows.append_column("prompt_text", pa.array([f"question {i // 16}" for i in range(n)]))
            console.print(f"{what}: {n} rows, {reps} timed calls per setting")
            results[what] = {"rows": n, "settings": measure(ref, rows, min(args.batch, n), reps)}
    from rich.table import Table

    t = Table(title="scores/s, one score call on the whole table")
    for col in ("reward", "setting", "scores/s (median)", "scores/s (best)", "vs in-process"):
        t.add_column(col, justify="right")
    for what, r in results.items():
        for name, s in r["settings"].items():
            t.add_row(what, name, f"{s['scores_per_s_median']:,.0f}", f"{s['scores_per_s_best']:,.0f}",
                      f"{s['ratio_to_in_process']:.2f}x")
    console.print(t)
    console.print(f"[dim]load: {load.mean:.1f} (1-min load average during the run; above the CPU count "
                  "the timings are inflated)[/]")
    write_json(args.json, {"reps": reps, "batch": args.batch, "concurrent": CONCURRENT,
                           "load_avg": load.mean, "results": results}, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
