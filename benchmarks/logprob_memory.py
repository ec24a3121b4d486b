"""Token logprobs + entropy of a linear LM head, forward and backward: naive against chunked, one run.

What it measures: the peak memory and the time of one training-style call of

- naive: ``logits = linear(hidden, weight).float() / temperature`` for every position at once,
  then ``logprobs_from_logits`` and ``entropy_from_logits`` on those float32 (tokens, vocab)
  logits (``dapo_flow.models.hf.response_logprobs_of`` with ``chunk_tokens`` None);
- chunked: ``chunked_linear_logprobs(hidden, weight, labels, chunk_tokens=C, with_entropy=True)``
  (at most C positions' logits at a time, each chunk's logits recomputed in the backward;
  ``response_logprobs_of`` with ``train.logprob_chunk_tokens: C``) on its fused path: one
  reused float32 chunk buffer, the logits' gradient written in place from the saved logsumexp
  and entropy (a bf16 head's matmuls in bf16, its logits cast to float32 per chunk);
- generic (``--generic``): the same chunked call forced onto the generic path (autograd through
  each recomputed chunk, fresh buffers per chunk: what a bf16 head took before it had the fused
  path, and what odd dtype mixes still take), for comparison;

each followed by ``loss.backward()`` of a random upstream loss, ``(logp * a).sum() + (entropy *
b).sum()`` (a, b fixed standard-normal vectors: the entropy-bonus case, the widest backward; with
``--entropy-metric-only`` the loss is ``(logp * a).sum()`` and the entropy is computed and kept, as
a logged metric, until the backward is done), giving the gradients of the hidden states and of
the head's weight. Inputs: hidden (rows x tokens, hidden) standard normal, weight (vocab, hidden)
normal with std 0.02 (HF's init), labels uniform over the vocabulary, seed 0, the same in both
variants. Head: Qwen2.5-0.5B's (vocab 151936, hidden 896), no bias, temperature 1.0.

Memory: each variant runs in a fresh process (this script with ``--worker``): inputs allocated,
the code path warmed on a tiny head (thread pools, lazy init), then per call: gradients and
outputs dropped, ``gc.collect()`` + glibc ``malloc_trim(0)``, baseline = VmRSS, the peak RSS
reset (``/proc/self/clear_refs`` 5; a fresh process already starts low), the call, peak = VmHWM
- baseline: the memory the call adds on top of its inputs, its outputs and gradients included.
The largest over the calls (1 warm-up + reps) is reported. On CUDA, ``max_memory_allocated``
minus ``memory_allocated`` before the call (after ``reset_peak_memory_stats``) instead.
On CPU, glibc's allocator shows in the figures: with its default (dynamic) mmap threshold, freed
buffers under 32 MiB stay in the heap and are not all reused, so a chunked call
with (chunk, vocab) buffers under 32 MiB (at vocab 151936: chunks under 56 positions; --quick's
16 MiB) measures more than its buffers (``MALLOC_MMAP_THRESHOLD_=1048576`` in the environment,
passed on to the workers, turns that off). Time: median of ``--reps`` calls (3 on CUDA, 2 on
CPU) after the warm-up, forward and backward apart and together (CUDA synchronised). Equal
results: both workers save logp, entropy and both gradients of their last call, and this
process prints the max |naive - chunked| of each.

Size: the target is 16 rows x 1024 tokens (16384 positions; the default on CUDA, bfloat16
hidden states and head as a GPU model runs). Its naive float32 logits are 10 GB alone and the
naive call's peak ~7.5x that (``dapo_flow.graph.memory.LOGITS_PEAK_BUFFERS_ENTROPY``): it cannot
run on a CPU box with tens of GiB. On CPU the default keeps the target's 16 rows and halves the
tokens per row from 1024 until the naive peak estimate fits ``CPU_NAIVE_CAP`` (6 GiB) and
``--max-gib``: 16 x 64 at this vocabulary, float32 (the dtype HFPolicy trains in on CPU).
Before the naive worker starts its peak is estimated, and it is skipped (the chunked one still
runs) when the estimate exceeds ``--max-gib`` (default: 60% of MemAvailable on CPU, the free
device memory on CUDA). ``--chunk-tokens`` defaults to one row's tokens (``--tokens``): 1024 at
the target size, 1/16 of the positions, the same fraction at the CPU default. The library's own
default is None (no chunking); the 7B recipe sets 4096 for 20480-token micro-batches.
Targets: chunked peak <= 25% of naive, chunked time <= 1.2x naive.

Run: python benchmarks/logprob_memory.py [--quick] [--json PATH] [--rows R --tokens T]
     [--chunk-tokens C] [--dtype D] [--reps N] [--max-gib G] [--threads N] [--entropy-metric-only]
     [--generic]
``--quick``: vocab 32000, hidden 256, 4 x 128 (chunk 128), float32, 2 timed calls: seconds (a smoke
run: at a quarter of the positions per chunk and this small a head its ratios say little).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import LoadSampler, fmt, make_console, write_json

GiB = 2**30
FULL = dict(vocab=151936, hidden=896)  # Qwen2.5-0.5B's head
QUICK = dict(vocab=32000, hidden=256, rows=4, tokens=128)
ISSUE_ROWS, ISSUE_TOKENS = 16, 1024
CPU_NAIVE_CAP = 6 * GiB  # the CPU default size keeps the naive peak estimate under this
TEMPERATURE = 1.0
TARGET_PEAK_RATIO, TARGET_TIME_RATIO = 0.25, 1.2
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


# ---------------------------------------------------------------- estimates and sizes


def naive_estimate(n: int, vocab: int, hidden: int, dtype: str) -> int:
    """Bytes the naive call adds: float32 (n, vocab) buffers at the logits' backward peak (the
    project's measured count, entropy in the loss), the model-dtype logits when they are not
    float32, and the gradients (hidden states', head's)."""
    from dapo_flow.graph.memory import LOGITS_PEAK_BUFFERS_ENTROPY

    d = DTYPE_BYTES[dtype]
    logits = n * vocab * 4 * LOGITS_PEAK_BUFFERS_ENTROPY + (n * vocab * d if d != 4 else 0)
    return int(logits + vocab * hidden * d + n * hidden * d)


def chunked_estimate(n: int, chunk: int, vocab: int, hidden: int, dtype: str) -> int:
    """The same for one chunk's logits, plus the float32 weight-gradient accumulator."""
    d = DTYPE_BYTES[dtype]
    return naive_estimate(min(n, chunk), vocab, hidden, dtype) + vocab * hidden * 4 + n * hidden * d


