"""What the gpu tests share: the device they target, graph runs as `dapo-flow run --executor
local` makes them, a small graph, the CLI in a process that sees no GPU, and a record of the
policies a run builds (so a test can say where its models ran)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
GRAPHS = ROOT / "graphs"
#: `cpu` runs the gpu tests on the CPU (a rehearsal of the tests on a machine without a GPU)
DEVICE_ENV = "DAPO_FLOW_TEST_DEVICE"


def target_device() -> torch.device:
    """CUDA, or the CPU under ``DAPO_FLOW_TEST_DEVICE=cpu``."""
    return torch.device(os.environ.get(DEVICE_ENV, "cuda"))


def run_graph(graph: Path | str, flags: list[tuple[str, str]], *, console, steps: int | None = None,
              resume: bool | str = False) -> tuple[dict, object]:
    """``dapo-flow run GRAPH --executor local [--steps N] [--resume RUN] --set ...`` in this
    process, as the CLI runs it (edits, this machine's cluster, the local executor); returns
    (the run's summary, the placed plan)."""
    from dapo_flow.graph.edits import edit_file, parse_cli_edits
    from dapo_flow.graph.registry import load_plugins
    from dapo_flow.runtime import execute

    load_plugins()
    edited = edit_file(str(graph), parse_cli_edits(flags))
    placed = edited.compile()
    summary = execute(placed, executor="local", steps=steps, resume=resume, console=console,
                      extra_params=edited.params() if edited.edits else {})
    return summary, placed


def history(summary: dict) -> dict[str, list[tuple[int, float]]]:
    """metric -> [(step, value)] of a run, from its MLflow store."""
    from dapo_flow.tracking import read_run

    return read_run(summary["tracking_uri"], summary["run_id"])["history"]


def cli_without_gpu(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    """``dapo-flow ARGS`` in a fresh process that sees no GPU (CUDA_VISIBLE_DEVICES empty): a CPU
    machine, as far as torch can tell, e.g. a head node resuming a run a GPU worker trained."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.run([sys.executable, "-m", "dapo_flow.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def devices_of(policies: list) -> set[str]:
    """The device types the recorded policies' weights are on."""
    return {p.device.type for p in policies} | {t.device.type for p in policies for t in p.model.parameters()}


SMALL = """\
name: {name}
seed: 0
models:
  policy: {{path: "builtin:tiny-adder", backend: hf{train}}}
data:
  train: {{source: "builtin:addition", split: train}}
  val: {{source: "builtin:addition", split: val, size: 16}}
run: {{steps: {steps}, prompts_per_step: 4, gen_prompts_per_batch: 8, val_every: 2, val_n: 1, val_temperature: 0.0, checkpoint_every: {ckpt}, chunk_prompts: 4}}
tracking: {{experiment: gpu-tests}}
nodes:
  - {{id: rollout, op: generate, model: policy, inputs: [prompts], params: {{n: 4, max_tokens: 8}}}}
  - {{id: verify, op: score, inputs: [rollout], params: {{correct: 1.0, wrong: -1.0}}}}
  - {{id: overlong, op: overlong-shape, inputs: [verify], params: {{max_len: 8, buffer_len: 4}}}}
  - {{id: filter, op: group-filter, inputs: [overlong], params: {{metric: acc, max_gen_batches: 10, on_cap: train-on-what-we-have}}}}
  - {{id: old_logp, op: logprob, model: policy, inputs: [filter]}}
  - {{id: adv, op: advantage, inputs: [old_logp]}}
  - {{id: train, op: update, model: policy, inputs: [adv], params: {{lr: 1.0e-4, mini_batches: 2}}}}
"""


def small_graph(directory: Path, *, name: str = "small", steps: int = 3, ckpt: int = 2,
                mixed_precision: str | None = None) -> Path:
    """A small DAPO graph on builtin:tiny-adder (4 prompts x 4 samples a step), one worker."""
    train = f", train: {{mixed_precision: {mixed_precision}}}" if mixed_precision else ""
    path = directory / f"{name}.yaml"
    path.write_text(SMALL.format(name=name, steps=steps, ckpt=ckpt, train=train))
    return path
