"""LoRA against full fine-tuning: one update step's time and memory, in one run.

A random-init Qwen2 (``_common.random_qwen2``; on CPU 8 layers, hidden 512, 8 query / 2 KV
heads, intermediate 1536, vocabulary 8192: 28M parameters, 16 rows of 64 + 192 tokens; on CUDA
gpu_step.py's 24 layers, hidden 896, 14 / 2 heads, intermediate 4864, vocabulary 8192: 0.37B, 64
rows of 64 + 448 tokens in micro-batches of 16, bf16 autocast over float32 weights) trained by dapo-flow's `update`
operator on a fixed batch of random tokens (``--rows`` rows of ``--prompt`` + ``--response``
tokens, micro-batches of ``--micro-batch`` rows, one AdamW step per call, old logprobs from the
`logprob` operator), once with every weight trained and once per ``--ranks`` with
``train.lora`` (rank r, alpha 2r, every linear of the decoder). Each variant runs in a fresh
process, so each peak is its own: on CPU the process's peak resident memory above what it held
once the model was loaded (``VmHWM`` after ``clear_refs``), on CUDA
``torch.cuda.max_memory_allocated`` over the steps; both include the first step, which
allocates the gradients and AdamW's state. Times: the first step apart, then the median of
``--reps`` steps (wall seconds, CUDA synchronised).

JSON: each variant's ``trained_params``, ``step_s``, ``first_step_s``, ``peak_bytes``, and
``ratios`` (variant / full: step time and peak), ``estimate_ratio`` (dapo-flow's memory estimate
for the step / the measured peak; on CUDA less the estimate's fixed CUDA-context term, which
``max_memory_allocated`` does not see).

Run: python benchmarks/lora.py [--quick] [--json PATH] [--device cpu|cuda] [--ranks 8,32]
``--quick``: 2 layers, hidden 128, 4 rows of 16 + 48 tokens, 2 reps: seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import fmt, make_console, proc_status, random_qwen2, run_variant_process, write_json  # noqa: E402

SHAPE = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
             intermediate_size=1536, vocab_size=8192)
# on CUDA: gpu_step.py's 0.36B Qwen2 shape (its vocabulary aside)
GPU_SHAPE = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=8192)
QUICK_SHAPE = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=256, vocab_size=2048)


def run_variant(cfg: dict) -> dict:
    """One variant in this process: build the policy, make the batch, time the update steps."""
    import gc
    import random

    import numpy as np
    import pyarrow as pa
    import torch

    from dapo_flow.core import columns as C
    from dapo_flow.core.contract import OpContext
    from dapo_flow.graph.spec import ModelSpec
    from dapo_flow.models.hf import HFPolicy
    from dapo_flow.operators.logprob import Logprob
    from dapo_flow.operators.logprob import Params as LogprobParams
    from dapo_flow.operators.update import Params as UpdateParams
    from dapo_flow.operators.update import Update

    torch.set_num_threads(cfg["threads"])
    device = torch.device(cfg["device"])
    rank = cfg["rank"]
    spec = ModelSpec(path=cfg["model"], train={"lora": {"rank": rank, "alpha": 2 * rank}} if rank else {})
    cpu = device.type == "cpu"
    # CUDA: as `dtype: bfloat16, train.mixed_precision: bf16` trains: full fine-tuning holds
    # float32 master weights, LoRA a bf16 base under float32 adapters (resources.trained_dtype)
    policy = HFPolicy(cfg["model"], trainable=True, device=str(device), lora=spec.train.lora,
                      dtype="bfloat16" if rank and not cpu else "float32", mixed_precision=None if cpu else "bf16")
    rng = random.Random(0)
    vocab = cfg["vocab"]
    prompts = [[rng.randrange(3, vocab) for _ in range(cfg["prompt"])] for _ in range(cfg["rows"])]
    responses = [[rng.randrange(3, vocab) for _ in range(cfg["response"])] for _ in range(cfg["rows"])]
    adv = np.asarray([1.0 if i % 2 else -1.0 for i in range(cfg["rows"])], dtype=np.float32)
    batch = pa.table({C.PROMPT_IDS: pa.array(prompts, C.TOKENS), C.RESPONSE_IDS: pa.array(responses, C.TOKENS),
                      C.ADVANTAGE: pa.array(adv)})
    logprob = Logprob(LogprobParams(with_entropy=False), OpContext("old_logp", model=_Model(policy, spec)))
    batch = logprob(batch)
    update = Update(UpdateParams(lr=1e-6, warmup_steps=0, mini_batches=1, micro_batch_size=cfg["micro_batch"]),
                    OpContext("train", model=_Model(policy, spec)))
    gc.collect()

    def sync():
        if not cpu:
            torch.cuda.synchronize()

    if cpu:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS: the peak from here on
        baseline = proc_status("VmRSS")
    else:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    update(batch)
    sync()
    first = time.perf_counter() - start
    seconds = []
    for _ in range(cfg["reps"]):
        start = time.perf_counter()
        update(batch)
        sync()
        seconds.append(time.perf_counter() - start)
    weights = sum(p.numel() * p.element_size() for p in policy.model.parameters())
    # the step's peak with the weights: CPU, the resident growth over the loaded process plus the
    # weights; CUDA, all that was allocated (nothing but the model lives on the device before)
    peak = proc_status("VmHWM") - baseline + weights if cpu else torch.cuda.max_memory_allocated()
    return {"rank": rank, "trained_params": sum(p.numel() for p in policy.model.parameters() if p.requires_grad),
            "step_s": statistics.median(seconds), "first_step_s": first, "peak_bytes": peak,
            "weights_bytes": weights}


class _Model:
    """What an operator's context holds of a model (its policy and spec)."""

    def __init__(self, policy, spec):
        self.policy, self.spec = policy, spec


