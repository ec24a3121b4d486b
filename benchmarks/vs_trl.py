"""dapo-flow against TRL's GRPOTrainer: same model, prompts, n, max tokens, clips, lr, steps.

Both train builtin:tiny-adder on the builtin addition train split for the same number of RL
steps, in one invocation: dapo-flow runs graphs/dapo.yaml (its own DAPO: dynamic sampling,
soft overlong punishment, clip-higher), TRL runs GRPOTrainer with loss_type "dapo" and every
knob it has set to the graph's values (derived from the compiled graph, not typed twice).
TRL runs in a subprocess (`--trl-worker`), with the first of: this interpreter when it can
import trl, else /work/main/.venv-bench (made by `--setup`, see benchmarks/README.md).

Reported per framework: generated completions per second of training-step time (start-up,
validation and checkpoint writes excluded on both sides), trained completions per second, and
val-acc gain per generated sample. Val acc is measured here, identically for both, with
dapo_flow's HFPolicy: sampled avg@4 at temperature 1 on the 200 val prompts (same seed), on
the base model, the TRL-saved model and dapo-flow's last checkpoint.

Settings: `default` = the graph as is (24 prompts x 8 samples); `big` = 32 prompts x 16;
`auto` = default with `run.gen_prompts_per_batch: auto` (generation batches sized from the keep
rate, so dynamic sampling spends fewer samples per kept group).
Targets, in trained completions/s (what each framework learns from; dapo-flow's dynamic
sampling also generates completions it filters out): dapo-flow >= TRL at default and auto,
>= 1.5x TRL at big, both frameworks at their own thread defaults.

Run: python benchmarks/vs_trl.py [--setting default|big|auto] [--steps 30] [--quick] [--json out.json]
     python benchmarks/vs_trl.py --setup      # make TRL importable (once)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from _common import (DEFAULT_GRAPH, REPO, LoadSampler, final_checkpoint, fmt, make_console, pin_torch_threads,
                     run_graph, scratch_dir, step_history, write_json)

BENCH_VENV = REPO / ".venv-bench"
#: The environment as this script started: TRL's worker gets it, not the thread variables
#: dapo-flow's run exports for its own processes (dapo_flow/threads.py), so each framework runs
#: at its own defaults.
START_ENV = dict(os.environ)
SETTINGS = {  # --set edits of the graph per setting; prompts per generation batch 2x, or auto
    "default": [],
    "big": ["run.prompts_per_step=32", "run.gen_prompts_per_batch=64", "rollout.n=16"],
    "auto": ["run.gen_prompts_per_batch=auto"],  # dynamic sampling sized from the keep rate
}
TARGETS = {"default": 1.0, "big": 1.5, "auto": 1.0}  # dapo-flow / TRL trained completions per second
VAL_PROMPTS, VAL_N, VAL_TEMPERATURE, VAL_SEED = 200, 4, 1.0, 12345
KEEP_VERSIONS = {"torch": "2.13.0+cpu"}  # the main venv must keep these exactly
TRANSFORMERS_RANGE = ("5.16.1", "5.20")  # ... and transformers in [low, high)


# ------------------------------------------------------------------------- settings


def comparable_settings(placed, steps: int) -> dict:
    """What both frameworks must agree on, read off the compiled graph."""
    plan, spec = placed.plan, placed.plan.spec
    by_op = {n.op: n for n in plan.nodes}
    gen, upd = by_op["generate"].params, by_op["update"].params
    shaping = by_op.get("overlong-shape")
    return {
        "model": str(_model_dir(spec)),
        "seed": spec.seed,
        "steps": steps,
        "prompts_per_step": spec.run.prompts_per_step,
        "gen_prompts_per_batch": spec.run.gen_prompts_per_batch or spec.run.prompts_per_step,
        "gen_in_parts": placed.generates_in_parts,
        "n": gen.n,
        "max_tokens": gen.max_tokens,
        "temperature": gen.temperature,
        "lr": upd.lr,
        "weight_decay": upd.weight_decay,
        "warmup_steps": upd.warmup_steps,
        "mini_batches": upd.mini_batches,
        "clip_low": upd.clip_low,
        "clip_high": upd.clip_high,
        "clip_c": upd.clip_c,
        "grad_clip": upd.grad_clip,
        "overlong": None if shaping is None else {
            "max_len": shaping.params.max_len, "buffer_len": shaping.params.buffer_len,
            "factor": shaping.params.factor},
        "dynamic_sampling": plan.group_filter is not None,
    }


def _model_dir(spec) -> Path:
    from dapo_flow.models import resolve_model

    return resolve_model(spec.models["policy"].path)


def differences(s: dict) -> list[str]:
    out = []
    if s["dynamic_sampling"]:
        size = ("as many prompts as the keep rate so far predicts" if s["gen_prompts_per_batch"] == "auto"
                else f"{s['gen_prompts_per_batch']} prompts")
        if s.get("gen_in_parts"):
            size = (f"up to {size} (in parts: the first sized from the keep rate, the rest left once "
                    "enough groups are kept)")
        out.append(f"dynamic sampling: dapo-flow generates {size} x {s['n']} per batch and keeps {s['prompts_per_step']} groups with mixed rewards (more batches "
                   "if needed); TRL has none: it trains on every group, zero-advantage ones included")
    out += [
        f"mini-batches: dapo-flow takes {s['mini_batches']} optimizer steps per RL step on contiguous "
        "whole groups; TRL the same count (steps_per_generation) on a shuffled generation batch",
        f"warm-up: dapo-flow lr factor (k+1)/{s['warmup_steps']} per RL step k; TRL constant_with_warmup "
        f"ramps from 0 over {s['warmup_steps'] * s['mini_batches']} optimizer steps",
        "loss normalization: dapo-flow token-mean over each mini-batch's tokens; TRL 'dapo' over the "
        "tokens of the whole generation batch (same direction, scale differs per mini-batch)",
        "generation: dapo-flow's own KV-cache sampler (one prefill per prompt, fanned out to n); TRL "
        "HF generate on n copies of each prompt",
        "dual clip: dapo-flow clip_c on negative advantages; TRL delta (clamps the ratio at delta, "
        "equivalent for A<0, inactive for A>0)",
    ]
    return out


# ------------------------------------------------------------------------- val acc


def load_split(model_dir: str, split: str, size: int | None, seed: int):
    from transformers import AutoTokenizer

    from dapo_flow.data.prompts import load_prompts

    tok = AutoTokenizer.from_pretrained(model_dir)
    table, _ = load_prompts("builtin:addition", tokenizer=tok, split=split, size=size, seed=seed)
    return table


def val_accuracy(model_dir: str | Path, val, max_tokens: int) -> float:
    """Sampled avg@4 at temperature 1: mean correctness over val prompts x 4 samples."""
    from dapo_flow.core import columns as C
    from dapo_flow.models.hf import HFPolicy
    from dapo_flow.models.sampling import SamplingConfig
    from dapo_flow.data.tasks import verify_addition

    policy = HFPolicy(model_dir, dtype="float32", device="cpu", seed=VAL_SEED)
    prompt_ids = val.column(C.PROMPT_IDS).to_pylist()
    answers = val.column(C.GROUND_TRUTH).to_pylist()
    cfg = SamplingConfig(n=VAL_N, temperature=VAL_TEMPERATURE, max_tokens=max_tokens, seed=VAL_SEED)
    out = policy.generate(prompt_ids, cfg)
    texts = policy.tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
    right = [verify_addition(t, answers[i]) > 0 for t, i in zip(texts, out.prompt_index.tolist())]
    return sum(right) / len(right)


# ------------------------------------------------------------------------- dapo-flow half


def run_dapo_flow(graph: Path, sets: list[str], steps: int, executor: str, val, console: Console) -> dict:
    from dapo_flow.runtime.setup import stage_setups

    start = time.perf_counter()
    # in-run validation off (measured below, like TRL's), one checkpoint at the end
    edits = [*sets, "data.val=null", f"run.checkpoint_every={steps}"]
    summary, placed = run_graph(graph, edits, executor=executor, steps=steps, console=console)
    wall = time.perf_counter() - start
    hist = step_history(summary)
    step_s = [hist["time/step"][s] for s in sorted(hist["time/step"])]
    ckpt = final_checkpoint(summary, placed)
    s = comparable_settings(placed, steps)
    threads = max(st.num_threads for st in stage_setups(placed).values()) or "torch default"
    with console.status("dapo-flow: val acc of the last checkpoint..."):
        acc = val_accuracy(ckpt, val, s["max_tokens"])
    return {
        "framework": f"dapo-flow ({executor})", "step_seconds": step_s, "train_s": sum(step_s),
        "generated": summary["samples_generated"], "trained": steps * s["prompts_per_step"] * s["n"],
        "wall_s": wall, "val_acc_end": acc, "model_dir": str(ckpt), "torch_threads": threads,
    }


# ------------------------------------------------------------------------- TRL half


def trl_python() -> str | None:
    """An interpreter that can import trl: this one, else the benchmark venv."""
    if importlib.util.find_spec("trl") is not None:
        return sys.executable
    bench = BENCH_VENV / "bin" / "python"
    return str(bench) if bench.exists() else None


def run_trl(settings: dict, train, val, workdir: Path, console: Console) -> dict:
    from dapo_flow.core import columns as C

    python = trl_python()
    if python is None:
        raise SystemExit("TRL is not installed: run `python benchmarks/vs_trl.py --setup` first")
    out = workdir / "trl"
    out.mkdir(parents=True, exist_ok=True)
    cfg = {**settings, "out": str(out),
           "prompts": train.column(C.PROMPT_TEXT).to_pylist(),
           "answers": train.column(C.GROUND_TRUTH).to_pylist()}
    (out / "config.json").write_text(json.dumps(cfg))
    start = time.perf_counter()
    env = {**START_ENV, "PYTHONPATH": str(REPO) + os.pathsep + START_ENV.get("PYTHONPATH", "")}
    if settings.get("torch_threads"):
        env["OMP_NUM_THREADS"] = str(settings["torch_threads"])
    proc = subprocess.run([python, __file__, "--trl-worker", str(out / "config.json")], env=env)
    if proc.returncode != 0:
        raise SystemExit(f"the TRL worker failed (exit {proc.returncode}); see its output above")
    wall = time.perf_counter() - start
    res = json.loads((out / "result.json").read_text())
    with console.status("TRL: val acc of the saved model..."):
        acc = val_accuracy(res["model_dir"], val, settings["max_tokens"])
    return {"framework": f"TRL {res['trl_version']} GRPOTrainer", "step_seconds": res["step_seconds"],
            "train_s": sum(res["step_seconds"]), "generated": res["generated"], "trained": res["generated"],
            "wall_s": wall, "val_acc_end": acc, "model_dir": res["model_dir"],
            "torch_threads": res["torch_threads"]}


def trl_worker(config_path: str) -> int:
    """Runs inside the TRL interpreter: train, save the model, write result.json."""
    os.environ.update({"TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
                       "HF_DATASETS_DISABLE_PROGRESS_BARS": "1", "HF_HUB_OFFLINE": "1",
                       "TOKENIZERS_PARALLELISM": "false"})
    import warnings

    # trl warns at import that the installed vllm(-cpu) is newer than it supports: not used here
    warnings.filterwarnings("ignore", message="TRL currently supports vLLM")
    import datasets
    import torch
    import trl
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer

    from dapo_flow.algos import overlong_penalty
    from dapo_flow.data.tasks import verify_addition

    hf_logging.set_verbosity_error()
    datasets.disable_progress_bars()
    s = json.loads(Path(config_path).read_text())
    out = Path(s["out"])
    torch.manual_seed(s["seed"])
    if s.get("torch_threads"):
        torch.set_num_threads(s["torch_threads"])
    model = AutoModelForCausalLM.from_pretrained(s["model"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(s["model"])
    dataset = datasets.Dataset.from_dict({"prompt": s["prompts"], "ground_truth": s["answers"]})

    def correctness(completions, ground_truth, **_):
        return [verify_addition(c, g) for c, g in zip(completions, ground_truth)]

    reward_funcs = [correctness]
    if s["overlong"]:
        def overlong(completion_ids, **_):  # DAPO eq. 13 on the same token counts (EOS included)
            return overlong_penalty([len(c) for c in completion_ids], **s["overlong"]).tolist()

        reward_funcs.append(overlong)

    mb = s["mini_batches"]
    args = GRPOConfig(
        output_dir=str(out / "trainer"), use_cpu=True, bf16=False, fp16=False, seed=s["seed"],
        max_steps=s["steps"] * mb,  # optimizer steps: mini_batches per generation batch
        per_device_train_batch_size=s["prompts_per_step"] * s["n"] // mb,
        steps_per_generation=mb, gradient_accumulation_steps=1, num_iterations=1,
        num_generations=s["n"], max_completion_length=s["max_tokens"],
        temperature=s["temperature"], top_p=1.0, top_k=0,
        beta=0.0, loss_type="dapo", epsilon=s["clip_low"], epsilon_high=s["clip_high"],
        delta=s["clip_c"], scale_rewards="group", mask_truncated_completions=False,
        learning_rate=s["lr"], weight_decay=s["weight_decay"], max_grad_norm=s["grad_clip"],
        lr_scheduler_type="constant_with_warmup", warmup_steps=s["warmup_steps"] * mb,
        use_vllm=False, report_to="none", logging_strategy="no", save_strategy="no",
        disable_tqdm=True, log_completions=False, dataloader_num_workers=0,
    )

    class Timer(TrainerCallback):
        """Seconds per optimizer step: generation (when due), logprobs, loss, backward, step."""

        def __init__(self, progress, task):
            self.progress, self.task, self.seconds, self.t0 = progress, task, [], 0.0

        def on_step_begin(self, *_, **__):
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, *_, **__):
            self.seconds.append(time.perf_counter() - self.t0)
            self.progress.update(self.task, completed=state.global_step // mb)

    progress = Progress(TextColumn("[bold]TRL GRPO"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with progress:
        task = progress.add_task("trl", total=s["steps"])
        timer = Timer(progress, task)
        trainer = GRPOTrainer(model=model, reward_funcs=reward_funcs, args=args, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[timer])
        trainer.remove_callback(PrinterCallback)  # it prints the final metrics dict
        trainer.train()
    model_dir = out / "model"
    trainer.save_model(str(model_dir))
    tokenizer.save_pretrained(str(model_dir))
    # one RL step = mini_batches optimizer steps; generation happens in the first of them
    per_rl_step = [sum(timer.seconds[i : i + mb]) for i in range(0, len(timer.seconds), mb)]
    (out / "result.json").write_text(json.dumps({
        "step_seconds": per_rl_step, "generated": s["steps"] * s["prompts_per_step"] * s["n"],
        "model_dir": str(model_dir), "trl_version": trl.__version__, "torch_threads": torch.get_num_threads(),
    }))
    return 0


# ------------------------------------------------------------------------- --setup


def setup(console: Console) -> int:
    """Install TRL where it cannot disturb the main venv's torch / transformers."""
    if importlib.util.find_spec("trl") is not None:
        console.print(f"trl is already importable from {sys.executable}")
        return 0
    report = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--quiet",
                             "--report", "-", "trl"], capture_output=True, text=True, check=True)
    changes = {i["metadata"]["name"].lower(): i["metadata"]["version"]
               for i in json.loads(report.stdout).get("install", [])}
    console.print(f"`pip install trl` would install: {changes}")
    from packaging.version import Version

    bad = [f"{k} -> {changes[k]}" for k, v in KEEP_VERSIONS.items() if k in changes and changes[k] != v]
    tf = changes.get("transformers")
    if tf and not Version(TRANSFORMERS_RANGE[0]) <= Version(tf) < Version(TRANSFORMERS_RANGE[1]):
        bad.append(f"transformers -> {tf}")
    if not bad:
        subprocess.run([sys.executable, "-m", "pip", "install", "trl"], check=True)
        console.print("installed trl into this venv (torch and transformers unchanged)")
        return 0
    console.print(f"trl would change {bad}: installing it into {BENCH_VENV} instead")
    if not (BENCH_VENV / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(BENCH_VENV)], check=True)
    pip = str(BENCH_VENV / "bin" / "pip")
    subprocess.run([pip, "install", "-e", str(REPO), "trl"], check=True)
    return 0


