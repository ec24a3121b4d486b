"""Runs a placed plan: `execute(placed, executor="ray"|"local", ...)`.

Submodules: setup (plan -> worker setups), worker (StageWorker), executors (local, Ray),
loop (the RL phases), session (tracking, checkpoints, progress around the loop), evaluate
(`dapo-flow eval`: a checkpoint on validation prompts).
"""

from __future__ import annotations


def execute(placed, *, executor: str = "ray", address: str | None = None, resume: bool = False,
            steps: int | None = None, console=None, run_name: str | None = None,
            parent_run_id: str | None = None, extra_params: dict | None = None,
            extra_artifacts: dict | None = None) -> dict:
    """Run the graph; returns a summary dict (run id, metrics, wall time).

    ``run_name`` / ``parent_run_id`` / ``extra_params`` (str -> str) let a sweep make
    each variant an MLflow child run; ``extra_artifacts`` maps artifact names to text.
    """
    from dapo_flow.runtime.session import run_session

    return run_session(placed, executor=executor, address=address, resume=resume,
                       steps=steps, console=console, run_name=run_name,
                       parent_run_id=parent_run_id, extra_params=extra_params or {},
                       extra_artifacts=extra_artifacts or {})
