"""Scale: the FSDP2 policy-update step at 1 and 2 workers, same global batch, one run.

Each worker is a real process (benchmarks/_scale_worker.py, one rank) over gloo, as
tests/models/fsdp_worker.py, with 1 torch thread per rank (dapo_flow.threads.configure). The
model is a Llama built from scratch (no download); the step is what the `update` operator does
for one mini-batch: token-budget micro-batches (every rank runs the group's largest count),
forward with grad over the response positions, DAPO token-mean clipped policy loss normalised by
the global token count, backward, grad-norm clip, AdamW. The global batch is the same at every
world size and split across the ranks by ``balanced_partitions`` of the response lengths.

Reported per world size (steps after a warm-up; a step's time is the slowest rank's):

- median step seconds, tokens/s (prompt + response tokens of the global batch per second of
  step) and trained (response) tokens/s; speed-up = median step at 1 worker / at N;
- comm share: the wall time each rank's main thread spends inside collectives (the FSDP2
  all-gathers and reduce-scatters, the count all-reduces, the grad-norm all-reduce), over the
  step time; on CPU/gloo every one of them blocks the thread that calls it, so this is the
  communication the step waits for, including waiting for the other rank to arrive;
- transfer share: the same collectives (sizes recorded in a step) replayed back to back with no
  compute in between, over the step time: what the bytes cost alone;
- the step's parts (forward+backward, which holds the collectives, clip, AdamW), and a check
  that the first step's loss and grad norm are the same at every world size.

Run: python benchmarks/scale.py [--quick] [--json out.json] [--steps N] [--rounds R]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import LoadSampler, fmt, make_console, write_json

from dapo_flow.core.ports import free_port

WORKER = Path(__file__).with_name("_scale_worker.py")

# hidden 512, 8 layers, vocab 32000, tied embeddings: 41.6M parameters (Qwen2-0.5B's shape, scaled down)
FULL = {
    "model": {"vocab": 32000, "hidden": 512, "intermediate": 1376, "layers": 8, "heads": 8, "kv_heads": 8,
              "positions": 512, "tied": True},
    "rows": 16, "prompt": 64, "response": 128, "max_tokens": 768, "warmup": 1, "steps": 4,
}
QUICK = {
    "model": {"vocab": 8000, "hidden": 256, "intermediate": 688, "layers": 4, "heads": 4, "kv_heads": 4,
              "positions": 256, "tied": True},
    "rows": 8, "prompt": 32, "response": 64, "max_tokens": 192, "warmup": 1, "steps": 2,
}




def run_world(world: int, setting: dict, args, tmp: Path, tag: str, console) -> list[dict]:
    """Start ``world`` ranks, wait for them, return each rank's result."""
    out = tmp / tag
    cfg = {**setting, "world": world, "port": free_port(), "threads": args.threads, "out": str(out),
           "lr": 1e-5, "replays": args.replays, "sync_grads": args.sync_grads, "timeout": 120,
           "reshard_after_forward": not args.keep_unsharded,
           "profile": args.profile}
    config = tmp / f"{tag}.json"
    config.write_text(json.dumps(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    logs = [open(tmp / f"{tag}.rank{r}.log", "w+") for r in range(world)]
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(config), str(r)], stdout=logs[r],
                              stderr=subprocess.STDOUT, env=env) for r in range(world)]
    start = time.perf_counter()
    try:
        for p in procs:
            p.wait(timeout=args.timeout)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    for r, log in enumerate(logs):
        log.seek(0)
        text = log.read()
        log.close()
        if r in failed or (args.profile and r == 0):
            console.print(f"[dim]--- rank {r} of {world} (exit {procs[r].returncode}) ---[/]\n{text[-6000:]}")
    if failed:
        raise SystemExit(f"workers {failed} of world {world} failed (logs above)")
    console.print(f"[dim]world {world}: {time.perf_counter() - start:.1f} s wall (start-up, model build and "
                  "old-logprob pass included)[/]")
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(world)]