def mem_available() -> int:
    text = Path("/proc/meminfo").read_text()
    return int(re.search(r"MemAvailable:\s+(\d+) kB", text).group(1)) * 1024


# ---------------------------------------------------------------- worker (one variant, fresh process)


def _status_kb(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where not allowed."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def worker(args: argparse.Namespace) -> None:
    import ctypes

    import torch

    from dapo_flow.algos.logprobs import chunked_linear_logprobs, entropy_from_logits, logprobs_from_logits

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker == "generic":  # the chunked call without its fused paths (autograd per chunk)
        import dapo_flow.algos.logprobs as logprobs_module

        logprobs_module._fused_applies = lambda *_: False
        logprobs_module._low_precision_compute = lambda *_: None
    cuda = args.device == "cuda"
    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    n, vocab, hdim = args.rows * args.tokens, args.vocab, args.hidden
    trim = ctypes.CDLL("libc.so.6").malloc_trim if not cuda else (lambda _: None)
    result: dict = {"variant": args.worker, "threads": torch.get_num_threads()}

    if cuda and args.worker == "naive":
        free, total = torch.cuda.mem_get_info()
        budget = args.max_gib * GiB if args.max_gib else free
        est = naive_estimate(n, vocab, hdim, args.dtype)
        if est > budget:
            result["skipped"] = (f"naive peak estimate {est / GiB:.1f} GiB > budget {budget / GiB:.1f} GiB "
                                 f"(free device memory {free / GiB:.1f} of {total / GiB:.1f} GiB)")
            Path(args.worker_out).write_text(json.dumps(result))
            return

    def make(seed: int, rows: int, v: int):
        g = torch.Generator(device=dev).manual_seed(seed)
        hidden = torch.randn(rows, hdim, generator=g, device=dev, dtype=dtype).requires_grad_()
        weight = torch.randn(v, hdim, generator=g, device=dev, dtype=dtype).mul_(0.02).requires_grad_()
        labels = torch.randint(v, (rows,), generator=g, device=dev)
        a = torch.randn(rows, generator=g, device=dev)
        b = torch.randn(rows, generator=g, device=dev)
        return hidden, weight, labels, a, b

    def call(hidden, weight, labels, a, b) -> tuple[float, float, tuple]:
        """One forward + backward; (forward s, backward s, outputs)."""
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if args.worker == "naive":  # response_logprobs_of, chunk_tokens None
            raw = torch.nn.functional.linear(hidden, weight)
            logits = raw.float() / TEMPERATURE
            logp = logprobs_from_logits(logits, labels)
            ent = entropy_from_logits(logits)
            del raw, logits
        else:
            logp, ent = chunked_linear_logprobs(hidden, weight, labels, chunk_tokens=args.chunk_tokens,
                                                temperature=TEMPERATURE, with_entropy=True)
        loss = (logp * a).sum()
        if not args.entropy_metric_only:
            loss = loss + (ent * b).sum()
        if cuda:
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, (logp.detach(), ent.detach())

    # warm the code path (thread pools, lazy init) on a tiny head, before any baseline
    tiny = make(1, 8, 64)
    call(*tiny)
    del tiny

    inputs = make(0, n, vocab)
    hidden, weight = inputs[0], inputs[1]
    peaks, fwd, bwd = [], [], []
    outputs = None
    for i in range(1 + args.reps):
        hidden.grad = weight.grad = None
        outputs = None
        gc.collect()
        trim(0)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            base = _status_kb("VmRSS") * 1024
            result["peak_reset"] = _reset_peak_rss()
        try:
            f, bk, outputs = call(*inputs)
        except torch.OutOfMemoryError as e:
            result["skipped"] = f"out of memory: {str(e).splitlines()[0]}"
            break
        if cuda:
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() - base)
        else:
            peaks.append(_status_kb("VmHWM") * 1024 - base)
        if i:  # the first call is the warm-up
            fwd.append(f)
            bwd.append(bk)
    if "skipped" not in result:
        tot = [f + bk for f, bk in zip(fwd, bwd)]
        result.update(
            peak_bytes=max(peaks), peaks=peaks, forward_s=statistics.median(fwd), backward_s=statistics.median(bwd),
            seconds=statistics.median(tot), seconds_min=min(tot), seconds_max=max(tot),
            baseline_rss_bytes=None if cuda else base,
        )
        torch.save({"logp": outputs[0].cpu(), "entropy": outputs[1].cpu(), "grad_hidden": hidden.grad.cpu(),
                    "grad_weight": weight.grad.cpu()}, args.worker_tensors)
    Path(args.worker_out).write_text(json.dumps(result))


