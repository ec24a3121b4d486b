"""Smoke test of benchmarks/table_transport.py --quick: both ways move both tables (put, get and
an actor call that reads one and stores another) and the JSON holds every figure the README's
table reads. No timing assertions (they depend on the box)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "table_transport.py"


@pytest.mark.slow  # a Ray start-up and 2 x 2 x 3 blocks of 20 repetitions: ~10 s on 2 cores
def test_table_transport_quick(tmp_path: Path) -> None:
    out = tmp_path / "table_transport.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", str(out)], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res["tables"]) == {"main", "long"} and res["reps"] == 20
    for name, rows in (("main", 48 * 8), ("long", 32 * 16)):
        table = res["tables"][name]
        assert table["rows"] == rows and table["bytes"] > 0
        for way in ("ray", "ipc"):
            assert all(table[way][op] > 0 for op in ("put", "get", "call")), (name, way)
        assert all(table["ratio"][op] > 0 for op in ("put", "get", "call"))
