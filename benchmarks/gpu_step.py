"""One DAPO step's phases on a GPU: dapo-flow against the raw floor at the same shapes, one run.

What it times, on a random-init Qwen2 built here from a config (``_common.random_qwen2``): 24
layers, hidden 896, 14 query / 2 KV heads (head_dim 64), intermediate 4864, tied embeddings,
0.36B parameters, vocabulary 4160 with builtin:tiny-chat's tokenizer (byte-level BPE trained as
``dapo_flow.recipes.tiny_chat`` trains it, ChatML, ``<|im_end|>`` as EOS); prompts: the
first ``prompts`` of builtin:chain's train split in the chat template. On CUDA the policy trains as
`train.mixed_precision: bf16` does (float32 master weights, every forward under bf16 autocast);
on CPU in float32.

- rollout: dapo-flow's hf sampler, ``HFPolicy.generate`` (n samples per prompt, temperature 1,
  ``max_tokens``); floor: Hugging Face ``model.generate(do_sample=True, top_k=0, top_p=1.0,
  num_return_sequences=n, max_new_tokens=max_tokens)`` on the same left-padded prompts, in the
  same precision. Random weights sample near-uniformly: almost every response runs to max_tokens
  (the tokens each side generated are reported).
- logprob: the `logprob` operator (recompute, entropy on, 64 rows a pass) on the rollout's rows;
  floor: no-grad forwards of 64 rows, ``log_softmax(logits).gather`` at the response positions.
- update: the `update` operator (one optimizer step of AdamW over the batch in micro-batches of
  ``micro_batch`` rows, token-mean clipped surrogate, grad-norm clip 1.0); floor: the same rows,
  the same micro-batches: forward (``logits_to_keep``: the response positions), log_softmax,
  gather, ``-(exp(logp - old) * adv * mask).sum() / tokens``, backward; then grad-norm clip and
  ``AdamW.step``. Each side's first step is timed apart (it allocates AdamW's state and warms
  the kernels: ``update_first_s``), then ``--reps`` steps.

Each side's rollout and logprob phases run once on 2 prompts first (warm-up, untimed); each
side's first full-size rollout is timed apart (``rollout_first_s``, ``generate_first_s``: on
CUDA it pays for whatever the attention backend builds per shape, e.g. cuDNN's plans, which
dapo-flow's policy turns off: ``dapo_flow.models.devices.prepare_device``); every phase is then
timed ``--reps`` times (1; 3 with ``--quick``), the median reported: each side at its steady
state, the floor on torch's default attention backends. The
dapo-flow side runs first, then its model and optimizer are freed and the floor loads the same
directory afresh, so each side's peak is its own: ``torch.cuda.max_memory_allocated`` over the
phase (reset before it), the model's weights, gradients and optimizer state included. Seconds
are wall time, CUDA synchronised.

It also runs ``benchmarks/logprob_memory.py`` (its naive and chunked workers, bf16 hidden states
and head: the chunked path a bf16 head or autocast takes) before loading anything: on CUDA at
its target size (16 x 1024 positions, vocab 151936) with the tokens per row halved until the naive call's
estimated peak fits 80% of the free device memory; the chunked / naive time is reported.

``memory_estimates``: what dapo-flow's memory estimate (`explain`, the fit check) says the update
and rollout take at these shapes, worst-case rows, and estimate / measured peak on CUDA.

Targets (the JSON's ``targets``): update <= 1.1x the floor; rollout <= 0.2x HF ``generate``
(a sampler with no per-token host sync); bf16 chunked logprobs <= 1.2x naive time; memory
estimates within 15% of the peaks.

Run: python benchmarks/gpu_step.py [--quick] [--json PATH] [--workdir DIR] [--device cpu|cuda]
     [--prompts P] [--n N] [--max-tokens T] [--micro-batch M] [--reps R] [--no-logprob-bench]
``--quick``: 2 layers, hidden 64, 4 / 2 heads, intermediate 128, 4 prompts x 4 x 16 tokens,
micro-batch 4, logprob_memory's --quick in bf16 at vocab 4160 and 4 x 32 positions: under a
minute on a CPU (a smoke run; its ratios say little about a GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from _common import LoadSampler, fmt, make_console, random_qwen2, scratch_dir, write_json

FULL = dict(shape=dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       intermediate_size=4864),
            prompts=16, n=8, max_tokens=256, micro_batch=16, reps=1)
QUICK = dict(shape=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=128),
             prompts=4, n=4, max_tokens=16, micro_batch=4, reps=3)
CONTEXT = 512  # max_position_embeddings: the prompts plus max_tokens fit
LOGPROB_ROWS = 64  # rows per no-grad pass, both sides (the logprob operator's default)
LR = 1e-6
TARGETS = {"update_ratio_max": 1.1, "rollout_ratio_max": 0.2, "chunked_logprob_time_ratio_max": 1.2,
           "memory_estimate_within": 0.15}
LOGPROB_BENCH_FREE_FRACTION = 0.8
VOCAB = 4160  # builtin:tiny-chat's padded vocabulary (dapo_flow.recipes.tiny_chat.RECIPE.padded_vocab_size)


# ------------------------------------------------------------------------------ timing


def timed(fn: Callable[[], Any], device, reps: int = 1) -> tuple[Any, float, int | None]:
    """``fn`` called ``reps`` times: (the last result, the median seconds, the peak bytes
    allocated on CUDA over the calls; None on CPU)."""
    import torch

    cuda = device.type == "cuda"
    seconds = []
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(reps):
        start = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return out, statistics.median(seconds), torch.cuda.max_memory_allocated() if cuda else None


def free_device_memory(device) -> None:
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------ model and prompts


def chat_tokenizer():
    """builtin:tiny-chat's tokenizer, trained as its build trains it (seconds)."""
    from dapo_flow.data.chain_task import ChainTask
    from dapo_flow.recipes import tiny_chat
    from dapo_flow.recipes.chat_tokenizer import train_chat_tokenizer

    return train_chat_tokenizer(tiny_chat.corpus(ChainTask()), vocab_size=tiny_chat.RECIPE.vocab_size,
                                model_max_length=CONTEXT)


