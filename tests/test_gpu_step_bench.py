"""Smoke test of benchmarks/gpu_step.py on the CPU: the --quick run (a tiny Qwen2 shape) finishes
and writes its JSON. No timing assertions (they depend on the box and mean little on a CPU); that
both sides did the same work, that the update trained (finite loss and gradient norm, nothing
skipped), and that the ratios and targets are there for a GPU run to report."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_step.py"


@pytest.mark.slow  # ~40 CPU s: a model built, one step through dapo-flow and the floor, the logprob bench
def test_gpu_step_quick_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu_step.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--reps", "1", "--device", "cpu",
                           "--json", str(out), "--workdir", str(tmp_path / "work")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["device"] == "cpu" and res["quick"] is True
    ours, floor = res["dapo_flow"], res["floor"]
    assert ours["response_tokens"] == floor["response_tokens"] > 0  # the same number of decoded tokens
    for key in ("rollout_s", "rollout_first_s", "logprob_s", "update_s", "step_s"):
        assert ours[key] > 0, key
    for key in ("generate_s", "generate_first_s", "logprob_s", "update_s", "step_s"):
        assert floor[key] > 0, key
    metrics = ours["update_metrics"]
    assert math.isfinite(metrics["actor/pg_loss"]) and 0 < metrics["actor/grad_norm"] < math.inf
    assert metrics["actor/skipped_steps"] == 0 and metrics["actor/skipped_minibatches"] == 0
    assert set(res["ratios"]) == {"rollout", "logprob", "update", "chunked_logprob_time"}
    assert all(v > 0 for v in res["ratios"].values())
    assert {"update_ratio_max", "rollout_ratio_max", "chunked_logprob_time_ratio_max"} <= set(res["targets"])
    # the estimates `explain` would print for these shapes; no peak to compare with on a CPU
    estimates = res["memory_estimates"]
    assert estimates["update_bytes"] > estimates["update_terms"]["parameters"] > 0
    assert estimates["rollout_terms"]["KV cache"] > 0
    assert estimates["update_ratio"] is None and res["targets"]["memory_estimate_met"] is None