# ---------------------------------------------------------------- driver


def run_worker(variant: str, args: argparse.Namespace, tmp: Path, console) -> dict:
    out, tensors = tmp / f"{variant}.json", tmp / f"{variant}.pt"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", variant, "--worker-out", str(out),
           "--worker-tensors", str(tensors), "--device", args.device, "--dtype", args.dtype,
           "--rows", str(args.rows), "--tokens", str(args.tokens), "--vocab", str(args.vocab),
           "--hidden", str(args.hidden), "--chunk-tokens", str(args.chunk_tokens), "--reps", str(args.reps)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    if args.max_gib:
        cmd += ["--max-gib", str(args.max_gib)]
    if args.entropy_metric_only:
        cmd.append("--entropy-metric-only")
    start = time.perf_counter()
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
    if proc.returncode != 0 or not out.is_file():
        raise SystemExit(f"{variant} worker failed (exit {proc.returncode})")
    res = json.loads(out.read_text())
    res["tensors"] = str(tensors) if tensors.is_file() else None
    console.print(f"[dim]{variant} worker done in {time.perf_counter() - start:.1f} s[/]")
    return res


def compare(naive: dict, chunked: dict) -> dict[str, dict[str, float]]:
    import torch

    a, b = torch.load(naive["tensors"]), torch.load(chunked["tensors"])
    diffs = {}
    for k in a:
        x, y = a[k].double(), b[k].double()
        d = (x - y).abs().max().item()
        diffs[k] = {"max_abs_diff": d, "max_abs": x.abs().max().item()}
    return diffs


