"""What isolation costs a python tool call: `isolation: bwrap` (the default) against `none`.

Each call runs a program through the tool as the agent loop does (`PythonSandbox.execute`):
a print (the floor: the sandbox's and the interpreter's start-up), a small computation a model
might write (primes below 20,000), and a burst of calls from 8 threads at once (the agent loop
runs a round's calls in threads). The settings are interleaved repetition by repetition, so a
busy moment hits both; each result is checked equal across settings before timings count.

Reported: the median and best seconds per call of each program and setting, and the ratio
bwrap / none (median over median), with the box's load average over the run.

Run: python benchmarks/sandbox.py [--quick] [--json out.json] [--reps R]
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from _common import LoadSampler, fmt, make_console, write_json

SETTINGS = ("none", "bwrap")
PROGRAMS = {
    "print": "print(42)",
    "primes": "n = 20000\nsieve = bytearray([1]) * n\nfor i in range(2, int(n ** 0.5) + 1):\n"
              "    if sieve[i]:\n        sieve[i*i::i] = bytearray(len(sieve[i*i::i]))\nprint(sum(sieve) - 2)",
}
BURST = 8  # calls at once from threads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="5 repetitions instead of 20")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--json", default=None, help="write the figures to this file")
    args = ap.parse_args()
    reps = args.reps or (5 if args.quick else 20)
    console = make_console()

    from dapo_flow.tools import isolation
    from dapo_flow.tools.sandbox import Config, PythonSandbox

    if isolation.problem():
        raise SystemExit(f"error: {isolation.problem()}")
    tools = {s: PythonSandbox(Config(isolation=s, timeout_s=30.0)) for s in SETTINGS}
    expected = {name: tools["none"].execute("warm", {"code": code}).text for name, code in PROGRAMS.items()}
    times: dict[tuple[str, str], list[float]] = {(p, s): [] for p in [*PROGRAMS, "burst"] for s in SETTINGS}
    with LoadSampler() as load:
        for rep in range(reps):
            console.print(f"repetition {rep + 1}/{reps}", highlight=False)
            for name, code in PROGRAMS.items():
                for setting in SETTINGS:
                    start = time.perf_counter()
                    result = tools[setting].execute("r", {"code": code})
                    times[(name, setting)].append(time.perf_counter() - start)
                    assert result.text == expected[name], (setting, result.text)
            for setting in SETTINGS:
                start = time.perf_counter()
                with ThreadPoolExecutor(BURST) as pool:
                    results = list(pool.map(lambda _: tools[setting].execute("r", {"code": PROGRAMS["print"]}),
                                            range(BURST)))
                times[("burst", setting)].append((time.perf_counter() - start) / BURST)
                assert all(r.text == expected["print"] for r in results), setting

    figures: dict = {"reps": reps, "load_avg": load.mean}
    console.print(f"\nseconds per call (median / best of {reps}; burst: {BURST} calls from threads, "
                  f"wall / {BURST}); load average {fmt(load.mean, '.2f')}")
    for name in [*PROGRAMS, "burst"]:
        med = {s: statistics.median(times[(name, s)]) for s in SETTINGS}
        best = {s: min(times[(name, s)]) for s in SETTINGS}
        ratio = med["bwrap"] / med["none"]
        figures[name] = {"median_s": med, "best_s": best, "ratio_bwrap_over_none": ratio,
                         "added_ms": 1000 * (med["bwrap"] - med["none"])}
        console.print(f"  {name:7s} none {med['none'] * 1000:7.1f} ms (best {best['none'] * 1000:6.1f})   "
                      f"bwrap {med['bwrap'] * 1000:7.1f} ms (best {best['bwrap'] * 1000:6.1f})   "
                      f"ratio {ratio:.2f}, +{1000 * (med['bwrap'] - med['none']):.1f} ms", highlight=False)
    write_json(args.json, figures, console)


if __name__ == "__main__":
    main()
