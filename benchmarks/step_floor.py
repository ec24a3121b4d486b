"""The main job's step, phase by phase, against a raw torch floor at the same shapes, one run.

The main job is graphs/dapo.yaml (builtin:tiny-adder, float32; generation batches of
``gen_prompts_per_batch`` prompts x ``n`` samples x ``max_tokens`` until ``prompts_per_step``
groups are kept; the update in ``mini_batches`` AdamW steps of ``micro_batch_size``-row passes).
Its steps run in this process as ``dapo-flow run --executor local`` runs them (the compiled
plan, ``stage_setups``, the local executor's stage workers, ``Runner.step``; the run's DDP group
of 2 is its one worker in-process, as the local executor makes it): no MLflow, validation or
checkpoint, which ``time/step`` leaves out in a real run too. Each round:

- **step**: one real step of the job (``time/step``: ``Runner.step``), its phases timed as the
  runtime times them (``time/<node>``: every generate call of the step, summed, and the update
  call), and the inputs of those calls kept: each generation batch's prompts and the trained
  batch. The weights from before the step are copied for the floor. ``rollout_engine_s`` is the
  part of the rollout inside the policy's sampler (``gen/seconds``); the rest is the generate
  operator's Arrow columns and detokenized texts.
- **rollout floor**: the same prompts (each generation batch of the step), the same weights,
  ``n``, temperature and ``max_tokens``, in plain torch and transformers: left-padded prompts,
  one prefill whose KV cache is repeated for the ``n`` samples (as the policy does), then one
  ``model(past_key_values=...)`` forward per token, ``torch.multinomial`` on
  ``softmax(logits / T)`` with a seeded generator, the sampled token's logprob (the job trains
  on them: ``old_logp.source: rollout``), stopping when every row has met EOS or at
  ``max_tokens``. Tokens stay in tensors (no lists, texts or Arrow). The two sides sample with
  different random streams, so the tokens each generated are reported.
- **update floor**: the trained batch, the same weights, cut into the same mini- and micro-batches
  (rows in order, as the trainer cuts them with ``shuffle: false``), each pass's tensors padded
  before the clock starts: forward (``logits_to_keep``: the response positions), log_softmax,
  gather, the clipped surrogate with clip-higher and dual clip over the mini-batch's tokens,
  backward; then grad-norm clipping and ``AdamW.step`` per mini-batch. Its own AdamW, kept across
  rounds like the trainer's. Same process, same torch threads (the stage worker's).

Reported, medians over the measured rounds (the first ``warmup`` rounds are dropped): per phase
dapo-flow seconds, floor seconds, ratio; the step's seconds and its share outside both phases,
``outside_frac`` = 1 - (rollout + update) / step, per round (scoring, shaping, the group filter,
old logprobs, advantages, table glue, the sampler). Goals (issue 53), printed met or not:
update <= 1.2x its floor, rollout <= 1.2x its floor, outside <= 10% of the step.

Run: python benchmarks/step_floor.py [--quick] [--rounds R] [--warmup W] [--json PATH] [--workdir DIR]
``--quick``: 2 warm-up + 12 measured rounds (under half a minute on 2 cores, most of it start-up);
the default, 3 + 100 rounds (the job's model learns as it goes, as in a real run: later steps may
need more generation batches).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _common import DEFAULT_GRAPH, LoadSampler, fmt, make_console, scratch_dir, write_json

FULL = dict(rounds=100, warmup=3)
QUICK = dict(rounds=12, warmup=2)
TARGETS = {"rollout_ratio_max": 1.2, "update_ratio_max": 1.2, "outside_frac_max": 0.10}
# no validation set to load: runner.step never validates, and a val source costs start-up time
EDITS = ("data.val=null",)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else ():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


# ------------------------------------------------------------------------------ the main job


class Recorded:
    """An operator whose call inputs (and outputs) the benchmark keeps; everything else forwards."""

    def __init__(self, op: Any):
        self.op, self.calls = op, []

    def __call__(self, table):
        out = self.op(table)
        self.calls.append((table, out))
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.op, name)


class MainJob:
    """graphs/dapo.yaml compiled and started as `dapo-flow run --executor local` starts it."""

    def __init__(self, graph: Path, console):
        from dapo_flow import threads
        from dapo_flow.graph.edits import edit_file, parse_cli_edits
        from dapo_flow.graph.registry import load_plugins
        from dapo_flow.runtime.loop import LoopState, Runner
        from dapo_flow.runtime.run_data import generator_tokenizer, load_source, train_sampler
        from dapo_flow.runtime.session import start_executor
        from dapo_flow.runtime.setup import driver_threads, stage_setups

        load_plugins()
        self.placed = edit_file(graph, parse_cli_edits([("set", s) for s in EDITS])).compile()
        plan = self.placed.plan
        threads.configure(driver_threads(self.placed))  # as runtime.execute does
        self.ex = start_executor(self.placed, stage_setups(self.placed), "local", None, console)
        prompts, _ = load_source(plan, plan.spec.data.train, generator_tokenizer(plan))
        self.runner = Runner(self.placed, self.ex, train_sampler(plan, prompts, self.ex))
        self.state = LoopState()
        self.gen, self.train = plan.first("generate"), plan.first("train")
        worker = self.ex.workers[self.placed.node_stage[self.train.id]]
        if self.placed.node_stage[self.gen.id] != self.placed.node_stage[self.train.id]:
            raise SystemExit("the main job generates with the policy it trains: one stage for both")
        self.policy = worker.resources[self.train.model].policy
        self.rollouts = worker.ops[self.gen.id] = Recorded(worker.ops[self.gen.id])
        self.updates = worker.ops[self.train.id] = Recorded(worker.ops[self.train.id])
        p = self.train.params
        budget = plan.spec.models[self.train.model].train.max_tokens_per_micro_batch
        if p.shuffle or p.ppo_epochs != 1 or budget:
            raise SystemExit("the floor cuts the trainer's rows in order, one epoch, by micro_batch_size")

    def step(self) -> dict:
        """One step of the job; its seconds, phases and the inputs the floor repeats."""
        import torch

        weights = {k: v.detach().clone() for k, v in self.policy.model.state_dict().items()}
        self.rollouts.calls.clear()
        self.updates.calls.clear()
        torch_threads = torch.get_num_threads()
        start = time.perf_counter()
        metrics, _ = self.runner.step(self.state, None, collect_next=False)
        step_s = time.perf_counter() - start
        self.state.step += 1
        if not self.updates.calls:
            raise SystemExit(f"step {self.state.step} trained nothing (the group filter kept no group)")
        return {"step_s": step_s, "rollout_s": metrics[f"time/{self.gen.id}"],
                "rollout_engine_s": metrics["gen/seconds"], "update_s": metrics[f"time/{self.train.id}"],
                "gen_batches": int(metrics["sampling/gen_batches"]), "tokens": int(metrics["gen/tokens"]),
                "torch_threads": torch_threads, "weights": weights,
                "prompts": [t for t, _ in self.rollouts.calls], "batch": self.updates.calls[0][0]}

    def close(self) -> None:
        self.ex.shutdown()


# ------------------------------------------------------------------------------ the floor


class Floor:
    """The same model in plain transformers and torch: a KV-cache decode loop and fwd + bwd + AdamW."""

    def __init__(self, job: MainJob):
        import torch
        from transformers import AutoModelForCausalLM

        from dapo_flow.models.hf import hf_progress_bars_off

        with hf_progress_bars_off():
            self.model = AutoModelForCausalLM.from_pretrained(job.policy.path, dtype=torch.float32)
        self.model.eval()  # no dropout, as the policy runs it
        self.gen, self.train = job.gen.params, job.train.params
        self.pad = job.policy.pad_id
        self.eos = torch.tensor(job.policy.eos_ids)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.train.lr,
                                           weight_decay=self.train.weight_decay)

    # --- rollout --------------------------------------------------------------------------------

    def rollout(self, prompt_ids: list[list[int]], generator) -> tuple[int, int]:
        """n samples of each prompt; (tokens generated, EOS included; decoding forwards).
        Shape: prompts (B, P) -> tokens, logprobs (B*n, T)."""
        import torch

        n, temperature, max_tokens = self.gen.n, self.gen.temperature, self.gen.max_tokens
        width = max(map(len, prompt_ids))
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompt_ids])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
        with torch.inference_mode():
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                             use_cache=True, logits_to_keep=1)
            cache, logits = out.past_key_values, out.logits[:, -1].float().repeat_interleave(n, 0)
            cache.batch_repeat_interleave(n)  # one prefill per prompt, fanned out to its samples
            mask = mask.repeat_interleave(n, 0)
            rows = mask.shape[0]
            position = mask.sum(-1, keepdim=True)
            tokens = torch.full((rows, max_tokens), self.pad)
            logprobs = torch.zeros(rows, max_tokens)
            lengths = torch.zeros(rows, dtype=torch.long)
            done = torch.zeros(rows, dtype=torch.bool)
            forwards = 1
            for t in range(max_tokens):
                logp = torch.log_softmax(logits / temperature, -1)
                tok = torch.multinomial(logp.exp(), 1, generator=generator)  # (S, 1)
                logprobs[:, t] = logp.gather(1, tok).squeeze(1)
                tok = tok.squeeze(1)
                tokens[:, t] = tok.masked_fill(done, self.pad)
                lengths += ~done
                done |= torch.isin(tok, self.eos)
                if t + 1 == max_tokens or bool(done.all()):
                    break
                mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)
                out = self.model(input_ids=tok[:, None], attention_mask=mask, position_ids=position,
                                 past_key_values=cache, use_cache=True)
                logits = out.logits[:, -1].float()
                position = position + 1
                forwards += 1
        return int(lengths.sum()), forwards

    # --- update ---------------------------------------------------------------------------------

    def passes(self, batch) -> list[tuple[int, list[dict]]]:
        """The trained batch as the trainer cuts it: per mini-batch (its token count, its passes'
        tensors), padded per pass as the policy pads them. Shape per pass: input_ids,
        attention_mask, position_ids (b, P+R); response, mask, old (b, R); adv (b,)."""
        import numpy as np
        import torch

        from dapo_flow.core import columns as C

        prompts = batch.column(C.PROMPT_IDS).to_pylist()
        responses = batch.column(C.RESPONSE_IDS).to_pylist()
        olds = batch.column(C.OLD_LOGP).to_pylist()
        adv = torch.tensor(batch.column(C.ADVANTAGE).to_numpy(), dtype=torch.float32)
        size = self.train.micro_batch_size
        out = []
        for mb in np.array_split(np.arange(len(prompts)), min(self.train.mini_batches, len(prompts))):
            tokens = sum(len(responses[i]) for i in mb)
            parts = []
            for rows in (mb[i:i + size] for i in range(0, len(mb), size)):
                p_width = max(len(prompts[i]) for i in rows)
                r_width = max(1, max(len(responses[i]) for i in rows))
                ids, mask, resp, rmask, old = [], [], [], [], []
                for i in rows:
                    p, r = prompts[i], responses[i]
                    ids.append([self.pad] * (p_width - len(p)) + p + r + [self.pad] * (r_width - len(r)))
                    mask.append([0] * (p_width - len(p)) + [1] * (len(p) + len(r)) + [0] * (r_width - len(r)))
                    resp.append(r + [self.pad] * (r_width - len(r)))
                    rmask.append([True] * len(r) + [False] * (r_width - len(r)))
                    old.append(olds[i] + [0.0] * (r_width - len(r)))
                mask_t = torch.tensor(mask)
                parts.append({"input_ids": torch.tensor(ids), "attention_mask": mask_t,
                              "position_ids": (mask_t.cumsum(-1) - 1).clamp(min=0), "response": torch.tensor(resp),
                              "mask": torch.tensor(rmask), "old": torch.tensor(old), "adv": adv[rows]})
            out.append((tokens, parts))
        return out

    def update(self, mini_batches: list[tuple[int, list[dict]]]) -> None:
        """One RL step: per mini-batch zero_grad, its passes' forward + backward, clip, AdamW."""
        import torch

        p = self.train
        for tokens, parts in mini_batches:
            self.optimizer.zero_grad(set_to_none=True)
            for b in parts:
                keep = b["response"].shape[1] + 1
                logits = self.model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                                    position_ids=b["position_ids"], use_cache=False, logits_to_keep=keep).logits
                logp = torch.log_softmax(logits[:, :-1].float() / p.temperature, -1)
                logp = logp.gather(-1, b["response"].unsqueeze(-1)).squeeze(-1)
                ratio = torch.exp((logp - b["old"]).clamp(-20.0, 20.0))
                adv = b["adv"][:, None]
                loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - p.clip_low, 1 + p.clip_high))
                if p.clip_c is not None:  # dual clip: negative advantages bounded by -A * c
                    loss = torch.where(adv < 0, torch.minimum(loss, -adv * p.clip_c), loss)
                ((loss * b["mask"]).sum() / tokens).backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), p.grad_clip)
            self.optimizer.step()


