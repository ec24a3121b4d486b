"""Smoke test of benchmarks/generation.py: the --quick run finishes and writes its JSON.

No timing assertions (they depend on the box); only that both sides generated what was asked
(prompts x n samples, the same token budget) and the figures exist. The quick setting puts
16 x 8 prompts of 58 tokens (7.4k prompt tokens) into one call, more than one vLLM-CPU step
takes (4096): with chunked prefill, the engine's seeded requests died there (vllm_engine.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "generation.py"


@pytest.mark.vllm
@pytest.mark.slow  # ~50 s on 2 loaded cores: one process starts two vLLM engines
def test_generation_quick(tmp_path: Path) -> None:
    pytest.importorskip("vllm")
    out = tmp_path / "generation.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--json", str(out), "--workdir", str(tmp_path / "work")],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    for key in ("tokens_per_s", "direct_tokens_per_s", "ratio", "params", "load"):
        assert isinstance(res[key], (int, float)) and res[key] > 0, (key, res[key])
    s = res["settings"]
    assert sum(s["prompt_lens"]) * s["n"] > res["engines"]["dapo-flow"]["max_num_batched_tokens"]
    assert not res["engines"]["dapo-flow"]["enable_chunked_prefill"]
    budget = s["prompts"] * s["n"] * s["max_tokens"]
    for r in res["rounds"]:
        for side in ("direct", "dapo-flow"):
            assert 0.9 * budget <= r[side]["tokens"] <= budget, (side, r[side]["tokens"], budget)
