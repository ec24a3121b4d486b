"""Rollout generation: dapo-flow's `generate` stage against vLLM called directly, in tokens/s.

What it times: one generate call, P prompts x n samples x max_tokens, two ways, in one
process and one run, interleaved:

- dapo-flow: the rollout stage of a compiled graph (``placement: disaggregated``: the `generate`
  node alone in its own stage, built by ``runtime.setup.stage_setups`` as the executors build it),
  a ``StageWorker`` holding the engine of backend ``vllm`` (``BACKENDS["vllm"]``, a
  ``VLLMGenerator``), called as the executor calls it: ``worker.run_chain(["rollout"], prompts)``
  with the prompt table (prompt_id, prompt_text, prompt_ids, ground_truth, data_source) in and the
  sample table out. Included: per-prompt seeds, SamplingParams, vLLM, reading the tokens and
  sampled-token logprobs back, decoding the texts, building the Arrow table. Not included: the Ray
  actor round trip (benchmarks/step_overhead.py: 2-3 ms per call), which the worker runs the same.
- direct: ``vllm.LLM(...).generate(prompts, SamplingParams(n, temperature, top_p, top_k,
  max_tokens, logprobs=0))`` on the same token ids: what an RL rollout asks of vLLM (tokens, their
  logprobs, and the text, which vLLM detokenizes by default), vLLM's defaults otherwise (engine seed
  only, chunked prefill as the platform sets it). Engine arguments that size or shape the
  computation are dapo-flow's engine's: dtype, max_model_len, enforce_eager (eager on CPU, as
  dapo-flow runs it; ``--direct-compiled``: vLLM's default torch.compile instead), the in-process
  executor, the KV cache (VLLM_CPU_KVCACHE_SPACE).

Both engines live in this process (created before either generates, no weight syncs: the
``one_engine_per_process`` caveat of engines.py is about syncs after another engine generated),
with the same torch threads (``--threads``, default 1: what the rollout stage of a 2-CPU
cluster gets). Each side runs once untimed, then ``--reps`` rounds, each one call per side,
the order alternating (direct first, then dapo-flow first, ...), so a busy minute on the shared
box hits both. Reported: tokens/s per side (median over rounds; tokens = generated response
tokens, EOS included), ``ratio`` = dapo-flow / direct (target >= 0.9), the per-round ratios,
the mean 1-minute load average during the rounds, and where a dapo-flow call's time goes:
inside vLLM's ``LLM.generate`` (wrapped, for accounting only), the engine wrapper around it
(SamplingParams, reading tokens and logprobs back), the operator's table work (seeds, decode,
Arrow), and the worker (input assembly, ChainInfo).

Model: a random-init Qwen2 (``_common.random_qwen2``; hidden 512, 8 layers, 8 heads / 2 KV heads,
head_dim 64, intermediate 1376, tied embeddings, float32) with a byte-level BPE tokenizer built
like Qwen2's (``dapo_flow.recipes.chat_tokenizer``, trained in ~0.3 s on Python's bundled
documentation: 9,903 tokens, the vocabulary padded to a multiple of 64), so sampled ids decode to
real text. Prompts: the first ``prompt_tokens`` tokens of documentation topics, in the ChatML
template. Random weights sample near-uniformly, so almost every response runs to max_tokens.
``--quick``: hidden 256, 2 layers, 16 prompts x 8 x 16 tokens, 2 rounds. Both settings put more
prompt tokens into a call than one vLLM-CPU step takes (4096), which seeded requests could not
survive with chunked prefill (vllm_engine.py).

Run: python benchmarks/generation.py [--quick] [--json PATH] [--workdir DIR] [--reps R]
     [--threads N] [--prompts P] [--n N] [--max-tokens T] [--direct-compiled]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from _common import LoadSampler, fmt, make_console, random_qwen2, scratch_dir, write_json

FULL = dict(shape=dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                       intermediate_size=1376),
            prompts=16, n=8, max_tokens=128, prompt_tokens=48, reps=4)
QUICK = dict(shape=dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=688),
             prompts=16, n=8, max_tokens=16, prompt_tokens=48, reps=2)
TEMPERATURE, TOP_P, TOP_K = 1.0, 1.0, -1
CONTEXT = 512  # max_position_embeddings; the engine serves the prompt budget + max_tokens

GRAPH = """# benchmarks/generation.py: the generate node in a rollout stage of its own (disaggregated)
name: generation-bench
seed: 0
models:
  policy: {{path: {model}, dtype: float32, backend: vllm}}
