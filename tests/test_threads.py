"""dapo_flow.threads: one thread budget per process, nested OpenMP off.

The process-wide pieces (numba's threading layer is fixed at its first launch; libgomp's
state is per process) are checked in fresh subprocesses.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from dapo_flow import threads
from dapo_flow.errors import DapoFlowError


def run_python(code: str, env: dict | None = None, unset: tuple[str, ...] = ()) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON line, returned parsed."""
    import os

    child_env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k not in unset}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, env=child_env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(120)
def test_configure_turns_off_the_nesting_numbas_openmp_layer_turns_on():
    # the suite's 27-minute test: numba's OpenMP layer calls omp_set_nested(1) on torch's libgomp,
    # then SDPA -> MKL sgemm opened a second level of threads
    out = run_python("""
        import json, numba, numpy as np, torch
        from dapo_flow import threads

        @numba.njit(parallel=True)
        def bump(a):
            for i in numba.prange(a.shape[0]):
                a[i] += 1

        bump(np.zeros(1000))
        before = threads.openmp_nested()
        threads.configure(1)
        bump(np.zeros(1000))  # numba turns nesting on once, at its first launch
        print(json.dumps({"layer": numba.threading_layer(), "before": before,
                          "after": threads.openmp_nested(), "torch": torch.get_num_threads()}))
    """, env={"NUMBA_THREADING_LAYER": "omp"}, unset=("OMP_MAX_ACTIVE_LEVELS",))
    assert out == {"layer": "omp", "before": True, "after": False, "torch": 1}


@pytest.mark.timeout(120)
def test_numba_loaded_by_another_library_runs_on_its_own_pool_and_leaves_torchs_openmp_alone():
    out = run_python("""
        import json, os, numba, numpy as np, torch
        from dapo_flow import threads

        assert "NUMBA_THREADING_LAYER" not in os.environ
        threads.configure(2)  # numba is loaded (as vLLM loads it): its layer is set before its first launch
        torch.set_num_threads = lambda n: None  # what vLLM's CPU worker leaves behind

        @numba.njit(parallel=True)
        def bump(a):
            for i in numba.prange(a.shape[0]):
                a[i] += 1.0

        bump(np.zeros(100_000))
        print(json.dumps({"layer": numba.threading_layer(), "nested": threads.openmp_nested(),
                          "torch": torch.get_num_threads(), "numba": numba.get_num_threads()}))
    """, unset=("NUMBA_THREADING_LAYER", "OMP_NUM_THREADS"))
    assert out == {"layer": threads.NUMBA_LAYER, "nested": False, "torch": 2, "numba": 2}


def test_configure_sets_torch_threads_even_where_vllm_made_the_setter_a_no_op(monkeypatch):
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # vLLM's CPU worker does this
    before = torch.get_num_threads()
    try:
        assert threads.configure(1) == 1
        assert torch.get_num_threads() == 1
        assert threads.openmp_nested() is False
    finally:
        torch._C.set_num_threads(before)


def test_configure_exports_the_budget_to_child_processes(monkeypatch):
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_MAX_ACTIVE_LEVELS"):
        monkeypatch.delenv(var, raising=False)
    before = torch.get_num_threads()
    try:
        threads.configure(0)  # at least one thread
        assert torch.get_num_threads() == 1
    finally:
        torch._C.set_num_threads(before)
    import os

    assert [os.environ[v] for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")] == ["1"] * 3
    assert os.environ["OMP_MAX_ACTIVE_LEVELS"] == "1"


def test_numpy_blas_follows_the_budget():
    import threadpoolctl  # a dependency: a broken install fails here, it is not skipped

    before = torch.get_num_threads()
    try:
        threads.configure(1)
        blas = [p for p in threadpoolctl.threadpool_info() if p["user_api"] == "blas"]
        assert blas and all(p["num_threads"] == 1 for p in blas), blas  # numpy's OpenBLAS at least
    finally:
        threads.configure(before)


def test_a_broken_threadpoolctl_is_an_error(monkeypatch):
    # without it numpy's BLAS kept a thread per core beside torch's, silently
    monkeypatch.setitem(sys.modules, "threadpoolctl", None)  # what `import threadpoolctl` fails on
    before = torch.get_num_threads()
    try:
        with pytest.raises(DapoFlowError, match=r"threadpoolctl, a dependency of dapo-flow.*reinstall dapo-flow"):
            threads.configure(1)
    finally:
        monkeypatch.undo()
        threads.configure(before)


def test_a_stage_worker_applies_its_stages_budget():
    from dapo_flow.runtime.worker import StageSetup, StageWorker
    from dapo_flow.graph.spec import GraphSpec

    before = torch.get_num_threads()
    graph = GraphSpec.model_construct(models={})
    try:
        StageWorker(graph, StageSetup("model:policy", (), (), num_threads=1), seed=0)
        assert torch.get_num_threads() == 1
        assert threads.openmp_nested() is False
    finally:
        threads.configure(before)


def test_the_driver_gets_its_stages_cpus():
    from pathlib import Path

    from dapo_flow.graph.compiler import compile_graph
    from dapo_flow.graph.plan import Cluster
    from dapo_flow.runtime.setup import driver_threads

    placed = compile_graph(Path(__file__).resolve().parents[1] / "graphs" / "dapo.yaml", Cluster(cpus=2))
    assert driver_threads(placed) == 1


def test_the_tiny_adder_build_gets_its_one_thread_after_vllm_made_the_setter_a_no_op(monkeypatch):
    from dapo_flow.recipes.warm_start import deterministic_torch

    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # an in-process vLLM engine ran
    before = torch.get_num_threads()
    threads.configure(2)
    try:
        with deterministic_torch(seed=0):
            assert torch.get_num_threads() == 1  # the recipe's weights depend on it
        assert torch.get_num_threads() == 2
    finally:
        threads.configure(before)
