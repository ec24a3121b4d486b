"""Bytes of tables materialized in the driver per step, on Ray, at 32 prompts x 16 samples x
256 response tokens.

The graph is DAPO's shape (generate -> score -> overlong -> group-filter -> logprob ->
advantage -> update) on a Qwen2-architecture model built from config with random weights
(tiny-chat's BPE tokenizer and chat template), so nearly every response runs to the 256-token
budget; a hash of the response text decides right / wrong, so dynamic sampling keeps most
groups. The policy is a DDP group of two workers and the model-free operators run in the driver
stage's actor.

Measured in one run, per step (from the run's MLflow metrics):
- `driver_bytes_per_step`: tables materialized in the driver (the prompts it samples and what it
  fetches: the update's metrics row). Tables by reference: everything else stays in the object
  store and moves between actors.
- `relay_bytes_per_step`: the bytes the driver held before tables moved by reference, when every
  call's output came back to it (the sum of every call's output plus the prompts).
- `batch_bytes`: the step's largest table (the batch as the update reads it).
Target: driver bytes <= 5% of the batch's.

Run: python benchmarks/driver_bytes.py [--quick] [--json out.json] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

from _common import fmt, make_console, run_graph, scratch_dir, step_history, write_json

REWARD = '''"""Benchmark reward: right or wrong by a hash of the response (about half of each group)."""
import zlib


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(zlib.crc32(solution_str.encode()) % 2)
'''

GRAPH = """name: driver-bytes
seed: 0
models:
  policy:
    path: {model}
    dtype: float32
    train: {{workers: 2, strategy: ddp}}
data:
  train: {{source: "builtin:chain", split: train}}
run:
  steps: {steps}
  prompts_per_step: {prompts}
  val_every: 0
  checkpoint_every: 0
tracking:
  experiment: driver-bytes
nodes:
  - {{id: rollout, op: generate, model: policy, inputs: [prompts],
      params: {{n: {n}, temperature: 1.0, max_tokens: {tokens}}}}}
  - {{id: verify, op: score, inputs: [rollout], params: {{reward: "bench_reward.py:compute_score"}}}}
  - {{id: overlong, op: overlong-shape, inputs: [verify], params: {{max_len: {tokens}, buffer_len: {buffer}}}}}
  - {{id: dynamic_sampling, op: group-filter, inputs: [overlong], params: {{metric: acc, max_gen_batches: 4}}}}
  - {{id: old_logp, op: logprob, model: policy, inputs: [dynamic_sampling], params: {{role: actor}}}}
  - {{id: adv, op: advantage, inputs: [old_logp]}}
  - {{id: train, op: update, model: policy, inputs: [adv], params: {{lr: 1.0e-5, mini_batches: 1, micro_batch_size: 64}}}}
"""


def random_model(out: Path, context: int) -> Path:
    """A Qwen2 model shaped like tiny-chat, random weights, ``context`` positions, with
    tiny-chat's tokenizer files (built locally once, cached)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from dapo_flow.models import resolve_model
    from dapo_flow.recipes.tiny_chat import shape_config

    chat = resolve_model("builtin:tiny-chat")
    torch.manual_seed(0)
    config = AutoConfig.for_model(**{**shape_config(), "max_position_embeddings": context})
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    for f in chat.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "generation_config")):
            shutil.copy(f, out / f.name)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke test: 8 prompts x 4 samples x 32 tokens, 2 steps")
    ap.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--workdir", help="working directory to keep (default: a temp dir, removed)")
    args = ap.parse_args()
    console = make_console()
    prompts, n, tokens, steps = (8, 4, 32, 2) if args.quick else (32, 16, 256, args.steps)
    with scratch_dir(args.workdir, console) as work:
        model = random_model(work / "model", context=tokens + 64)
        (work / "bench_reward.py").write_text(REWARD)
        graph = work / "driver_bytes.yaml"
        graph.write_text(GRAPH.format(model=json.dumps(str(model)), steps=steps, prompts=prompts, n=n,
                                      tokens=tokens, buffer=max(tokens // 4, 1)))
        summary, _ = run_graph(graph, [], executor="ray", steps=steps, console=console)
        history = step_history(summary)
    per_step = sorted(history["perf/driver_bytes"])
    driver = statistics.median(history["perf/driver_bytes"][s] for s in per_step)
    # before: every call's output came back to the driver, beside the prompts it sampled
    relay = statistics.median(history["perf/stage_output_bytes"][s] + history["perf/driver_bytes"][s]
                              for s in per_step)
    batch = statistics.median(history["perf/largest_table_bytes"][s] for s in per_step)
    length = statistics.median(history["batch/response_len_mean"][s] for s in per_step
                               if s in history.get("batch/response_len_mean", {}))
    ratio = driver / batch if batch else None
    console.print(f"{prompts} prompts x {n} samples, responses {length:.0f} tokens (median of step means), "
                  f"{steps} steps on Ray (median per step):")
    console.print(f"  batch (largest table)      {batch / 2**20:8.2f} MiB")
    console.print(f"  driver, every table relayed {relay / 2**20:7.2f} MiB  (before: tables through the driver)")
    console.print(f"  driver, tables by reference {driver / 2**20:7.3f} MiB  = {fmt(100 * ratio, '.2f')}% "
                  "of the batch (target <= 5%)")
    write_json(args.json, {"prompts": prompts, "samples": n, "max_tokens": tokens, "steps": steps,
                            "response_len_median": length, "driver_bytes_per_step": driver,
                            "relay_bytes_per_step": relay, "batch_bytes": batch,
                            "driver_to_batch": ratio, "relay_to_batch": relay / batch if batch else None},
               console)


if __name__ == "__main__":
    main()