# ------------------------------------------------------------------------------ rounds


def one_round(job: MainJob, floor: Floor, round_no: int) -> dict:
    """A step of the job, then the floor's rollout and update on the step's inputs and weights."""
    import torch

    from dapo_flow.core import columns as C

    ours = job.step()
    floor.model.load_state_dict(ours.pop("weights"))  # the weights the step started from
    generator = torch.Generator().manual_seed(round_no)
    tokens = forwards = 0
    start = time.perf_counter()
    for prompts in ours.pop("prompts"):
        t, f = floor.rollout(prompts.column(C.PROMPT_IDS).to_pylist(), generator)
        tokens, forwards = tokens + t, forwards + f
    rollout_floor_s = time.perf_counter() - start
    mini_batches = floor.passes(ours.pop("batch"))  # padded before the clock starts
    start = time.perf_counter()
    floor.update(mini_batches)
    update_floor_s = time.perf_counter() - start
    if torch.get_num_threads() != ours["torch_threads"]:
        raise SystemExit(f"torch threads changed: {ours['torch_threads']} in the step, "
                         f"{torch.get_num_threads()} in the floor")
    return {**ours, "rollout_floor_s": rollout_floor_s, "update_floor_s": update_floor_s,
            "floor_tokens": tokens, "floor_forwards": forwards,
            "trained_rows": sum(len(b["adv"]) for _, parts in mini_batches for b in parts),
            "outside_frac": 1.0 - (ours["rollout_s"] + ours["update_s"]) / ours["step_s"]}


