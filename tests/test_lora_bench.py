"""Smoke test of benchmarks/lora.py: the --quick run finishes and writes its JSON, and LoRA
trains a fraction of the parameters. No timing or memory-target assertions (they depend on the
box): only that every figure exists and is positive."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "lora.py"


@pytest.mark.slow  # ~20 s on 2 cores: four processes import torch
def test_lora_bench_quick(tmp_path: Path) -> None:
    out = tmp_path / "lora.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--ranks", "8", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    full, lora = res["variants"]
    assert (full["rank"], lora["rank"]) == (0, 8)
    assert full["trained_params"] == res["model"]["num_parameters"]
    assert 0 < lora["trained_params"] < 0.2 * full["trained_params"]
    for variant in (full, lora):
        for key in ("step_s", "first_step_s", "peak_bytes", "estimate_bytes", "estimate_ratio"):
            assert variant[key] > 0, (key, variant)
    assert set(res["peak_ratio_lora"]) == set(res["step_ratio_lora"]) == {"r8"}