def choose_size(args: argparse.Namespace, budget: int | None) -> str:
    """Fill in rows / tokens / chunk_tokens; returns why this size."""
    if args.quick:
        for k, v in QUICK.items():
            if getattr(args, k) is None:
                setattr(args, k, v)
        why = "--quick: a small head and size"
    else:
        args.vocab = args.vocab or FULL["vocab"]
        args.hidden = args.hidden or FULL["hidden"]
        if args.rows is not None and args.tokens is not None:
            why = "the size asked for (--rows / --tokens)"
        elif args.device == "cuda":
            args.rows = args.rows or ISSUE_ROWS
            args.tokens = args.tokens or ISSUE_TOKENS
            why = "the target size (CUDA default)"
        else:
            args.rows = args.rows or ISSUE_ROWS
            cap = min(CPU_NAIVE_CAP, budget or CPU_NAIVE_CAP)
            full = naive_estimate(ISSUE_ROWS * ISSUE_TOKENS, args.vocab, args.hidden, args.dtype)
            tokens = ISSUE_TOKENS
            while tokens > 1 and naive_estimate(args.rows * tokens, args.vocab, args.hidden, args.dtype) > cap:
                tokens //= 2
            args.tokens = args.tokens or tokens
            why = (f"CPU default: the target's {ISSUE_ROWS} x {ISSUE_TOKENS} would need ~{full / GiB:.0f} GiB for the "
                   f"naive call (10 GB of float32 logits, ~7.5 such buffers at its backward); its {args.rows} rows "
                   f"kept, tokens per row halved until the naive estimate fits {cap / GiB:.1f} GiB")
    if args.chunk_tokens is None:
        args.chunk_tokens = args.tokens  # one row's positions per chunk
    return why


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="vocab 32000, hidden 256, 4 x 128, 2 reps: seconds")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the results to PATH")
    ap.add_argument("--rows", type=int, default=None, help="rows (default: 16)")
    ap.add_argument("--tokens", type=int, default=None,
                    help="response tokens per row (default: 1024 on CUDA, the most that fits on CPU)")
    ap.add_argument("--vocab", type=int, default=None, help=f"vocabulary (default {FULL['vocab']})")
    ap.add_argument("--hidden", type=int, default=None, help=f"hidden size (default {FULL['hidden']})")
    ap.add_argument("--chunk-tokens", type=int, default=None, help="positions per chunk (default: --tokens)")
    ap.add_argument("--dtype", choices=tuple(DTYPE_BYTES), default=None,
                    help="hidden states' and head's dtype (default: bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    ap.add_argument("--reps", type=int, default=None,
                    help="timed calls per variant after 1 warm-up (default 3 on CUDA, 2 on CPU: a CPU run "
                         "of the default size takes minutes)")
    ap.add_argument("--max-gib", type=float, default=None,
                    help="skip the naive variant when its peak estimate exceeds this (default: 60%% of "
                         "MemAvailable on CPU, the free device memory on CUDA)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--entropy-metric-only", action="store_true",
                    help="loss of logp only; the entropy is computed and kept as a metric")
    ap.add_argument("--generic", action="store_true",
                    help="also time the chunked call's generic path (autograd on each recomputed chunk, "
                         "odd dtype mixes take; a bf16 head took it before its fused path) as a third variant")
    ap.add_argument("--worker", choices=("naive", "chunked", "generic"), help=argparse.SUPPRESS)
    ap.add_argument("--worker-out", help=argparse.SUPPRESS)
    ap.add_argument("--worker-tensors", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        worker(args)
        return 0

    import torch

    console = make_console()
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.reps = args.reps or (3 if args.device == "cuda" and not args.quick else 2)
    cpu = args.device == "cpu"
    avail = mem_available()
    budget = int(args.max_gib * GiB) if args.max_gib else (int(0.6 * avail) if cpu else None)
    why = choose_size(args, budget)
    n = args.rows * args.tokens
    est_naive = naive_estimate(n, args.vocab, args.hidden, args.dtype)
    est_chunked = chunked_estimate(n, args.chunk_tokens, args.vocab, args.hidden, args.dtype)
    console.print(f"{args.device}, {args.dtype} hidden states and head, float32 logits; torch {torch.__version__}; "
                  f"MemAvailable {avail / GiB:.1f} GiB; load {os.getloadavg()[0]:.2f}")
    console.print(f"size: {args.rows} rows x {args.tokens} tokens = {n} positions, vocab {args.vocab}, hidden "
                  f"{args.hidden}, chunk_tokens {args.chunk_tokens} -- {why}")
    console.print(f"peak estimates: naive {est_naive / GiB:.2f} GiB, chunked {est_chunked / GiB:.2f} GiB"
                  + (f"; naive budget {budget / GiB:.1f} GiB" if budget else ""))

    naive_skip = None
    if budget is not None and est_naive > budget:
        naive_skip = (f"naive peak estimate {est_naive / GiB:.1f} GiB > budget {budget / GiB:.1f} GiB "
                      f"({'--max-gib' if args.max_gib else '60% of MemAvailable'})")
        console.print(f"[yellow]skipping naive: {naive_skip}[/]")

    with tempfile.TemporaryDirectory(prefix="dapo-flow-logprob-mem-") as tmp, LoadSampler() as load:
        res = {}
        if naive_skip is None:
            res["naive"] = run_worker("naive", args, Path(tmp), console)
            naive_skip = res["naive"].get("skipped")
            if naive_skip:
                console.print(f"[yellow]naive skipped: {naive_skip}[/]")
        res["chunked"] = run_worker("chunked", args, Path(tmp), console)
        if args.generic:
            res["generic"] = run_worker("generic", args, Path(tmp), console)
        if res["chunked"].get("skipped"):
            raise SystemExit(f"chunked skipped: {res['chunked']['skipped']}")
        diffs = compare(res["naive"], res["chunked"]) if not naive_skip else None

    from rich.table import Table

    logits_bytes = n * args.vocab * 4
    t = Table(title=f"token logprobs + entropy, forward + backward: {args.rows} x {args.tokens} positions, "
                    f"vocab {args.vocab}, hidden {args.hidden}, {args.dtype}, {args.device}")
    for col in ("variant", "peak MiB", "x logits", "forward s", "backward s", "total s (median)", "min-max"):
        t.add_column(col, justify="right")
    for name in ("naive", "chunked", "generic"):
        if name == "generic" and not args.generic:
            continue
        r = res.get(name)
        if r is None or r.get("skipped"):
            t.add_row(name, "skipped", "", "", "", "", "")
            continue
        t.add_row(name if name == "naive" else f"{name} ({args.chunk_tokens})", f"{r['peak_bytes'] / 2**20:,.0f}",
                  f"{r['peak_bytes'] / logits_bytes:.2f}", f"{r['forward_s']:.3f}", f"{r['backward_s']:.3f}",
                  f"{r['seconds']:.3f}", f"{r['seconds_min']:.3f}-{r['seconds_max']:.3f}")
    console.print(t)
    console.print(f"[dim]x logits: peak / the float32 (positions, vocab) logits, {logits_bytes / 2**20:,.0f} MiB; "
                  f"peak = memory added by one call over its inputs (outputs and gradients included), largest of "
                  f"{1 + args.reps} calls, fresh process per variant[/]")

    ch = res["chunked"]
    nv = res.get("naive") if not naive_skip else None
    peak_ratio = ch["peak_bytes"] / nv["peak_bytes"] if nv else None
    time_ratio = ch["seconds"] / nv["seconds"] if nv else None
    max_diff = max(d["max_abs_diff"] for d in diffs.values()) if diffs else None
    if nv:
        met_p, met_t = peak_ratio <= TARGET_PEAK_RATIO, time_ratio <= TARGET_TIME_RATIO
        console.print(f"peak chunked/naive {peak_ratio:.3f} (target <= {TARGET_PEAK_RATIO}): "
                      f"{'met' if met_p else 'NOT met'}")
        console.print(f"time chunked/naive {time_ratio:.3f} (target <= {TARGET_TIME_RATIO}): "
                      f"{'met' if met_t else 'NOT met'}  (forward {ch['forward_s'] / nv['forward_s']:.2f}x, "
                      f"backward {ch['backward_s'] / nv['backward_s']:.2f}x)")
        if args.generic:
            gen = res["generic"]
            console.print(f"generic path (autograd per chunk): peak {gen['peak_bytes'] / nv['peak_bytes']:.3f} "
                          f"of naive, time {gen['seconds'] / nv['seconds']:.3f} of naive; the fused path takes "
                          f"{ch['seconds'] / gen['seconds']:.3f} of its time")
        console.print("max |naive - chunked|: " + ", ".join(
            f"{k} {d['max_abs_diff']:.2e} (max |value| {d['max_abs']:.2e})" for k, d in diffs.items()))
    else:
        console.print(f"[yellow]no ratios: naive skipped ({naive_skip}); chunked peak "
                      f"{ch['peak_bytes'] / 2**20:,.0f} MiB, {ch['seconds']:.3f} s[/]")
    malloc = " ".join(f"{k}={v}" for k, v in os.environ.items() if k.startswith("MALLOC_"))
    console.print(f"[dim]load: {fmt(load.mean, '.2f')} (1-min load average during the run); torch threads "
                  f"{ch['threads']}{'; ' + malloc if malloc else ''}[/]")

    payload = {
        "naive_peak_bytes": nv["peak_bytes"] if nv else None,
        "chunked_peak_bytes": ch["peak_bytes"],
        "peak_ratio": peak_ratio,
        "time_ratio": time_ratio,
        "naive_seconds": nv["seconds"] if nv else None,
        "chunked_seconds": ch["seconds"],
        "max_abs_diff": max_diff,
        "diffs": diffs,
        "rows": args.rows, "tokens": args.tokens, "positions": n, "vocab": args.vocab, "hidden": args.hidden,
        "chunk_tokens": args.chunk_tokens, "size": f"{args.rows}x{args.tokens}", "size_reason": why,
        "dtype": args.dtype, "logits_dtype": "float32", "device": args.device,
        "entropy_in_loss": not args.entropy_metric_only,
        "targets": {"peak_ratio_max": TARGET_PEAK_RATIO, "time_ratio_max": TARGET_TIME_RATIO,
                    "peak_met": peak_ratio <= TARGET_PEAK_RATIO if nv else None,
                    "time_met": time_ratio <= TARGET_TIME_RATIO if nv else None},
        "naive_skipped": naive_skip,
        "estimates": {"naive_peak_bytes": est_naive, "chunked_peak_bytes": est_chunked, "naive_budget_bytes": budget},
        "naive": {k: v for k, v in nv.items() if k != "tensors"} if nv else None,
        "chunked": {k: v for k, v in ch.items() if k != "tensors"},
        "generic": {k: v for k, v in res["generic"].items() if k != "tensors"} if args.generic else None,
        "generic_time_ratio": res["generic"]["seconds"] / nv["seconds"] if args.generic and nv else None,
        "quick": args.quick, "reps": args.reps, "load_avg": load.mean, "mem_available_bytes": avail,
        "torch": torch.__version__,
        "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
    }
    write_json(args.json, payload, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
