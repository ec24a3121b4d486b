"""Smoke test of benchmarks/packing.py: the --quick run finishes and writes its JSON, and the
padded and packed passes compute the same logprobs. No speed assertion (it depends on the box)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "packing.py"


@pytest.mark.slow  # ~20 s on 2 cores: three processes import torch (one spread of the two)
def test_packing_bench_quick(tmp_path: Path) -> None:
    out = tmp_path / "packing.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--rows", "16", "--reps", "1", "--spreads",
                           "long_tail", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    for key in ("speedup_long_tail", "peak_ratio"):
        assert res[key] > 0, (key, res[key])
    assert "speedup_chat" not in res  # only the spreads asked for
    assert 0 <= res["max_abs_logp_diff"] < 1e-4
    for spread in ("long_tail",):
        padded, packed = res["runs"][spread]["padded"], res["runs"][spread]["packed"]
        assert padded["tokens"] == packed["tokens"] > 0  # the same rows, credited alike
