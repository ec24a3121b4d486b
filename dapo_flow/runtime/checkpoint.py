"""Checkpoints: model weights, optimizer/scheduler/op states, data cursor, RNG, MLflow run id.

Written to a temporary folder and renamed into place, so a crash mid-write never leaves a
checkpoint that looks complete. `latest()` finds the newest complete one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

DRIVER_FILE = "driver.json"
OPS_FILE = "ops.pt"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def save(root: Path, step: int, *, driver: dict[str, Any], op_states: dict[str, Any],
         save_models) -> Path:
    """``save_models(dir)`` writes the trained models' HF directories into ``dir``."""
    final = step_dir(root, step)
    tmp = root / f".tmp_step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "models").mkdir(parents=True)
    save_models(tmp / "models")
    torch.save(op_states, tmp / OPS_FILE)
    (tmp / DRIVER_FILE).write_text(json.dumps(driver, indent=2))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    return final


def latest(root: Path) -> Path | None:
    done = sorted(p for p in root.glob("step_*") if (p / DRIVER_FILE).is_file())
    return done[-1] if done else None


def load(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    driver = json.loads((path / DRIVER_FILE).read_text())
    ops = torch.load(path / OPS_FILE, weights_only=False)
    return driver, ops
