"""Runs a placed plan: `execute(placed, executor="ray"|"local", ...)`.

Submodules: setup (plan -> worker setups), worker (StageWorker), executors (local, Ray),
loop (the RL phases), session (tracking, checkpoints, progress around the loop), evaluate
(`dapo-flow eval`: a checkpoint on validation prompts).
"""

from __future__ import annotations


def execute(placed, *, executor: str = "ray", address: str | None = None, resume: bool | str = False,
            steps: int | None = None, console=None, run_name: str | None = None,
            parent_run_id: str | None = None, extra_params: dict | None = None,
            artifacts: dict | None = None) -> dict:
    """Run the graph; returns a summary dict (run id, metrics, wall time).

    ``resume``: True continues the graph's newest unfinished run from its last intact
    checkpoint, a run id that run (see :mod:`dapo_flow.runtime.resume`).

    ``run_name`` / ``parent_run_id`` / ``extra_params`` (str -> str) let a sweep make
    each variant an MLflow child run; ``artifacts`` maps artifact names (``graph/plan.txt``) to
    their text or bytes: the caller's, so the runtime logs the plan's explain text and picture
    (``graph.drawing.plan_artifacts``) without importing the compiler's printing or drawing.
    """
    from dapo_flow import threads
    from dapo_flow.runtime.session import run_session
    from dapo_flow.runtime.setup import driver_threads

    # the driver's own budget, before any worker starts (Ray workers inherit its environment);
    # an in-process stage worker then sets its stage's (StageWorker)
    threads.configure(driver_threads(placed))
    kwargs = dict(placed=placed, executor=executor, address=address, steps=steps, console=console,
                  run_name=run_name, parent_run_id=parent_run_id, extra_params=extra_params or {},
                  artifacts=artifacts or {})
    if executor != "ray":  # one process: nothing to restart apart from the run itself
        return run_session(resume=resume, **kwargs)
    from rich.console import Console

    from dapo_flow.runtime import checkpoint
    from dapo_flow.runtime.recovery import heal
    from dapo_flow.runtime.resume import checkpoint_root

    from dapo_flow.runtime.executors import connect_ray

    say = (console or Console(stderr=True)).print
    root = checkpoint_root(placed.plan.spec)
    # the cluster outlives a recovery's restart of the actors (starting one again costs seconds)
    owns_cluster = connect_ray(address)
    try:
        return heal(run_session, max_failures=placed.plan.spec.run.max_failures, resume=resume,
                    say=lambda text: say(f"[yellow]{text}[/]", highlight=False),
                    has_checkpoint=lambda run_id: bool(checkpoint.runs(root).get(run_id)), **kwargs)
    finally:
        if owns_cluster:
            import ray

            ray.shutdown()