def analyse(runs: list[list[dict]]) -> dict:
    """Per world size: the ranks' results of every round -> the reported figures."""
    step_s, comm_s, comm_max_s, parts = [], [], [], {"fwd_bwd_s": [], "clip_s": [], "adamw_s": []}
    comm_by_op: dict[str, list[float]] = {}
    replay = []
    for ranks in runs:
        measured = [[s for s in r["steps"] if not s["warmup"]] for r in ranks]
        for per_rank in zip(*measured):
            step = max(s["step_s"] for s in per_rank)
            step_s.append(step)
            comm_s.append(statistics.fmean(s["comm_s"] for s in per_rank))
            comm_max_s.append(max(s["comm_s"] for s in per_rank))
            for key in parts:
                parts[key].append(max(s[key] for s in per_rank))
            for op in per_rank[0]["comm_by_op"]:
                comm_by_op.setdefault(op, []).append(statistics.fmean(s["comm_by_op"].get(op, 0.0) for s in per_rank))
        replay += [max(rs) for rs in zip(*(r["replay_s"] for r in ranks))]
    first = runs[0]
    median = statistics.median(step_s)
    comm = statistics.median(c / s for c, s in zip(comm_s, step_s))
    transfer = statistics.median(replay) if replay else 0.0
    warm = [r["steps"][0] for r in first]  # the first step: same weights at every world size
    return {
        "params": first[0]["params"],
        "steps_measured": len(step_s),
        "step_seconds": step_s,
        "median_step_s": median,
        "min_step_s": min(step_s),
        "tokens_per_s": first[0]["global_tokens"] / median,
        "response_tokens_per_s": first[0]["global_response_tokens"] / median,
        "comm_share": comm,
        "comm_s": statistics.median(comm_s),
        "comm_max_rank_s": statistics.median(comm_max_s),
        "comm_by_op_s": {op: statistics.median(v) for op, v in comm_by_op.items()},
        "transfer_s": transfer,
        "transfer_share": transfer / median,
        "parts_s": {k: statistics.median(v) for k, v in parts.items()},
        "collectives_per_step": first[0]["steps"][-1]["calls"],
        "comm_bytes_per_rank_step": first[0]["steps"][-1]["comm_bytes"],
        "rank_rows": [r["rows"] for r in first],
        "rank_tokens": [r["tokens"] for r in first],
        "micro_batches_per_rank": first[0]["steps"][-1]["micro_batches"],
        "padded_tokens_per_step": sum(r["steps"][-1]["padded_tokens"] for r in first),
        "first_step_loss": sum(s["loss"] for s in warm),
        "first_step_grad_norm": warm[0]["grad_norm"],
        "async_collectives": sum(r["async_collectives"] for r in first),
        "torch_threads_per_rank": first[0]["torch_threads"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke test: a 4-layer 256-wide model, 8 rows, 2 steps")
    ap.add_argument("--steps", type=int, help="measured steps per world size (default 4; --quick 2)")
    ap.add_argument("--warmup", type=int, help="warm-up steps before them (default 1)")
    ap.add_argument("--worlds", default="1,2", help="world sizes, comma-separated (default 1,2)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the world sizes this many times, interleaved (1,2,1,2,...), pooling the steps")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    ap.add_argument("--replays", type=int, default=3, help="replays of one step's collectives (default 3)")
    ap.add_argument("--sync-grads", choices=("every", "last"), default="every",
                    help="experiment: 'last' reduce-scatters gradients only after the last micro-batch "
                         "(FSDP2 set_requires_gradient_sync); default 'every', as dapo-flow does")
    ap.add_argument("--keep-unsharded", action="store_true",
                    help="experiment: shard_model(reshard_after_forward=False): keep each layer's gathered "
                         "weights from forward to backward (no second all-gather, more memory)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per world size before the ranks are killed")
    ap.add_argument("--profile", action="store_true", help="development: print rank 0's torch.profiler table")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    console = make_console()
    setting = dict(QUICK if args.quick else FULL)
    if args.steps is not None:
        setting["steps"] = args.steps
    if args.warmup is not None:
        setting["warmup"] = args.warmup
    if setting["steps"] < 1:
        ap.error("--steps must be >= 1")
    worlds = [int(w) for w in args.worlds.split(",")]
    m = setting["model"]
    console.print(f"Llama {m['layers']} layers x {m['hidden']} (mlp {m['intermediate']}, {m['heads']} heads), vocab "
                  f"{m['vocab']}, tied={m['tied']}; global batch {setting['rows']} rows x ({setting['prompt']} "
                  f"prompt + <= {setting['response']} response) tokens, micro-batches <= {setting['max_tokens']} "
                  f"tokens; {setting['warmup']} warm-up + {setting['steps']} measured steps; {args.threads} torch "
                  f"thread(s) per rank; {os.cpu_count()} CPUs; gradient reduce-scatter after {args.sync_grads} "
                  f"micro-batch, reshard_after_forward={not args.keep_unsharded}")
    runs: dict[int, list[list[dict]]] = {w: [] for w in worlds}
    loads: dict[int, list[float]] = {w: [] for w in worlds}
    with tempfile.TemporaryDirectory(prefix="dapo-flow-scale-") as tmp:
        for rnd in range(args.rounds):
            for w in worlds:
                console.rule(f"[bold]{w} worker(s)[/] (round {rnd + 1}/{args.rounds})")
                with LoadSampler() as load:
                    runs[w].append(run_world(w, setting, args, Path(tmp), f"w{w}_r{rnd}", console))
                if load.mean is not None:
                    loads[w].append(load.mean)
    res = {w: {**analyse(runs[w]), "load_avg": statistics.fmean(loads[w]) if loads[w] else None} for w in worlds}
    verdict = report(console, res, worlds)
    import torch

    write_json(args.json, {"setting": setting, "quick": args.quick, "rounds": args.rounds, "threads": args.threads,
                           "sync_grads": args.sync_grads,
                           "reshard_after_forward": not args.keep_unsharded, "cpus": os.cpu_count(), "torch": torch.__version__,
                           "worlds": {str(w): r for w, r in res.items()}, **verdict}, console)
    return 0


def report(console, res: dict[int, dict], worlds: list[int]) -> dict:
    from rich.table import Table

    base = res[worlds[0]]
    t = Table(title=f"FSDP2 policy-update step, {base['params'] / 1e6:.1f}M parameters, same global batch")
    cols = ("workers", "median s", "min s", "tok/s", "resp tok/s", "speed-up", "comm", "transfer", "fwd+bwd s",
            "clip s", "adamw s", "steps", "load")
    for col in cols:
        t.add_column(col, justify="right")
    for w in worlds:
        r = res[w]
        t.add_row(str(w), fmt(r["median_step_s"]), fmt(r["min_step_s"]), fmt(r["tokens_per_s"], ".0f"),
                  fmt(r["response_tokens_per_s"], ".0f"), f"{base['median_step_s'] / r['median_step_s']:.2f}x",
                  f"{r['comm_share']:.1%}", f"{r['transfer_share']:.1%}", fmt(r["parts_s"]["fwd_bwd_s"]),
                  fmt(r["parts_s"]["clip_s"]), fmt(r["parts_s"]["adamw_s"]), str(r["steps_measured"]),
                  fmt(r["load_avg"], ".1f"))
    console.print(t)
    console.print("[dim]a step's time is its slowest rank's; comm: wall time inside collectives on each rank "
                  "(mean over ranks) / step time, median over steps; transfer: the same collectives replayed "
                  "with no compute / median step; speed-up: median step at "
                  f"{worlds[0]} worker(s) / at N; load: 1-min load average during the run[/]")
    for w in worlds:
        r = res[w]
        ops = ", ".join(f"{op} {s * 1e3:.0f} ms" for op, s in r["comm_by_op_s"].items() if s >= 5e-4)
        console.print(f"workers {w}: rows per rank {r['rank_rows']}, tokens per rank {r['rank_tokens']}, "
                      f"{r['micro_batches_per_rank']} micro-batch(es) per rank, padded tokens/step "
                      f"{r['padded_tokens_per_step']}; collectives/step {r['collectives_per_step']}, "
                      f"{r['comm_bytes_per_rank_step'] / 2**20:.0f} MiB of collective inputs per rank; comm {ops or '-'}; "
                      f"first-step loss {r['first_step_loss']:.7f}, grad norm {r['first_step_grad_norm']:.6f}")
    out: dict = {}
    if len(worlds) > 1:
        last = res[worlds[-1]]
        out["speedup"] = base["median_step_s"] / last["median_step_s"]
        out["efficiency"] = out["speedup"] / (worlds[-1] / worlds[0])
        out["first_step_loss_rel_diff"] = abs(last["first_step_loss"] - base["first_step_loss"]) / max(
            1e-12, abs(base["first_step_loss"]))
        out["first_step_grad_norm_rel_diff"] = abs(last["first_step_grad_norm"] - base["first_step_grad_norm"]) / max(
            1e-12, abs(base["first_step_grad_norm"]))
        console.print(f"speed-up {worlds[-1]} vs {worlds[0]} workers: [bold]{out['speedup']:.2f}x[/] "
                      f"(parallel efficiency {out['efficiency']:.0%}); same update: first-step loss rel diff "
                      f"{out['first_step_loss_rel_diff']:.1e}, grad norm rel diff {out['first_step_grad_norm_rel_diff']:.1e}")
    return out


if __name__ == "__main__":
    sys.exit(main())
