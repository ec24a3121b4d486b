"""Smoke test of benchmarks/sandbox.py: one repetition finishes, checks the outputs equal across
isolation settings itself, and writes its JSON. No timing assertions (they depend on the box)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "sandbox.py"


def test_sandbox_bench_one_repetition(tmp_path: Path) -> None:
    out = tmp_path / "sandbox.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--reps", "1", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    for program in ("print", "primes", "burst"):
        assert set(res[program]["median_s"]) == {"none", "bwrap"}
        assert all(v > 0 for v in res[program]["median_s"].values()), res[program]
        assert res[program]["ratio_bwrap_over_none"] > 0