data:
  train: {{source: "builtin:addition", split: train, max_prompt_tokens: {budget}}}
run: {{steps: 1, prompts_per_step: {prompts}, val_every: 0, checkpoint_every: 0}}
nodes:
  - {{id: rollout, op: generate, model: policy, inputs: [prompts],
      params: {{n: {n}, temperature: {temperature}, top_p: {top_p}, top_k: {top_k}, max_tokens: {max_tokens}}}}}
  - {{id: verify, op: score, inputs: [rollout], params: {{reward: "builtin:addition"}}}}
  - {{id: old_logp, op: logprob, model: policy, inputs: [verify]}}
  - {{id: adv, op: advantage, inputs: [old_logp]}}
  - {{id: train, op: update, model: policy, inputs: [adv], params: {{lr: 1.0e-5}}}}
placement: {{mode: disaggregated}}
"""


# ------------------------------------------------------------------------------ model and prompts

def build_tokenizer(max_length: int):
    """Byte-level BPE like Qwen2's, trained on Python's bundled documentation (~0.3 s)."""
    import pydoc_data.topics

    from dapo_flow.recipes.chat_tokenizer import train_chat_tokenizer

    return train_chat_tokenizer(list(pydoc_data.topics.topics.values()), vocab_size=32000,
                                model_max_length=max_length)


def prompt_table(tokenizer, count: int, tokens: int):
    """``count`` chat prompts, each the first ``tokens`` tokens of a documentation topic
    (topics in key order, long enough ones), as the `prompts` source gives them to a graph."""
    import pyarrow as pa
    import pydoc_data.topics

    from dapo_flow.core import columns as C

    texts, ids = [], []
    for key in sorted(pydoc_data.topics.topics):
        content = tokenizer(pydoc_data.topics.topics[key], add_special_tokens=False)["input_ids"]
        if len(content) < tokens:
            continue
        text = tokenizer.apply_chat_template([{"role": "user", "content": tokenizer.decode(content[:tokens])}],
                                             tokenize=False, add_generation_prompt=True)
        texts.append(text)
        ids.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        if len(texts) == count:
            break
    if len(texts) < count:
        raise SystemExit(f"only {len(texts)} documentation topics have {tokens} tokens; ask for fewer prompts")
    return pa.table({C.PROMPT_ID: [f"bench-{i}" for i in range(count)], C.PROMPT_TEXT: texts,
                     C.PROMPT_IDS: ids, C.GROUND_TRUTH: ["0"] * count, C.DATA_SOURCE: ["bench"] * count},
                    schema=C.prompt_schema())


# ------------------------------------------------------------------------------ the two sides

def rollout_worker(graph: Path, threads: int):
    """The rollout stage's StageWorker as the executors build it (its setup from the placed plan)."""
    from dapo_flow.graph.compiler import compile_graph
    from dapo_flow.graph.plan import Cluster
    from dapo_flow.runtime.setup import stage_setups
    from dapo_flow.runtime.worker import StageWorker

    placed = compile_graph(graph, Cluster(cpus=2))
    setup = next(s for s in stage_setups(placed).values() if [n.id for n in s.nodes] == ["rollout"])
    assert setup.generates == ("policy",) and not setup.trainable, setup
    return StageWorker(placed.plan.spec, replace(setup, num_threads=threads), seed=placed.plan.spec.seed)


class VLLMClock:
    """Seconds spent inside one ``LLM.generate`` method (wrapped on the instance, for accounting)."""

    def __init__(self, llm):
        self.seconds = 0.0
        inner = llm.generate

        def generate(*a, **k):
            start = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                self.seconds += time.perf_counter() - start

        llm.generate = generate

    def take(self) -> float:
        spent, self.seconds = self.seconds, 0.0
        return spent


def call_dapo(worker, table, clock: VLLMClock) -> dict:
    import numpy as np
    import pyarrow.compute as pc

    from dapo_flow.core import columns as C

    start = time.perf_counter()
    out, info = worker.run_chain(["rollout"], table)
    wall = time.perf_counter() - start
    (_, metrics, op_s), = info.report
    vllm_s = clock.take()
    tokens = int(pc.sum(out.column(C.RESPONSE_LEN)).as_py())
    logp = np.concatenate([np.asarray(r, dtype=np.float32) for r in out.column(C.ROLLOUT_LOGP).to_pylist()])
    assert out.num_rows == table.num_rows * worker.ops["rollout"].params.n, out.num_rows
    assert tokens == len(logp) and np.isfinite(logp).all() and (logp <= 0).all()
    return {"seconds": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "vllm_s": vllm_s, "engine_wrap_s": metrics["gen/seconds"] - vllm_s,
            "op_tables_s": op_s - metrics["gen/seconds"], "worker_s": wall - op_s}


