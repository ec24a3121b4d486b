"""Padded against packed micro-batches (``train.pack``): tokens/s of the update's logprob pass
(forward and backward) and its memory peak, at two length spreads, in one run.

A random-init Qwen2 (``_common.random_qwen2``: 4 layers, hidden 256, 4 query / 2 KV heads,
intermediate 768, vocabulary 4096: 4.2M parameters; ``--quick``: 2 layers, hidden 128, 0.4M) runs
``HFPolicy.response_logprobs(grad=True)`` with the entropy, then a token-mean loss's backward,
micro-batch after micro-batch (``--micro-batch`` rows), over the same rows padded and packed:

- chat: dapo-chat's shape, prompts of 20-40 tokens (the chat template around a chain problem)
  and responses of 4-40 (its max_tokens), uniform;
- long_tail: prompts of 20-40 and responses of 10-400 tokens, most short (log-uniform), a few
  long: where padding to the longest row wastes most.

Each (spread, variant) runs in a fresh process: the time is the median of ``--reps`` passes over
all rows after one warm-up; the peak the process's resident memory over the pass above the
loaded model (``VmHWM``). Real tokens (prompt + response, no padding) per second are what both
are credited with. ``max_abs_logp_diff``: the largest difference of the two variants'
logprobs on the same rows.

JSON keys: ``speedup_chat``, ``speedup_long_tail`` (packed / padded tokens/s),
``max_abs_logp_diff``, ``peak_ratio`` (packed / padded peak, long tail), and each run's figures.
Target on CPU: ``speedup_long_tail`` >= 1.5.

Run: python benchmarks/packing.py [--quick] [--json PATH] [--rows N] [--micro-batch M] [--reps R]
     [--spreads chat,long_tail]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import fmt, make_console, proc_status, random_qwen2, run_variant_process, write_json  # noqa: E402

SHAPE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=768, vocab_size=4096)
QUICK_SHAPE = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=256, vocab_size=1024)
SPREADS = {"chat": (4, 40, False), "long_tail": (10, 400, True)}  # response lengths: low, high, log-uniform
TARGET = 1.5


def rows_of(spread: str, count: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """``count`` prompts of 20-40 tokens and responses of the spread's lengths (seeded)."""
    low, high, log = SPREADS[spread]
    rng = random.Random(seed)
    lengths = [int(math.exp(rng.uniform(math.log(low), math.log(high)))) if log else rng.randint(low, high)
               for _ in range(count)]
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(20, 40))] for _ in range(count)]
    responses = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    return prompts, responses