def chain_prompts(tokenizer, count: int) -> list[list[int]]:
    from dapo_flow.data.chain_task import ChainTask
    from dapo_flow.recipes.tiny_chat import chat_prompt_ids

    return chat_prompt_ids(tokenizer, [p.prompt for p in ChainTask().problems("train")[:count]])


# ------------------------------------------------------------------------------ dapo-flow's phases


def dapo_flow_phases(model_dir: Path, prompts: list[list[int]], args, device, precision: str | None
                     ) -> tuple[dict, dict, list[list[float]], Any]:
    """rollout (HFPolicy.generate), logprob and update operators: their seconds and peaks; and
    the batch they made, for the floor's same shapes (the packed rows as host tensors, the old
    logprobs, the advantages)."""
    from types import SimpleNamespace

    import numpy as np
    import pyarrow as pa

    from dapo_flow.core import columns as C
    from dapo_flow.core.contract import OpContext
    from dapo_flow.graph.spec import ModelSpec
    from dapo_flow.models.hf import HFPolicy
    from dapo_flow.models.sampling import SamplingConfig
    from dapo_flow.operators.logprob import Logprob
    from dapo_flow.operators.logprob import Params as LogprobParams
    from dapo_flow.operators.update import Params as UpdateParams
    from dapo_flow.operators.update import Update

    policy = HFPolicy(model_dir, device=str(device), trainable=True, mixed_precision=precision)
    model = SimpleNamespace(policy=policy, spec=ModelSpec(path=str(model_dir), train={"mixed_precision": precision}))
    sampling = SamplingConfig(n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=0)
    policy.generate(prompts[:2], SamplingConfig(n=2, max_tokens=4, seed=1))  # warm-up
    _, rollout_first_s, _ = timed(lambda: policy.generate(prompts, sampling), device)
    rollouts, rollout_s, rollout_peak = timed(lambda: policy.generate(prompts, sampling), device, args.reps)

    rows = [p for p in prompts for _ in range(args.n)]  # a prompt's samples are contiguous
    advantages = np.random.default_rng(0).normal(size=len(rows)).astype(np.float32)
    table = pa.table({C.PROMPT_IDS: pa.array(rows, C.TOKENS), C.RESPONSE_IDS: pa.array(rollouts.response_ids, C.TOKENS),
                      C.ADVANTAGE: pa.array(advantages)})
    logprob = Logprob(LogprobParams(micro_batch_size=LOGPROB_ROWS), OpContext("old_logp", model=model))
    logprob(table.slice(0, 2))  # warm-up
    scored, logprob_s, logprob_peak = timed(lambda: logprob(table), device, args.reps)

    update = Update(UpdateParams(lr=LR, warmup_steps=0, mini_batches=1, micro_batch_size=args.micro_batch),
                    OpContext("train", model=model))
    _, update_first_s, _ = timed(lambda: update(scored), device)
    metrics, update_s, update_peak = timed(lambda: update(scored), device, args.reps)

    packed = policy.pack(rows, rollouts.response_ids)
    old = scored.column(C.OLD_LOGP).to_pylist()
    result = {
        "rollout_s": rollout_s, "rollout_first_s": rollout_first_s, "logprob_s": logprob_s, "update_s": update_s,
        "update_first_s": update_first_s,
        "rollout_peak_bytes": rollout_peak, "logprob_peak_bytes": logprob_peak, "update_peak_bytes": update_peak,
        "response_tokens": int(sum(len(r) for r in rollouts.response_ids)),
        "response_max": max(map(len, rollouts.response_ids)),
        "truncated_frac": float(np.mean(rollouts.truncated)),
        "update_metrics": {k: v for k, v in metrics.to_pylist()[0].items() if isinstance(v, float)},
    }
    del policy, model, logprob, update, scored
    return result, packed, old, advantages