def call_direct(llm, prompt_ids, params) -> dict:
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids], params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for r in outputs for c in r.outputs)
    assert sum(len(r.outputs) for r in outputs) == len(prompt_ids) * params.n
    return {"seconds": wall, "tokens": tokens, "tokens_per_s": tokens / wall}


def engine_facts(llm) -> dict:
    cfg = llm.llm_engine.vllm_config
    return {"enforce_eager": cfg.model_config.enforce_eager, "max_model_len": cfg.model_config.max_model_len,
            "enable_chunked_prefill": cfg.scheduler_config.enable_chunked_prefill,
            "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
            "max_num_seqs": cfg.scheduler_config.max_num_seqs,
            "logprobs_mode": str(cfg.model_config.logprobs_mode)}


# ------------------------------------------------------------------------------ main

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small model, 16 x 8 x 16 tokens, 2 rounds")
    ap.add_argument("--reps", type=int, help="timed rounds, one call per side each (default 4, quick 2)")
    ap.add_argument("--prompts", type=int, help="prompts per call (default 16)")
    ap.add_argument("--n", type=int, help="samples per prompt (default 8)")
    ap.add_argument("--max-tokens", type=int, help="response budget (default 128, quick 16)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of this process (default 1)")
    ap.add_argument("--direct-compiled", action="store_true",
                    help="direct engine with vLLM's default torch.compile (dapo-flow runs eager on CPU)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--workdir", help="working directory to keep (default: a temp dir, removed)")
    args = ap.parse_args(argv)
    setting = dict(QUICK if args.quick else FULL)
    for key in ("reps", "prompts", "n", "max_tokens"):
        if getattr(args, key) is not None:
            setting[key] = getattr(args, key)
    console = make_console()

    from dapo_flow import threads
    from dapo_flow.runtime.worker import quiet_libraries

    quiet_libraries()
    threads.configure(args.threads)
    console.print(f"load {os.getloadavg()[0]:.2f} at start; {os.cpu_count()} CPUs")
    with scratch_dir(args.workdir, console) as work:
        tokenizer = build_tokenizer(CONTEXT)
        shape = {**setting["shape"], "vocab_size": math.ceil(len(tokenizer) / 64) * 64}
        model_dir = work / "model"
        info = random_qwen2(model_dir, shape, tokenizer, max_positions=CONTEXT)
        table = prompt_table(tokenizer, setting["prompts"], setting["prompt_tokens"])
        prompt_ids = table.column("prompt_ids").to_pylist()
        prompt_lens = [len(p) for p in prompt_ids]
        graph = work / "generation.yaml"
        graph.write_text(GRAPH.format(model=json.dumps(str(model_dir)), budget=max(prompt_lens),
                                      prompts=setting["prompts"], n=setting["n"], temperature=TEMPERATURE,
                                      top_p=TOP_P, top_k=TOP_K, max_tokens=setting["max_tokens"]))
        console.print(f"model: {info['num_parameters'] / 1e6:.1f}M-parameter Qwen2 (vocab {shape['vocab_size']}, "
                      f"tokenizer {info['tokenizer_size']}); {setting['prompts']} prompts of "
                      f"{min(prompt_lens)}-{max(prompt_lens)} tokens x n={setting['n']} x {setting['max_tokens']} "
                      f"tokens; {setting['reps']} rounds; torch threads {args.threads}")

        start = time.perf_counter()
        worker = rollout_worker(graph, args.threads)
        dapo_startup = time.perf_counter() - start
        engine = worker.resources["policy"].generator
        import vllm

        dapo_engine = engine_facts(engine.llm)
        start = time.perf_counter()
        direct = vllm.LLM(model=str(model_dir), dtype="float32", seed=0,
                          max_model_len=dapo_engine["max_model_len"],
                          enforce_eager=dapo_engine["enforce_eager"] and not args.direct_compiled,
                          distributed_executor_backend="uni")
        direct_startup = time.perf_counter() - start
        threads.configure(args.threads)  # vLLM's worker no-ops torch.set_num_threads; set it for real
        direct_engine = engine_facts(direct)
        params = vllm.SamplingParams(n=setting["n"], temperature=TEMPERATURE, top_p=TOP_P, top_k=TOP_K,
                                     max_tokens=setting["max_tokens"], logprobs=0)
        console.print(f"engines up: dapo-flow's {dapo_startup:.1f} s (stage worker), direct {direct_startup:.1f} s")
        console.print(f"  dapo-flow engine: {dapo_engine}\n  direct engine:    {direct_engine}")

        clock = VLLMClock(engine.llm)
        sides = {"direct": lambda: call_direct(direct, prompt_ids, params),
                 "dapo-flow": lambda: call_dapo(worker, table, clock)}
        warm = {name: side() for name, side in sides.items()}  # untimed
        rounds: list[dict] = []
        with LoadSampler() as load:
            for rep in range(setting["reps"]):
                order = list(sides) if rep % 2 == 0 else list(sides)[::-1]
                got = {name: sides[name]() for name in order}
                got["order"] = order
                rounds.append(got)
                console.print(f"  round {rep + 1}: " + ", ".join(
                    f"{name} {got[name]['tokens_per_s']:,.0f} tok/s ({got[name]['tokens']} in "
                    f"{got[name]['seconds']:.2f} s)" for name in order) + f"; load {os.getloadavg()[0]:.2f}")
        worker.close()
        del direct

    dapo_tps = statistics.median(r["dapo-flow"]["tokens_per_s"] for r in rounds)
    direct_tps = statistics.median(r["direct"]["tokens_per_s"] for r in rounds)
    ratio = dapo_tps / direct_tps
    per_round = [r["dapo-flow"]["tokens_per_s"] / r["direct"]["tokens_per_s"] for r in rounds]
    parts = {key: statistics.median(r["dapo-flow"][key] for r in rounds)
             for key in ("seconds", "vllm_s", "engine_wrap_s", "op_tables_s", "worker_s")}
    direct_s = statistics.median(r["direct"]["seconds"] for r in rounds)

    from rich.table import Table

    t = Table(title=f"generate, {info['num_parameters'] / 1e6:.1f}M-parameter Qwen2, {setting['prompts']} x "
                    f"{setting['n']} x {setting['max_tokens']} tokens (median of {len(rounds)} rounds)")
    for col in ("side", "tokens/s", "seconds", "tokens", "min-max tokens/s"):
        t.add_column(col, justify="right")
    for name in ("direct", "dapo-flow"):
        tps = [r[name]["tokens_per_s"] for r in rounds]
        t.add_row(name, f"{statistics.median(tps):,.0f}", f"{statistics.median(r[name]['seconds'] for r in rounds):.2f}",
                  f"{statistics.median(r[name]['tokens'] for r in rounds):,.0f}", f"{min(tps):,.0f}-{max(tps):,.0f}")
    console.print(t)
    console.print(f"ratio dapo-flow / direct: [bold]{ratio:.3f}[/] (target >= 0.9); per round "
                  + ", ".join(f"{x:.3f}" for x in per_round))
    console.print(f"dapo-flow call, median seconds: {parts['seconds']:.3f} = vLLM generate {parts['vllm_s']:.3f} "
                  f"+ engine wrapper {parts['engine_wrap_s']:.4f} + operator tables {parts['op_tables_s']:.4f} "
                  f"+ worker {parts['worker_s']:.4f}; direct call {direct_s:.3f}; dapo-flow's vLLM time / "
                  f"direct's {parts['vllm_s'] / direct_s:.3f}")
    console.print(f"[dim]load: {fmt(load.mean, '.2f')} (mean 1-min load average over the rounds, "
                  f"{os.cpu_count()} CPUs); torch threads {args.threads}[/]")

    write_json(args.json, {
        "tokens_per_s": dapo_tps, "direct_tokens_per_s": direct_tps, "ratio": ratio,
        "ratio_per_round": per_round, "params": info["num_parameters"], "load": load.mean,
        "dapo_flow_parts_s": parts, "direct_seconds": direct_s,
        "settings": {k: v for k, v in setting.items() if k != "shape"} | {
            "temperature": TEMPERATURE, "top_p": TOP_P, "top_k": TOP_K, "threads": args.threads,
            "quick": args.quick, "direct_compiled": args.direct_compiled,
            "prompt_lens": prompt_lens},
        "engines": {"dapo-flow": dapo_engine, "direct": direct_engine},
        "startup_seconds": {"dapo-flow": dapo_startup, "direct": direct_startup},
        "warmup": warm, "rounds": rounds, "model": info,
    }, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