def run_variant(cfg: dict) -> dict:
    """One (spread, variant) in this process: passes over all rows, timed; the peak above the
    loaded model; the logprobs of the first micro-batch (to compare the variants)."""
    import torch

    from dapo_flow.models.hf import HFPolicy

    torch.set_num_threads(cfg["threads"])
    policy = HFPolicy(cfg["model"], trainable=True, pack=cfg["pack"])
    prompts, responses = rows_of(cfg["spread"], cfg["rows"], cfg["vocab"])
    m = cfg["micro_batch"]

    def one_pass() -> torch.Tensor:
        first = None
        for i in range(0, len(prompts), m):
            logp, ent, mask = policy.response_logprobs(prompts[i:i + m], responses[i:i + m], with_entropy=True,
                                                       grad=True)
            loss = -(logp * mask).sum() / mask.sum() - 0.01 * (ent * mask).sum() / mask.sum()
            loss.backward()
            if first is None:
                first = logp.detach()[mask]
        policy.model.zero_grad(set_to_none=True)
        return first

    one_pass()  # warm-up: one-time allocations go to the baseline
    Path("/proc/self/clear_refs").write_text("5")
    baseline = proc_status("VmRSS")
    seconds = []
    for _ in range(cfg["reps"]):
        start = time.perf_counter()
        first = one_pass()
        seconds.append(time.perf_counter() - start)
    tokens = sum(len(p) + len(r) for p, r in zip(prompts, responses))
    return {"seconds": statistics.median(seconds), "tokens": tokens, "tokens_per_s": tokens / statistics.median(seconds),
            "peak_bytes": proc_status("VmHWM") - baseline, "first_logp": first.tolist()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--rows", type=int, help="rows per spread (default 64; --quick 32)")
    ap.add_argument("--micro-batch", type=int, default=8, help="rows per pass (default 8)")
    ap.add_argument("--reps", type=int, help="timed passes (default 3; --quick 2)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--spreads", default=",".join(SPREADS),
                    help=f"which length spreads to run (default all: {','.join(SPREADS)}); long_tail is always run")
    ap.add_argument("--variant", help=argparse.SUPPRESS)  # internal: one run, its JSON printed
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(run_variant(json.loads(args.variant))))
        return
    console = make_console()
    shape = QUICK_SHAPE if args.quick else SHAPE
    base = dict(threads=args.threads, vocab=shape["vocab_size"], rows=args.rows or (32 if args.quick else 64),
                micro_batch=args.micro_batch, reps=args.reps or (2 if args.quick else 3))
    from dapo_flow.models.hf import hf_progress_bars_off
    from dapo_flow.models.tokenizer import build_char_tokenizer

    runs: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory(prefix="dapo-flow-packing-") as tmp, hf_progress_bars_off():
        facts = random_qwen2(Path(tmp) / "model", shape, build_char_tokenizer())
        base["model"] = str(Path(tmp) / "model")
        console.print(f"model: Qwen2, {facts['num_parameters'] / 1e6:.1f}M parameters; {base['rows']} rows a spread, "
                      f"micro-batches of {base['micro_batch']}, {base['reps']} timed passes, {args.threads} thread(s)")
        for spread in [s for s in SPREADS if s in args.spreads.split(",") or s == "long_tail"]:
            for variant in ("padded", "packed"):
                cfg = {**base, "spread": spread, "pack": variant == "packed"}
                runs.setdefault(spread, {})[variant] = run_variant_process(
                    __file__, cfg, threads=args.threads, console=console, what=f"{spread} {variant}")
                console.print(f"  {spread} {variant}: {runs[spread][variant]['tokens_per_s']:,.0f} tokens/s")
    from rich.table import Table

    table = Table(title="logprob pass + backward: padded vs packed micro-batches (cpu)")
    for col in ("spread", "real tokens", "padded tok/s", "packed tok/s", "speedup", "padded peak MiB",
                "packed peak MiB", "peak ratio"):
        table.add_column(col, justify="right")
    out: dict = {"model": facts, "settings": {k: v for k, v in base.items() if k != "model"}, "runs": {}}
    diffs = []
    for spread, pair in runs.items():
        a, b = pair["padded"], pair["packed"]
        speedup, peak = b["tokens_per_s"] / a["tokens_per_s"], b["peak_bytes"] / max(a["peak_bytes"], 1)
        diffs.append(max((abs(x - y) for x, y in zip(a["first_logp"], b["first_logp"])), default=0.0))
        out[f"speedup_{spread}"] = speedup
        out["runs"][spread] = {v: {k: r[k] for k in ("seconds", "tokens", "tokens_per_s", "peak_bytes")}
                               for v, r in pair.items()} | {"peak_ratio": peak}
        table.add_row(spread, f"{a['tokens']:,}", f"{a['tokens_per_s']:,.0f}", f"{b['tokens_per_s']:,.0f}",
                      fmt(speedup, ".2f"), f"{a['peak_bytes'] / 2**20:,.1f}", f"{b['peak_bytes'] / 2**20:,.1f}",
                      fmt(peak, ".2f"))
    out["max_abs_logp_diff"] = max(diffs)
    out["peak_ratio"] = out["runs"]["long_tail"]["peak_ratio"]
    out["target_met"] = out["speedup_long_tail"] >= TARGET
    console.print(table)
    console.print(f"speedup_long_tail {out['speedup_long_tail']:.2f} (target >= {TARGET}: "
                  f"{'met' if out['target_met'] else 'not met'}); max |logp padded - packed| "
                  f"{out['max_abs_logp_diff']:.2e}")
    write_json(args.json, out, console)


if __name__ == "__main__":
    main()