def estimate(cfg: dict, shape: dict, rank: int) -> int:
    """dapo-flow's estimate of the step's device bytes (what `explain` prints) at these shapes."""
    from dapo_flow.graph.memory import GPU_OVERHEAD_BYTES, ModelShape, estimate_training, lora_param_count

    model = ModelShape.from_config({**shape, "tie_word_embeddings": True})
    rows = cfg["micro_batch"]
    budget = estimate_training(
        model, micro_batch_tokens=rows * (cfg["prompt"] + cfg["response"]),
        response_tokens_per_micro_batch=rows * cfg["response"], rows_per_micro_batch=rows, padded=False,
        on_gpu=cfg["device"] != "cpu", mixed_precision=None if cfg["device"] == "cpu" else "bf16",
        dtype="bfloat16" if rank and cfg["device"] != "cpu" else "float32",
        lora_params=lora_param_count(model, rank, "all-linear") if rank else 0)
    return budget.total - (GPU_OVERHEAD_BYTES if cfg["device"] != "cpu" else 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--ranks", default="8,32", help="LoRA ranks to run beside full fine-tuning")
    ap.add_argument("--rows", type=int)
    ap.add_argument("--prompt", type=int)
    ap.add_argument("--response", type=int)
    ap.add_argument("--micro-batch", type=int)
    ap.add_argument("--reps", type=int)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per variant (CPU)")
    ap.add_argument("--variant", help=argparse.SUPPRESS)  # internal: run one variant, print its JSON
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(run_variant(json.loads(args.variant))))
        return
    console = make_console()
    quick = args.quick
    gpu = args.device == "cuda" and not quick
    shape = QUICK_SHAPE if quick else GPU_SHAPE if gpu else SHAPE
    cfg = dict(device=args.device, threads=args.threads, vocab=shape["vocab_size"],
               rows=args.rows or (4 if quick else 64 if gpu else 16), prompt=args.prompt or (16 if quick else 64),
               response=args.response or (48 if quick else 448 if gpu else 192),
               micro_batch=args.micro_batch or (4 if quick else 16 if gpu else 8), reps=args.reps or (2 if quick else 3))
    ranks = [0] + [int(r) for r in args.ranks.split(",") if r]
    from dapo_flow.models.tokenizer import build_char_tokenizer

    results = []
    from dapo_flow.models.hf import hf_progress_bars_off

    with tempfile.TemporaryDirectory(prefix="dapo-flow-lora-") as tmp, hf_progress_bars_off():
        facts = random_qwen2(Path(tmp) / "model", shape, build_char_tokenizer())
        cfg["model"] = str(Path(tmp) / "model")
        console.print(f"model: Qwen2, {facts['num_parameters'] / 1e6:.1f}M parameters; {cfg['rows']} rows of "
                      f"{cfg['prompt']} + {cfg['response']} tokens, micro-batch {cfg['micro_batch']}, "
                      f"{args.device}, {cfg['reps']} reps")
        for rank in ranks:
            out = run_variant_process(__file__, {**cfg, "rank": rank}, threads=args.threads, console=console,
                                      what=f"variant rank {rank}")
            out["estimate_bytes"] = estimate(cfg, shape, rank)  # CUDA: less its fixed context term
            results.append(out)
            console.print(f"  {'full' if not rank else f'LoRA r{rank}'} done: {out['step_s']:.3f} s a step")
    full = results[0]
    for r in results:
        r["step_ratio"] = r["step_s"] / full["step_s"]
        r["peak_ratio"] = r["peak_bytes"] / full["peak_bytes"]
        r["estimate_ratio"] = r["estimate_bytes"] / r["peak_bytes"]
    from rich.table import Table

    table = Table(title=f"one update step: LoRA vs full fine-tuning ({args.device})")
    for col in ("variant", "trained params", "step s", "first step s", "peak MiB", "step / full",
                "peak / full", "estimate / peak"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row("full" if not r["rank"] else f"LoRA r{r['rank']}", f"{r['trained_params']:,}",
                      fmt(r["step_s"]), fmt(r["first_step_s"]), f"{r['peak_bytes'] / 2**20:,.1f}",
                      fmt(r["step_ratio"]), fmt(r["peak_ratio"]), fmt(r["estimate_ratio"]))
    console.print(table)
    console.print("peak: the step's memory with the model's weights (CPU: resident set; CUDA: allocated)")
    write_json(args.json, {"device": args.device, "model": facts, "settings": cfg, "variants": results,
                           "peak_ratio_lora": {f"r{r['rank']}": r["peak_ratio"] for r in results[1:]},
                           "step_ratio_lora": {f"r{r['rank']}": r["step_ratio"] for r in results[1:]}}, console)


if __name__ == "__main__":
    main()
