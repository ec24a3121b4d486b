"""What a stage worker imports: the driver stage's worker (score, shaping, filters, advantages),
which Ray starts in an actor of its own for every run, loads no model library, and a library a
model's worker loads after it still runs quietly."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a process of its own (~3 s): only a fresh process shows what is imported
def test_the_driver_stages_worker_loads_no_model_library_and_transformers_stays_quiet(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        from dapo_flow.graph.compiler import compile_graph
        from dapo_flow.graph.plan import DRIVER, Cluster
        from dapo_flow.runtime.setup import stage_setups
        from dapo_flow.runtime.worker import StageWorker

        placed = compile_graph({str(ROOT / "graphs" / "dapo.yaml")!r}, Cluster(cpus=2))
        setup = stage_setups(placed)[DRIVER]
        worker = StageWorker(placed.plan.spec, setup, 0)
        print("ops:", sorted(worker.ops))
        print("loaded:", [m for m in ("transformers", "vllm", "peft") if m in sys.modules])
        from transformers.utils import logging
        print("quiet:", logging.get_verbosity() == logging.ERROR, not logging.is_progress_bar_enabled())
        """)
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRANSFORMERS_VERBOSITY", "HF_HUB_DISABLE_PROGRESS_BARS")}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "'verify'" in r.stdout and "'dynamic_sampling'" in r.stdout, r.stdout  # the driver stage's nodes
    assert "loaded: []" in r.stdout, r.stdout
    assert "quiet: True True" in r.stdout, r.stdout
