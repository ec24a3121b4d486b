"""Reward scoring in a worker pool: rows/s of `builtin:math` at score workers 0 vs 1 vs 2.

The `score` operator is called on one Arrow table of math rollouts: chain-of-thought responses
(LaTeX, 0.5-8 KB, a length mix like DAPO's) ending in a `\\boxed{...}` answer (right, rewritten,
wrong), an `Answer:` line or nothing, against LaTeX ground truths. Baseline: `workers: 0` (in
the driver, row by row, today's path) in the same run; each pooled result is checked equal to
it before any timing counts.

Reported per setting: rows/s (median and best over repetitions, interleaved across settings so
a busy minute hits all of them), the ratio to workers=0 (median over median), and the pool's
start-up (the first call, one row per worker: spawning the workers, which re-import this
script's top-level imports, kept light on purpose as the CLI's are). The ceiling on this box is the core
count: the driver waits while the workers score, and pickling the texts both ways costs the
driver a few microseconds per row.

Run: python benchmarks/reward_pool.py [--quick] [--json out.json] [--rows N] [--reps R]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from _common import LoadSampler, fmt, make_console, write_json

SETTINGS = (0, 1, 2)  # score workers
TRUTHS = [r"\frac{3}{4}", r"2\sqrt{3}", "12", r"\dfrac{\pi}{6}", "x^2+1", "(1, 2)", "0.5",
          r"10\%", "-7", r"\text{(B)}", "1,000", r"\left(0, \frac{1}{2}\right]", r"\frac{\sqrt{5}-1}{2}",
          "144", r"3\pi", r"\{1, 3\}"]
WRONG = [r"\frac{4}{3}", "13", r"\sqrt{12}", "x^2-1", "(2, 1)", "0.25", "-8", r"2\pi", "143"]
SENTENCES = [
    r"Let $f(x) = x^2 - 3x + 2$, so $f(x) = (x-1)(x-2)$ and the roots are $x=1$ and $x=2$.",
    r"By the AM-GM inequality, $\frac{a+b}{2} \geq \sqrt{ab}$ with equality iff $a=b$.",
    r"Substituting $u = \tan\theta$ gives $\int \frac{du}{1+u^2} = \arctan u + C$.",
    r"The sum $\sum_{k=1}^{n} k = \frac{n(n+1)}{2}$, so for $n=16$ it is $136$.",
    r"Wait, let me double-check the sign: $-(-3) = 3$, so the term is positive.",
    r"Hence $\left(\frac{1}{2}\right)^{3} = \frac{1}{8}$ and the probability is $1 - \frac{1}{8}$.",
    r"Consider the triangle with sides $3$, $4$, $5$; it is right-angled since $3^2+4^2=5^2$.",
    r"Modulo $7$ we have $2^3 \equiv 1$, so $2^{100} = 2^{99} \cdot 2 \equiv 2 \pmod{7}$.",
]


def math_rows(n: int, seed: int = 0):
    """n rollouts as the score operator reads them (prompt_id, sample_idx, response, truth)."""
    import pyarrow as pa

    rng = random.Random(seed)
    responses, truths = [], []
    for _ in range(n):
        truth = rng.choice(TRUTHS)
        answer = rng.choice([truth, truth.replace(r"\frac", r"\dfrac"), f" {truth} ", rng.choice(WRONG)])
        body = " ".join(rng.choice(SENTENCES) for _ in range(int(rng.lognormvariate(2.6, 0.7)) + 4))
        ending = rng.choices([rf"Therefore the answer is $\boxed{{{answer}}}$.", f"Answer: {answer}",
                              "I could not finish."], weights=[8, 1, 1])[0]
        responses.append(f"Let's solve this step by step.\n\n{body}\n\n{ending}")
        truths.append(truth)
    return pa.table({"prompt_id": [f"p{i // 16}" for i in range(n)],
                     "sample_idx": pa.array([i % 16 for i in range(n)], pa.int32()),
                     "response_text": responses, "ground_truth": truths})


def measure(rows, reps: int) -> dict[int, dict]:
    from dapo_flow.core.contract import OpContext
    from dapo_flow.operators.score import Score

    ops = {w: Score(Score.Params(reward="builtin:math", workers=w), OpContext(f"score-{w}")) for w in SETTINGS}
    startup: dict[int, float] = {}
    expected = None
    for w, op in ops.items():
        start = time.perf_counter()
        op(rows.slice(0, max(w, 1)))  # a row per worker: every worker starts, scores one row
        startup[w] = time.perf_counter() - start
        out = op(rows)  # untimed warm-up, and the pooled columns against in-process
        expected = out if expected is None else expected
        if not out.equals(expected):
            raise SystemExit(f"workers={w} scored differently from workers=0")
    times: dict[int, list[float]] = {w: [] for w in SETTINGS}
    for _ in range(reps):  # interleaved: a busy minute slows every setting alike
        for w, op in ops.items():
            start = time.perf_counter()
            op(rows)
            times[w].append(time.perf_counter() - start)
    for op in ops.values():
        op.close()
    n = rows.num_rows
    base = n / statistics.median(times[0])
    return {w: {"rows_per_s_median": n / statistics.median(t), "rows_per_s_best": n / min(t),
                "ratio_to_workers_0": n / statistics.median(t) / base,
                "startup_s": startup[w] if w else None}
            for w, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8192, help="rows per call (default 8192)")
    ap.add_argument("--reps", type=int, default=7, help="timed calls per setting (default 7)")
    ap.add_argument("--quick", action="store_true", help="smoke test: 1024 rows, 2 repetitions")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    rows_n, reps = (1024, 2) if args.quick else (args.rows, args.reps)
    console = make_console()
    rows = math_rows(rows_n)
    chars = sum(len(t) for t in rows.column("response_text").to_pylist()) / rows_n
    console.print(f"{rows_n} builtin:math rows, mean response {chars:.0f} chars; {reps} timed calls each")
    with LoadSampler() as load:
        res = measure(rows, reps)
    from rich.table import Table

    t = Table(title="score builtin:math, one call on the whole table")
    for col in ("workers", "rows/s (median)", "rows/s (best)", "vs workers=0", "start-up s"):
        t.add_column(col, justify="right")
    for w, r in res.items():
        t.add_row(str(w), f"{r['rows_per_s_median']:,.0f}", f"{r['rows_per_s_best']:,.0f}",
                  f"{r['ratio_to_workers_0']:.2f}x", fmt(r["startup_s"], ".2f"))
    console.print(t)
    console.print(f"[dim]load: {fmt(load.mean, '.1f')} (1-min load average during the run; above the "
                  "CPU count the timings are inflated)[/]")
    write_json(args.json, {"rows": rows_n, "reps": reps, "mean_response_chars": chars,
                           "load_avg": load.mean, "workers": res}, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
