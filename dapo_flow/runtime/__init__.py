"""Runs a placed plan: `execute(placed, executor="ray"|"local", ...)`.

Submodules: setup (plan -> worker setups), worker (StageWorker), executors (local, Ray),
loop (the RL phases), session (tracking, checkpoints, progress around the loop).
"""

from __future__ import annotations


def execute(placed, *, executor: str = "ray", address: str | None = None, resume: bool = False,
            steps: int | None = None, console=None) -> dict:
    """Run the graph; returns a summary dict (run id, metrics, wall time)."""
    from dapo_flow.runtime.session import run_session

    return run_session(placed, executor=executor, address=address, resume=resume,
                       steps=steps, console=console)
