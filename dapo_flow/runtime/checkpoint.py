"""Checkpoints: model weights, optimizer/scheduler/op states, data cursor, RNG, MLflow run id,
and the kept groups carried to the next step (run.carry_surplus) as an Arrow IPC file.

Written to a temporary folder and renamed into place, so a crash mid-write never leaves a
checkpoint that looks complete. `latest()` finds the newest complete one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch

from dapo_flow.errors import RunError

DRIVER_FILE = "driver.json"
OPS_FILE = "ops.pt"
CARRY_FILE = "carry.arrow"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def save(root: Path, step: int, *, driver: dict[str, Any], op_states: dict[str, Any],
         save_models, carry: pa.Table | None = None) -> Path:
    """``save_models(dir)`` writes the trained models' HF directories into ``dir``;
    ``carry`` is the table of groups carried over to the next step, if any."""
    final = step_dir(root, step)
    tmp = root / f".tmp_step_{step:06d}"
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "models").mkdir(parents=True)
        save_models(tmp / "models")
        torch.save(op_states, tmp / OPS_FILE)
        if carry is not None:
            with pa.OSFile(str(tmp / CARRY_FILE), "wb") as sink, pa.ipc.new_file(sink, carry.schema) as out:
                out.write_table(carry)
        (tmp / DRIVER_FILE).write_text(json.dumps(driver, indent=2))
    except OSError as exc:  # disk full, quota, permissions: the previous checkpoint stays whole
        shutil.rmtree(tmp, ignore_errors=True)
        before = latest(root)
        raise RunError(
            f"could not write checkpoint {final}: {exc.strerror or exc}\n    the previous checkpoint "
            f"{'is ' + str(before) if before else 'does not exist'} (intact)\n    fix: free space "
            f"under {root} (run.keep_checkpoints bounds it), then `dapo-flow run GRAPH --resume`"
        ) from exc
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints under ``root``; returns what went.
    Oldest first, so a crash part-way leaves the newest ones."""
    gone = _complete(root)[:-keep] if keep > 0 else []
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


def latest(root: Path) -> Path | None:
    done = _complete(root)
    return done[-1] if done else None


def _complete(root: Path) -> list[Path]:
    """The complete checkpoints under ``root`` (driver file written last), oldest first."""
    return sorted(p for p in root.glob("step_*") if (p / DRIVER_FILE).is_file())


def load_driver(path: Path) -> dict[str, Any]:
    """The driver state alone (step, sampler, MLflow run id, graph, ...): no tensors loaded."""
    return json.loads((path / DRIVER_FILE).read_text())


def load(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    driver = load_driver(path)
    ops = torch.load(path / OPS_FILE, weights_only=False)
    return driver, ops


def load_carry(path: Path) -> pa.Table | None:
    """The carried-over groups saved with the checkpoint (None when there were none)."""
    if not (path / CARRY_FILE).is_file():
        return None
    with pa.memory_map(str(path / CARRY_FILE)) as source:
        return pa.ipc.open_file(source).read_all()
