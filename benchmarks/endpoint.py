"""The OpenAI-compatible endpoint against in-process `generate`: what a harness's HTTP round
trips cost over the batched engine call they end up in.

What it times, in one process and one run, interleaved (endpoint first, then in-process first, ...):

- endpoint: ``--requests`` harness calls at once, each one ``completions.create`` with an
  ``openai.AsyncOpenAI`` client over loopback (dapo_flow.endpoint.harness.run_episodes, as the
  `harness-generate` operator runs them: one episode per call, registered and finished in the
  endpoint's book), through the endpoint's batcher into the engine. Included: the clients, HTTP,
  JSON, tokenizing the prompts, batching, the engine call(s), recording the episodes. The
  endpoint is set up as `harness-generate` sets it (``spare_threads=1``): the engine leaves one
  torch thread to the clients that share its process, except in a call that every open episode
  waits on (here each round's one call, all 64 requests in it), which takes them all;
  ``--always-spare``: the spare thread left on every call (harness-generate's
  ``engine_threads: fixed``).
- in-process: ``policy.generate`` on the same prompt ids with the same per-prompt seeds (so both
  sample the same tokens), one call.

Model: builtin:tiny-agent (built on first use; a decode step costs next to nothing, so the
HTTP share shows at its largest), or ``--model qwen``: a random-init Qwen2 (hidden 512, 8 layers,
as benchmarks/generation.py), float32 on the CPU; prompts ``a*b=`` of builtin:tool-arith at
temperature 1. Reported (medians over ``--reps`` rounds after one untimed
round each): ``endpoint_s``, ``inprocess_s``, ``ratio`` = endpoint_s / inprocess_s,
``requests_per_s`` (the endpoint's), the engine calls per endpoint round and the seconds inside
them (``endpoint_engine_s``: the rest of endpoint_s is HTTP, clients and batching), how many of
those calls ran on every thread (``all_thread_calls_per_round``), and the mean 1-minute load
average. ``--quick``: 2 rounds.

Run: python benchmarks/endpoint.py [--quick] [--json PATH] [--model tiny-agent|qwen] [--requests N]
     [--max-tokens T] [--reps R] [--always-spare]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import LoadSampler, fmt, make_console, write_json  # noqa: E402

MODEL = "policy"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=40)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--model", choices=("tiny-agent", "qwen"), default="tiny-agent")
    ap.add_argument("--always-spare", action="store_true",
                    help="the engine leaves its spare thread on every call (engine_threads: fixed)")
    args = ap.parse_args(argv)
    reps = 2 if args.quick else args.reps
    console = make_console()

    from dapo_flow.agent.rollout import request_seed
    from dapo_flow.data.tool_arith import ToolArithTask
    from dapo_flow.endpoint.harness import run_episodes
    from dapo_flow.endpoint.server import Endpoint
    from dapo_flow.models import resolve_model
    from dapo_flow.models.hf import HFPolicy
    from dapo_flow.models.sampling import SamplingConfig

    scratch = tempfile.TemporaryDirectory()
    policy = HFPolicy(qwen(Path(scratch.name)) if args.model == "qwen" else resolve_model("builtin:tiny-agent",
                                                                                        progress=False))
    problems = ToolArithTask().problems("val")[: args.requests]
    prompt_ids = [policy.tokenizer.encode(p.prompt) for p in problems]
    seeds = list(range(len(problems)))
    max_tokens = args.max_tokens

    async def one_call(client, task):
        await client.completions.create(model=MODEL, prompt=task["prompt"], max_tokens=max_tokens)

    endpoint = Endpoint(policy, model_name=MODEL, call_format="compact", require_episode=True, spare_threads=1,
                        sampling=(1.0, 1.0, -1), all_threads_when_waited=not args.always_spare).start()
    rounds = 0

    def through_endpoint() -> tuple[float, int, float, int]:
        nonlocal rounds
        rounds += 1
        ids = [f"r{rounds}-{i}" for i in range(len(problems))]
        for episode, seed in zip(ids, seeds):
            endpoint.book.register(episode, seed, max_requests=1, budget=max_tokens)
        stats = endpoint.batcher.stats
        calls, engine_seconds, all_threads = stats.calls, stats.seconds, stats.all_threads
        start = time.perf_counter()
        records = run_episodes(one_call, endpoint.base_url, endpoint.token,
                               [(e, {"prompt": p.prompt}) for e, p in zip(ids, problems)], timeout_s=600,
                               concurrency=len(problems), on_done=lambda e, o: endpoint.book.finish(e, o.masked))
        elapsed = time.perf_counter() - start
        assert all(r.completions == 1 and not r.masked for r in records), "every call sampled once"
        return elapsed, stats.calls - calls, stats.seconds - engine_seconds, stats.all_threads - all_threads

    def in_process() -> float:
        cfg = SamplingConfig(n=1, temperature=1.0, max_tokens=max_tokens,
                             prompt_seeds=tuple(request_seed(s, 0) for s in seeds))  # the endpoint's seeds
        start = time.perf_counter()
        policy.generate(prompt_ids, cfg)
        return time.perf_counter() - start

    try:
        through_endpoint(), in_process()  # untimed: first calls, connections, caches
        ends, ins, calls, engine, on_all = [], [], [], [], []
        with LoadSampler() as load:
            for r in range(reps):
                for side in (("endpoint", "in") if r % 2 == 0 else ("in", "endpoint")):
                    if side == "endpoint":
                        seconds, engine_calls, engine_seconds, all_threads = through_endpoint()
                        on_all.append(all_threads)
                        ends.append(seconds)
                        calls.append(engine_calls)
                        engine.append(engine_seconds)
                    else:
                        ins.append(in_process())
    finally:
        endpoint.close()
        scratch.cleanup()
    endpoint_s, inprocess_s = statistics.median(ends), statistics.median(ins)
    result = {"endpoint_s": endpoint_s, "inprocess_s": inprocess_s, "ratio": endpoint_s / inprocess_s,
              "requests_per_s": args.requests / endpoint_s,
              "endpoint_engine_s": statistics.median(engine), "requests": args.requests, "max_tokens": max_tokens,
              "reps": reps, "model": args.model, "always_spare": args.always_spare, "engine_calls_per_round": calls, "all_thread_calls_per_round": on_all,
              "endpoint_rounds_s": ends, "inprocess_rounds_s": ins,
              "load": load.mean}
    console.print(f"{args.requests} concurrent harness calls, {max_tokens} tokens max, {reps} rounds (load "
                  f"{fmt(load.mean, '.1f')}): endpoint {endpoint_s:.3f} s ({result['requests_per_s']:.1f} req/s, "
                  f"engine calls {calls}, {on_all} on all threads, {result['endpoint_engine_s']:.3f} s in them), in-process {inprocess_s:.3f} s, ratio {result['ratio']:.3f}")
    write_json(args.json, result, console)
    return 0


def qwen(out: Path) -> Path:
    """A random-init Qwen2 as benchmarks/generation.py builds it (hidden 512, 8 layers), whose
    decode steps cost what a small real model's do."""
    import math

    from _common import random_qwen2
    from dapo_flow.recipes.chat_tokenizer import train_chat_tokenizer
    import pydoc_data.topics

    tokenizer = train_chat_tokenizer(list(pydoc_data.topics.topics.values()), vocab_size=32000, model_max_length=512)
    shape = {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2,
             "intermediate_size": 1376, "vocab_size": math.ceil(len(tokenizer) / 64) * 64}
    random_qwen2(out, shape, tokenizer)
    return out


if __name__ == "__main__":
    sys.exit(main())