def memory_estimates(model_dir: Path, prompts: list[list[int]], ours: dict, args, precision: str | None,
                     on_gpu: bool) -> dict:
    """dapo-flow's memory estimates (``dapo_flow.graph.memory``, what `explain` and the fit check
    print) of the rollout and update phases at this run's shapes, worst-case rows as the fit check
    takes them (every row the longest prompt plus the longest response), beside the measured
    peaks. ``*_ratio``: estimate / measured, without the estimate's fixed CUDA-context term
    (``torch.cuda.max_memory_allocated`` leaves the context out); None on CPU (no peak measured)."""
    from dapo_flow.graph.memory import GPU_OVERHEAD_BYTES, ModelShape, estimate_rollout, estimate_training

    shape = ModelShape.from_config(json.loads((model_dir / "config.json").read_text()))
    width, response = max(map(len, prompts)), ours["response_max"]
    update = estimate_training(shape, micro_batch_tokens=args.micro_batch * (width + response),
                               response_tokens_per_micro_batch=args.micro_batch * response,
                               rows_per_micro_batch=args.micro_batch, mixed_precision=precision, on_gpu=on_gpu)
    rollout = estimate_rollout(shape, max_model_len=width + args.max_tokens, batch_rows=len(prompts) * args.n,
                               on_gpu=on_gpu, mixed_precision=precision)
    context = GPU_OVERHEAD_BYTES if on_gpu else 0
    out = {}
    for phase, budget in (("update", update), ("rollout", rollout)):
        measured = ours[f"{phase}_peak_bytes"]
        out[f"{phase}_bytes"] = budget.total
        out[f"{phase}_terms"] = {name: size for name, size, _ in budget.rows()}
        out[f"{phase}_ratio"] = (budget.total - context) / measured if measured else None
    return out


# ------------------------------------------------------------------------------ the raw floor