# ------------------------------------------------------------------------- report


def report(console: Console, setting: str, settings: dict, start_acc: float, rows: list[dict]) -> dict:
    t = Table(title=f"dapo-flow vs TRL, setting '{setting}': {settings['prompts_per_step']} prompts x "
                    f"{settings['n']} samples, {settings['steps']} steps, max {settings['max_tokens']} tokens")
    for col in ("framework", "train s", "generated", "completions/s", "trained/s", "val acc",
                "gain/1k gen", "wall s", "load"):
        t.add_column(col, justify="left" if col == "framework" else "right")
    for r in rows:
        r["completions_per_s"] = r["generated"] / r["train_s"]
        r["trained_per_s"] = r["trained"] / r["train_s"]
        r["val_acc_start"] = start_acc
        r["val_gain_per_1k_generated"] = (r["val_acc_end"] - start_acc) / r["generated"] * 1000
        t.add_row(r["framework"], f"{r['train_s']:.1f}", str(r["generated"]), f"{r['completions_per_s']:.0f}",
                  f"{r['trained_per_s']:.0f}", f"{start_acc:.3f} -> {r['val_acc_end']:.3f}",
                  f"{r['val_gain_per_1k_generated']:+.4f}", f"{r['wall_s']:.0f}", fmt(r.get("load_avg"), ".1f"))
    console.print(t)
    console.print("torch threads: " + ", ".join(f"{r['framework']} {r['torch_threads']}" for r in rows))
    samples = VAL_PROMPTS * VAL_N
    stderr = (start_acc * (1 - start_acc) / samples) ** 0.5
    console.print("[dim]train s: sum of RL step times (start-up, validation, saving excluded); "
                  "trained/s: prompts x n x steps / train s; gain/1k gen: val-acc gain per 1000 "
                  f"generated completions (val acc over {samples} samples: std error ~{stderr:.3f}); "
                  "load: 1-min load average during the half[/]")
    flow, trl = rows
    speed = flow["completions_per_s"] / trl["completions_per_s"]
    trained = flow["trained_per_s"] / trl["trained_per_s"]
    met = trained >= TARGETS[setting]
    colour = "green" if met else "red"
    console.print(f"dapo-flow / TRL trained completions/s: [{colour}]{trained:.2f}x[/] (target >= "
                  f"{TARGETS[setting]:.1f}x: {'met' if met else 'NOT met'}); completions/s: {speed:.2f}x; "
                  f"val-acc gain per generated sample: "
                  f"{_ratio(flow['val_gain_per_1k_generated'], trl['val_gain_per_1k_generated'])}")
    console.print("[bold]remaining differences[/] (same otherwise: model, prompts, n, max tokens, "
                  "temperature 1, clips 0.2/0.28, lr, AdamW, grad clip, no KL, group-normalized "
                  "advantages, correctness +/-1 plus the soft overlong penalty as reward):")
    for d in differences(settings):
        console.print(f"  - {d}")
    return {"completions_per_s_ratio": speed, "trained_per_s_ratio": trained, "target": TARGETS[setting],
            "target_met": met}


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 and a > 0 else f"{a:+.4f} vs {b:+.4f} per 1k"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setting", choices=sorted(SETTINGS), default="default",
                    help="default: the graph's 24 prompts x 8; big: 32 prompts x 16")
    ap.add_argument("--steps", type=int, default=30, help="RL steps for each framework (default 30)")
    ap.add_argument("--quick", action="store_true", help="smoke test: 3 steps")
    ap.add_argument("--executor", choices=("ray", "local"), default="ray",
                    help="dapo-flow executor (default ray, as `dapo-flow run`)")
    ap.add_argument("--torch-threads", type=int, metavar="N",
                    help="torch threads for both frameworks (default: each one's own choice; dapo-flow "
                         "decides per process in dapo_flow/threads.py, TRL leaves torch's default, all CPUs)")
    ap.add_argument("--graph", default=str(DEFAULT_GRAPH), help="graph YAML (default graphs/dapo.yaml)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="extra_sets",
                    help="an extra edit of dapo-flow's graph that TRL has no counterpart for "
                         "(e.g. models.policy.train.workers=2); repeatable")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--workdir", help="keep runs, checkpoints and the TRL model here (default: temp dir)")
    ap.add_argument("--setup", action="store_true", help="install TRL (see benchmarks/README.md) and exit")
    ap.add_argument("--trl-worker", metavar="CONFIG", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.trl_worker:
        return trl_worker(args.trl_worker)
    console = make_console()
    if args.setup:
        return setup(console)
    steps = 3 if args.quick else args.steps
    sets = SETTINGS[args.setting] + args.extra_sets
    from dapo_flow.graph.edits import edit_file, parse_cli_edits

    placed = edit_file(args.graph, parse_cli_edits([("set", e) for e in sets])).compile()
    settings = {**comparable_settings(placed, steps), "torch_threads": args.torch_threads}
    if args.torch_threads:
        pin_torch_threads(args.torch_threads)
    train = load_split(settings["model"], "train", None, settings["seed"])
    val = load_split(settings["model"], "val", VAL_PROMPTS, settings["seed"])
    with console.status("val acc of the base model..."):
        start_acc = val_accuracy(settings["model"], val, settings["max_tokens"])
    console.print(f"base model val acc (avg@{VAL_N}, T={VAL_TEMPERATURE}, {val.num_rows} prompts): {start_acc:.3f}")
    with scratch_dir(args.workdir, console) as workdir:
        console.rule(f"[bold]dapo-flow[/] ({args.executor}): {steps} steps")
        with LoadSampler() as load:
            flow = run_dapo_flow(Path(args.graph), sets, steps, args.executor, val, console)
        flow["load_avg"] = load.mean
        console.rule(f"[bold]TRL GRPOTrainer[/]: {steps} steps")
        with LoadSampler() as load:
            trl = run_trl(settings, train, val, workdir, console)
        trl["load_avg"] = load.mean
        console.rule("[bold]results")
        verdict = report(console, args.setting, settings, start_acc, [flow, trl])
    write_json(args.json, {"setting": args.setting, "graph_edits": sets, "settings": settings, "val_acc_start": start_acc,
                           "results": [flow, trl], "differences": differences(settings), **verdict}, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
