"""Smoke test of benchmarks/logprob_memory.py: the --quick run finishes and writes its JSON.

No timing or memory-target assertions (those depend on the box); only that the figures exist,
are positive, and that naive and chunked logprobs / entropy / gradients agree.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "logprob_memory.py"


@pytest.mark.slow  # ~20 s on 2 cores: three processes import torch
def test_logprob_memory_quick(tmp_path: Path) -> None:
    out = tmp_path / "logprob_memory.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--reps", "1", "--device", "cpu", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    for key in ("naive_peak_bytes", "chunked_peak_bytes", "peak_ratio", "time_ratio", "rows", "tokens",
                "vocab", "hidden", "chunk_tokens"):
        assert isinstance(res[key], (int, float)) and res[key] > 0, (key, res[key])
    assert res["naive_skipped"] is None
    assert set(res["diffs"]) == {"logp", "entropy", "grad_hidden", "grad_weight"}
    assert 0 <= res["max_abs_diff"] < 1e-4, res["diffs"]