def floor_phases(model_dir: Path, prompts: list[list[int]], packed: dict, old: list[list[float]], advantages,
                 args, device, precision: str | None, tokenizer) -> dict:
    """The same three phases in plain transformers / torch."""
    import torch
    from transformers import AutoModelForCausalLM

    from dapo_flow.models.hf import hf_progress_bars_off

    if device.type == "cuda":  # torch's default attention backends, as a plain HF user runs them
        torch.backends.cuda.enable_cudnn_sdp(True)  # (dapo-flow's policy turned cuDNN's off)
    with hf_progress_bars_off():
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    model.eval()  # no dropout (as HFPolicy runs it); gradients flow all the same
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16"
                else contextlib.nullcontext())
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id

    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)

    def generate(rows: slice, max_new: int, n: int):
        with torch.inference_mode(), autocast:
            return model.generate(input_ids=ids[rows], attention_mask=mask[rows], do_sample=True, temperature=1.0,
                                  top_k=0, top_p=1.0, max_new_tokens=max_new, num_return_sequences=n,
                                  pad_token_id=pad, eos_token_id=eos)

    torch.manual_seed(0)
    generate(slice(0, 2), 4, 2)  # warm-up
    _, generate_first_s, _ = timed(lambda: generate(slice(None), args.max_tokens, args.n), device)
    out, generate_s, generate_peak = timed(lambda: generate(slice(None), args.max_tokens, args.n), device, args.reps)
    new = out[:, width:]
    ended = (new == eos).int().cumsum(1)
    response_tokens = int(((ended == 0) | ((ended == 1) & (new == eos))).sum())  # up to EOS, EOS included

    batch = {k: v.to(device) for k, v in packed.items()}
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    response, rmask = batch["response_ids"], batch["response_mask"]
    keep = response.shape[1] + 1
    num_rows = response.shape[0]

    def logprobs(rows: slice) -> torch.Tensor:
        logits = model(**{k: v[rows] for k, v in inputs.items()}, use_cache=False, logits_to_keep=keep).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1)
        return logp.gather(-1, response[rows].unsqueeze(-1)).squeeze(-1)

    def recompute() -> torch.Tensor:
        with torch.inference_mode(), autocast:
            return torch.cat([logprobs(slice(i, i + LOGPROB_ROWS)) for i in range(0, num_rows, LOGPROB_ROWS)])

    with torch.inference_mode(), autocast:
        logprobs(slice(0, 2))  # warm-up
    _, logprob_s, logprob_peak = timed(recompute, device, args.reps)

    old_logp = torch.zeros_like(rmask, dtype=torch.float32)
    for i, values in enumerate(old):
        old_logp[i, :len(values)] = torch.tensor(values)
    adv = torch.from_numpy(advantages).to(device)
    tokens = rmask.sum()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        for i in range(0, num_rows, args.micro_batch):
            rows = slice(i, i + args.micro_batch)
            with autocast:
                logp = logprobs(rows)
            ratio = torch.exp(logp - old_logp[rows])
            loss = -(ratio * adv[rows, None] * rmask[rows]).sum() / tokens
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return norm

    _, update_first_s, _ = timed(step, device)
    _, update_s, update_peak = timed(step, device, args.reps)
    del model, optimizer
    return {"generate_s": generate_s, "generate_first_s": generate_first_s, "logprob_s": logprob_s,
            "update_s": update_s, "update_first_s": update_first_s,
            "generate_peak_bytes": generate_peak, "logprob_peak_bytes": logprob_peak, "update_peak_bytes": update_peak,
            "response_tokens": response_tokens}


# ------------------------------------------------------------------------------ chunked logprobs


