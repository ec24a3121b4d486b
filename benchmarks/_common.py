"""Shared pieces of the benchmark scripts: a scratch working directory, running a graph
with edits, reading per-step timings back from MLflow, writing the result JSON, and a
random-init Qwen2 model built from a config.

Not a public API: only `benchmarks/*.py` import it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator, Sequence

from rich.console import Console

REPO = Path(__file__).resolve().parent.parent
DEFAULT_GRAPH = REPO / "graphs" / "dapo.yaml"


@contextlib.contextmanager
def scratch_dir(keep: str | None, console: Console) -> Iterator[Path]:
    """cd into ``keep`` (created, kept) or a fresh temp dir (removed at exit): the MLflow
    store and checkpoints land under ./dapo-flow-runs of the working directory."""
    old = Path.cwd()
    path = Path(keep).resolve() if keep else Path(tempfile.mkdtemp(prefix="dapo-flow-bench-"))
    path.mkdir(parents=True, exist_ok=True)
    console.print(f"[dim]working directory: {path}[/]")
    os.chdir(path)
    try:
        yield path
    finally:
        os.chdir(old)
        if not keep:
            shutil.rmtree(path, ignore_errors=True)


def run_graph(graph: Path, sets: Sequence[str], *, executor: str, steps: int,
              console: Console, cluster: Any = None, address: str | None = None) -> tuple[dict, Any]:
    """Compile ``graph`` with ``--set`` edits and run it; returns (summary, placed plan).
    ``cluster`` (a ``Cluster``; default this machine) and ``address``: a Ray cluster to run on."""
    from dapo_flow.graph.edits import edit_file, parse_cli_edits
    from dapo_flow.graph.registry import load_plugins
    from dapo_flow.runtime import execute

    load_plugins()
    edited = edit_file(graph, parse_cli_edits([("set", s) for s in sets]))
    placed = edited.compile(cluster)
    summary = execute(placed, executor=executor, steps=steps, console=console, address=address,
                      run_name=f"bench-{executor}", extra_params=edited.params())
    return summary, placed


def step_history(summary: dict) -> dict[str, dict[int, float]]:
    """metric -> {step: value} of a finished run (from its MLflow store)."""
    from dapo_flow.tracking import read_run

    run = read_run(summary["tracking_uri"], summary["run_id"])
    return {key: dict(points) for key, points in run["history"].items()}


def final_checkpoint(summary: dict, placed, model: str = "policy") -> Path:
    """HF directory of ``model`` in the run's last checkpoint (one folder per run id); a sharded
    checkpoint (a training group's) is exported beside it first, as `dapo-flow export` does."""
    from dapo_flow.runtime.checkpoint import step_dir
    from dapo_flow.runtime.checkpoint_models import LORA, SHARDED, checkpoint_format
    from dapo_flow.runtime.export import export
    from dapo_flow.runtime.resume import checkpoint_root

    step = step_dir(checkpoint_root(placed.plan.spec) / summary["run_id"], summary["steps"])
    path = step / "models" / model
    if checkpoint_format(path) == LORA:  # adapters only: merged into their base, as `export` does
        exported = step.parent / f"{step.name}-{model}-merged"
        if not exported.is_dir():
            export(step, exported, model)
        return exported
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no checkpointed model at {path} (checkpoint_every must hit the last step)")
    if checkpoint_format(path) == SHARDED:
        exported = step.parent / f"{step.name}-{model}-hf"
        if not exported.is_dir():
            export(step, exported, model)
        return exported
    return path


def make_console() -> Console:
    """Wide enough for the result tables when the output goes to a file or pipe."""
    return Console() if sys.stdout.isatty() else Console(width=120)


def pin_torch_threads(n: int) -> None:
    """Experiment knob: give every model stage ``n`` torch threads instead of the library's
    rule (all CPUs split over the actors, dapo_flow/runtime/setup.py). Stage setups are built
    in the driver and shipped to the workers, so this reaches Ray actors and local stages."""
    from dapo_flow.runtime import setup

    setup._threads = lambda stage: n if stage.kind == "actor" else 0


def write_json(path: str | None, payload: dict, console: Console) -> None:
    if not path:
        return
    out = Path(path).expanduser().resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2, default=float) + "\n")
    console.print(f"wrote {out}")


def fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


class LoadSampler:
    """Mean 1-minute load average while the block runs (sampled every 2 s): a box busy with
    other work inflates every timing, and a ratio only if the load changed between runs."""

    def __init__(self, every_s: float = 2.0):
        import threading

        self.every_s, self.samples = every_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:
            self.samples.append(os.getloadavg()[0])
            if self._stop.wait(self.every_s):
                return

    def __enter__(self) -> "LoadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def mean(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples else None


def random_qwen2(out_dir: Path, shape: dict, tokenizer: Any, *, dtype: str = "float32",
                 max_positions: int = 512, seed: int = 0) -> dict:
    """A random-init (``seed``) Qwen2ForCausalLM of ``shape`` (hidden_size, num_hidden_layers,
    num_attention_heads, num_key_value_heads, intermediate_size, vocab_size), tied embeddings,
    saved with ``tokenizer`` into ``out_dir`` as a Hugging Face directory; returns its facts
    (parameters and bytes count the tied embedding once). vLLM's Qwen2 takes head_dim as
    hidden_size / num_attention_heads: keep it a size its CPU attention accepts (64, 128, ...)."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        **shape,
        max_position_embeddings=max_positions,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        use_sliding_window=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        architectures=["Qwen2ForCausalLM"],
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    params = {id(p): p for p in model.parameters()}.values()  # tied embeddings once
    return {
        "architecture": "Qwen2ForCausalLM", **shape,
        "head_dim": shape["hidden_size"] // shape["num_attention_heads"],
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": True, "dtype": dtype, "init": f"random, seed {seed}",
        "tokenizer_size": len(tokenizer),
        "num_parameters": sum(p.numel() for p in params),
        "model_bytes": sum(p.numel() * p.element_size() for p in params),
        "largest_tensor_bytes": max(p.numel() * p.element_size() for p in params),
    }


def proc_status(field: str) -> int:
    """Bytes of a /proc/self/status field (VmRSS, VmHWM): this process's memory, Linux only."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def run_variant_process(script: str, cfg: dict, *, threads: int, console: Console, what: str) -> dict:
    """``python SCRIPT --variant CFG`` in a fresh process (its own memory peak, its own torch
    threads) and the JSON it prints last; a failure prints its stderr and stops the benchmark."""
    import subprocess

    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MALLOC_MMAP_THRESHOLD_="65536")
    proc = subprocess.run([sys.executable, "-W", "ignore", script, "--variant", json.dumps(cfg)],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        console.print(proc.stderr[-3000:])
        raise SystemExit(f"{what} failed")
    return json.loads(proc.stdout.strip().splitlines()[-1])