def summarize(rounds: list[dict]) -> dict:
    med = lambda key: statistics.median(r[key] for r in rounds)  # noqa: E731
    out = {key: med(key) for key in ("step_s", "rollout_s", "rollout_engine_s", "rollout_floor_s", "update_s",
                                     "update_floor_s", "outside_frac")}
    # ratios per round (both halves of a round ran within a second of each other), then the median
    out["rollout_ratio"] = statistics.median(r["rollout_s"] / r["rollout_floor_s"] for r in rounds)
    out["update_ratio"] = statistics.median(r["update_s"] / r["update_floor_s"] for r in rounds)
    out["tokens"] = sum(r["tokens"] for r in rounds)
    out["floor_tokens"] = sum(r["floor_tokens"] for r in rounds)
    out["gen_batches"] = sum(r["gen_batches"] for r in rounds)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"{QUICK['warmup']} warm-up + {QUICK['rounds']} rounds")
    ap.add_argument("--rounds", type=int, default=None, help=f"measured rounds (default {FULL['rounds']})")
    ap.add_argument("--warmup", type=int, default=None, help=f"rounds dropped first (default {FULL['warmup']})")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the results to PATH")
    ap.add_argument("--workdir", default=None, help="run in DIR (default: a temp dir, removed)")
    args = ap.parse_args(argv)
    setting = QUICK if args.quick else FULL
    rounds_n = setting["rounds"] if args.rounds is None else args.rounds
    warmup = setting["warmup"] if args.warmup is None else args.warmup
    if rounds_n < 1:
        ap.error("--rounds must be >= 1")
    console = make_console()
    cpu = cpu_model()

    with scratch_dir(args.workdir, console), LoadSampler() as load:
        start = time.perf_counter()
        job = MainJob(DEFAULT_GRAPH, console)
        try:
            floor = Floor(job)
            startup_s = time.perf_counter() - start
            rounds = []
            for k in range(warmup + rounds_n):
                rounds.append(one_round(job, floor, k))
                r = rounds[-1]
                console.print(f"[dim]round {k + 1}{' (warm-up)' if k < warmup else ''}: step {r['step_s']:.3f} s, "
                              f"rollout {r['rollout_s']:.3f} / {r['rollout_floor_s']:.3f} s "
                              f"({r['gen_batches']} batch(es), {r['tokens']} / {r['floor_tokens']} tokens), "
                              f"update {r['update_s']:.3f} / {r['update_floor_s']:.3f} s[/]")
        finally:
            job.close()
    measured = rounds[warmup:]
    res = summarize(measured)

    from rich.table import Table

    gen, train, run = job.gen.params, job.train.params, job.placed.plan.spec.run
    met = {"rollout_met": res["rollout_ratio"] <= TARGETS["rollout_ratio_max"],
           "update_met": res["update_ratio"] <= TARGETS["update_ratio_max"],
           "outside_met": res["outside_frac"] <= TARGETS["outside_frac_max"]}
    yes = lambda ok: "[green]met[/]" if ok else "[red]not met[/]"  # noqa: E731
    t = Table(title=f"graphs/dapo.yaml, one step vs the raw floor: medians of {len(measured)} rounds "
                    f"({cpu}, {measured[0]['torch_threads']} torch thread(s), load {fmt(load.mean, '.2f')})")
    for col in ("phase", "dapo-flow s", "floor s", "ratio", "goal"):
        t.add_column(col, justify="left" if col == "phase" else "right")
    t.add_row("rollout", f"{res['rollout_s']:.4f}", f"{res['rollout_floor_s']:.4f}", f"{res['rollout_ratio']:.2f}x",
              f"<= {TARGETS['rollout_ratio_max']}x: {yes(met['rollout_met'])}")
    t.add_row("update", f"{res['update_s']:.4f}", f"{res['update_floor_s']:.4f}", f"{res['update_ratio']:.2f}x",
              f"<= {TARGETS['update_ratio_max']}x: {yes(met['update_met'])}")
    t.add_row("step", f"{res['step_s']:.4f}", "", f"outside {res['outside_frac']:.1%}",
              f"<= {TARGETS['outside_frac_max']:.0%}: {yes(met['outside_met'])}")
    console.print(t)
    console.print(f"[dim]shapes: {run.gen_prompts_per_batch} prompts x n={gen.n} x max_tokens={gen.max_tokens} a "
                  f"generation batch ({res['gen_batches']} batches over the rounds), {run.prompts_per_step} groups "
                  f"trained in {train.mini_batches} mini-batches of {train.micro_batch_size}-row passes; tokens "
                  f"generated over the rounds: dapo-flow {res['tokens']}, floor {res['floor_tokens']}; of dapo-flow's "
                  f"rollout {res['rollout_engine_s']:.4f} s in the policy's sampler (the rest: Arrow and texts); "
                  f"start-up {startup_s:.1f} s[/]")

    payload = {
        "graph": "graphs/dapo.yaml", "executor": "local", "quick": args.quick, "rounds": len(measured),
        "warmup_rounds": warmup, **res, "targets": {**TARGETS, **met},
        "shapes": {"model": job.placed.plan.spec.models[job.train.model].path,
                   "gen_prompts_per_batch": run.gen_prompts_per_batch, "prompts_per_step": run.prompts_per_step,
                   "n": gen.n, "temperature": gen.temperature, "max_tokens": gen.max_tokens,
                   "mini_batches": train.mini_batches, "micro_batch_size": train.micro_batch_size},
        "per_round": measured,
        "startup_s": startup_s, "torch_threads": measured[0]["torch_threads"],
        "cpu": cpu, "cpus": os.cpu_count(), "load": load.mean,
    }
    write_json(args.json, payload, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