def logprob_bench(args, device, tmp: Path, console) -> dict:
    """benchmarks/logprob_memory.py, bf16, naive and chunked: its JSON."""
    import logprob_memory

    out = tmp / "logprob_memory.json"
    argv = ["--json", str(out), "--dtype", "bfloat16", "--device", device.type]
    if args.quick:  # bf16 matmuls are slow on a CPU: a head of tiny-chat's vocabulary, 4 x 32 positions
        argv += ["--quick", "--vocab", str(VOCAB), "--tokens", "32"]
    elif device.type == "cuda":
        import torch

        free = torch.cuda.mem_get_info()[0]
        tokens = logprob_memory.ISSUE_TOKENS
        while tokens > 1 and logprob_memory.naive_estimate(
                logprob_memory.ISSUE_ROWS * tokens, logprob_memory.FULL["vocab"], logprob_memory.FULL["hidden"],
                "bfloat16") > LOGPROB_BENCH_FREE_FRACTION * free:
            tokens //= 2
        argv += ["--rows", str(logprob_memory.ISSUE_ROWS), "--tokens", str(tokens)]
    console.print(f"[dim]benchmarks/logprob_memory.py {' '.join(argv[2:])}[/]")
    logprob_memory.main(argv)
    return json.loads(out.read_text())


# ------------------------------------------------------------------------------ main


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny shape, 4 x 4 x 16 tokens: seconds on a CPU")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the results to PATH")
    ap.add_argument("--workdir", default=None, help="keep the model directory here (default: a temp dir)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    ap.add_argument("--prompts", type=int, default=None, help="prompts (default 16; --quick 4)")
    ap.add_argument("--n", type=int, default=None, help="samples per prompt (default 8; --quick 4)")
    ap.add_argument("--max-tokens", type=int, default=None, help="response tokens (default 256; --quick 16)")
    ap.add_argument("--micro-batch", type=int, default=None, help="rows per update pass (default 16; --quick 4)")
    ap.add_argument("--reps", type=int, default=None,
                    help="timed calls per phase, the median reported (default 1; --quick 3: a CPU box is noisy)")
    ap.add_argument("--no-logprob-bench", action="store_true", help="skip benchmarks/logprob_memory.py")
    args = ap.parse_args(argv)

    import torch

    from dapo_flow.models.hf import hf_progress_bars_off

    console = make_console()
    setting = QUICK if args.quick else FULL
    for key in ("prompts", "n", "max_tokens", "micro_batch", "reps"):
        if getattr(args, key) is None:
            setattr(args, key, setting[key])
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    precision = "bf16" if device.type == "cuda" else None
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    console.print(f"{device.type}{f' ({gpu})' if gpu else ''}, torch {torch.__version__}, "
                  f"{'bf16 autocast, float32 master weights' if precision else 'float32'}; "
                  f"{args.prompts} prompts x {args.n} samples x {args.max_tokens} tokens, micro-batch {args.micro_batch}")

    with scratch_dir(args.workdir, console) as work, LoadSampler() as load:
        lp = None
        if not args.no_logprob_bench:
            lp = logprob_bench(args, device, Path(tempfile.mkdtemp(dir=work)), console)
        tokenizer = chat_tokenizer()
        shape = {**setting["shape"], "vocab_size": VOCAB}
        model_dir = work / "model"
        with hf_progress_bars_off():
            info = random_qwen2(model_dir, shape, tokenizer, max_positions=CONTEXT)
        prompts = chain_prompts(tokenizer, args.prompts)
        console.print(f"model: {info['num_parameters'] / 1e6:.1f}M parameters; prompts {min(map(len, prompts))}-"
                      f"{max(map(len, prompts))} tokens")
        ours, packed, old, advantages = dapo_flow_phases(model_dir, prompts, args, device, precision)
        estimates = memory_estimates(model_dir, prompts, ours, args, precision, device.type == "cuda")
        free_device_memory(device)
        floor = floor_phases(model_dir, prompts, packed, old, advantages, args, device, precision, tokenizer)
        free_device_memory(device)

    from rich.table import Table

    ratios = {"rollout": ratio(ours["rollout_s"], floor["generate_s"]),
              "logprob": ratio(ours["logprob_s"], floor["logprob_s"]),
              "update": ratio(ours["update_s"], floor["update_s"]),
              "chunked_logprob_time": lp["time_ratio"] if lp else None}
    t = Table(title=f"one DAPO step's phases: dapo-flow vs the raw floor ({device.type}{f', {gpu}' if gpu else ''})")
    for col in ("phase", "dapo-flow s", "floor s", "ratio", "dapo-flow peak GiB", "floor peak GiB"):
        t.add_column(col, justify="right")
    gib = lambda b: fmt(b / 2**30 if b is not None else None, ".2f")  # noqa: E731
    for phase, floor_key in (("rollout", "generate"), ("logprob", "logprob"), ("update", "update")):
        t.add_row(phase, f"{ours[phase + '_s']:.3f}", f"{floor[floor_key + '_s']:.3f}", fmt(ratios[phase]),
                  gib(ours[phase + "_peak_bytes"]), gib(floor[floor_key + "_peak_bytes"]))
    console.print(t)
    met = {"update_met": ratios["update"] <= TARGETS["update_ratio_max"],
           "rollout_met": ratios["rollout"] <= TARGETS["rollout_ratio_max"],
           "chunked_logprob_met": (ratios["chunked_logprob_time"] <= TARGETS["chunked_logprob_time_ratio_max"]
                                   if ratios["chunked_logprob_time"] is not None else None),
           "memory_estimate_met": (all(abs(estimates[f"{p}_ratio"] - 1) <= TARGETS["memory_estimate_within"]
                                       for p in ("update", "rollout"))
                                   if estimates["update_ratio"] is not None else None)}
    console.print(f"update {fmt(ratios['update'])}x the floor (target <= {TARGETS['update_ratio_max']}); rollout "
                  f"{fmt(ratios['rollout'])}x HF generate (target <= {TARGETS['rollout_ratio_max']}); bf16 chunked "
                  f"logprobs {fmt(ratios['chunked_logprob_time'])}x naive time (target <= "
                  f"{TARGETS['chunked_logprob_time_ratio_max']}); response tokens {ours['response_tokens']} / "
                  f"{floor['response_tokens']}; load {fmt(load.mean, '.2f')}")
    if estimates["update_ratio"] is not None:
        console.print(f"memory estimates / measured peaks (CUDA context left out): update "
                      f"{fmt(estimates['update_ratio'])} ({gib(estimates['update_bytes'])} GiB with it), rollout "
                      f"{fmt(estimates['rollout_ratio'])} ({gib(estimates['rollout_bytes'])} GiB); target within "
                      f"{TARGETS['memory_estimate_within']:.0%}")
    console.print(f"first full-size rollout: dapo-flow {fmt(ours['rollout_first_s'])} s, HF generate "
                  f"{fmt(floor['generate_first_s'])} s; first update: dapo-flow {fmt(ours['update_first_s'])} s, "
                  f"floor {fmt(floor['update_first_s'])} s")

    payload = {
        "device": device.type, "gpu": gpu, "torch": torch.__version__,
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "precision": "bf16 autocast, float32 master weights" if precision else "float32",
        "model": info, "prompts": args.prompts, "n": args.n, "max_tokens": args.max_tokens,
        "micro_batch": args.micro_batch, "reps": args.reps, "prompt_tokens": [len(p) for p in prompts],
        "dapo_flow": {**ours, "step_s": ours["rollout_s"] + ours["logprob_s"] + ours["update_s"]},
        "floor": {**floor, "step_s": floor["generate_s"] + floor["logprob_s"] + floor["update_s"]},
        "ratios": ratios, "targets": {**TARGETS, **met}, "memory_estimates": estimates,
        "logprob_bench": None if lp is None else {
            k: lp.get(k) for k in ("time_ratio", "peak_ratio", "naive_seconds", "chunked_seconds", "naive_peak_bytes",
                                   "chunked_peak_bytes", "rows", "tokens", "vocab", "hidden", "chunk_tokens", "dtype",
                                   "device", "naive_skipped", "max_abs_diff")},
        "quick": args.quick, "load_avg": load.mean, "cpus": os.cpu_count(),
    }
    write_json(args.json, payload, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
