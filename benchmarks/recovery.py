"""Recovery benchmark: how long a run on Ray loses when one of its actors dies, by actor kind.

graphs/dapo.yaml on Ray (shortened), with run.max_failures at its default: once the checkpoint
of step 2 is written, the process of one actor is killed with SIGKILL, and the run heals itself
(dapo_flow/runtime/recovery.py). Kinds: a training worker (a member of the policy's training
group, which also generates: colocated), the rollout actor (placement disaggregated), the
driver stage's actor (the model-free operators: score, filter, advantage), and one of two rollout
replicas (rollout.replicas 2), which heals in place (dapo_flow/runtime/replicas.py): its rows go
to the other replica, a replacement starts, and nothing restarts or is trained again.

Per kind, measured in the same run:
- detect_s: from the kill to the run's report of the fault;
- to_next_step_s: from the kill to the end of the first step trained after the recovery (the
  restart of every actor, the models loaded again, the checkpoint restored, the step trained;
  in place: the step the replica was lost in, its share generated again);
- seconds_lost: the run's own faults/seconds_lost (the fault until it is back at the step that
  failed), and steps_redone (trained again after the checkpoint);
- step_s: the median step before the fault (the baseline), and to_next_step_steps =
  to_next_step_s / step_s: what a fault costs, in steps.

Run: python benchmarks/recovery.py [--quick] [--kind KIND ...] [--json PATH] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import DEFAULT_GRAPH, make_console, run_graph, scratch_dir, step_history, write_json  # noqa: E402

KINDS = {  # kind -> (stage, --set edits)
    "training worker": ("model:policy", []),
    "rollout actor": ("rollout:policy", ["placement.mode=disaggregated"]),
    "driver stage": ("driver", []),
    "lost rollout replica": ("rollout:policy", ["placement.mode=disaggregated", "models.policy.rollout.replicas=2"]),
}
#: how each kind's fault shows in the run's log: a whole run's recovery, or a replica healed in place
REPORTED = ("fault at step", "died during a generation call")


class StampedLog:
    """A console's file that keeps when each line was written (time.monotonic())."""

    def __init__(self):
        self.lines: list[tuple[float, str]] = []

    def write(self, text: str) -> int:
        now = time.monotonic()
        self.lines += [(now, line) for line in text.splitlines() if line.strip()]
        return len(text)

    def flush(self) -> None:
        pass

    def first(self, needle: str) -> float | None:
        return next((t for t, line in self.lines if needle in line), None)


def _actor_pid(executor, stage: str) -> int:
    import ray

    actor = executor.actors[stage] if stage in executor.actors else executor.groups[stage].members[0]
    return ray.get(actor.__ray_call__.remote(lambda _self: os.getpid()), timeout=120)


def measure(kind: str, steps: int, prompts: int, console) -> dict:
    from rich.console import Console

    from dapo_flow.runtime import executors
    from dapo_flow.runtime.loop import Runner

    stage, edits = KINDS[kind]
    started, step_ends, killed = [], [], []
    init, step = executors.RayExecutor.__init__, Runner.step

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        started.append(self)

    def timed_step(self, state, *args, **kwargs):
        out = step(self, state, *args, **kwargs)
        step_ends.append((time.monotonic(), state.step + 1, len(started)))
        return out

    def kill_after_checkpoint() -> None:
        while not started:
            time.sleep(0.01)
        pid = _actor_pid(started[0], stage)
        while not list(Path.cwd().glob("dapo-flow-runs/checkpoints/*/*/step_000002/manifest.json")):
            time.sleep(0.01)
        killed.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    log = StampedLog()
    executors.RayExecutor.__init__, Runner.step = recording_init, timed_step
    try:
        killer = threading.Thread(target=kill_after_checkpoint, daemon=True)
        killer.start()
        sets = edits + [f"run.steps={steps}", "run.checkpoint_every=2", "run.val_every=0",
                        f"run.prompts_per_step={prompts}"]
        summary, _ = run_graph(DEFAULT_GRAPH, sets, executor="ray", steps=steps, console=Console(file=log, width=200))
        killer.join()
    finally:
        executors.RayExecutor.__init__, Runner.step = init, step
    history = step_history(summary)
    kill_t = killed[0]
    before = [b - a for (a, _, s1), (b, _, s2) in zip(step_ends, step_ends[1:]) if b <= kill_t and s1 == s2 == 1]
    restarted = len(started) > 1
    after = next(t for t, _, session in step_ends if (session == 2 if restarted else t > kill_t))
    fault_step = next(iter(history["faults/count"]))
    reported = [t for t in map(log.first, REPORTED) if t is not None]
    row = {
        "kind": kind, "stage": stage, "fault_step": fault_step,
        "detect_s": (min(reported) if reported else float("nan")) - kill_t,
        "to_next_step_s": after - kill_t,
        "seconds_lost": history["faults/seconds_lost"][fault_step],
        "steps_redone": history["faults/steps_redone"][fault_step],
        "step_s": statistics.median(before) if before else float("nan"),
        "restarts": len(started) - 1,
    }
    row["to_next_step_steps"] = row["to_next_step_s"] / row["step_s"]
    console.print(f"{kind:20s} detect {row['detect_s']:6.2f} s  to next step {row['to_next_step_s']:6.1f} s "
                  f"({row['to_next_step_steps']:.0f} steps of {row['step_s']:.2f} s)  "
                  f"lost {row['seconds_lost']:.1f} s, {row['steps_redone']:.0f} redone")
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the training worker and a lost rollout replica "
                    "only, 6 steps of 8 prompts")
    ap.add_argument("--kind", action="append", choices=list(KINDS), help="measure this kind (repeatable; "
                    "default: every kind, or --quick's)")
    ap.add_argument("--json", metavar="PATH", help="write the results here")
    ap.add_argument("--workdir", help="keep the MLflow store and checkpoints here (default: a temp dir)")
    args = ap.parse_args(argv)
    console = make_console()
    kinds = args.kind or (["training worker", "lost rollout replica"] if args.quick else list(KINDS))
    steps, prompts = (6, 8) if args.quick else (10, 16)
    rows = []
    with scratch_dir(args.workdir, console) as where:
        for i, kind in enumerate(kinds):  # a folder each: the run's own checkpoint tells the killer when
            (where / f"kind{i}").mkdir()
            os.chdir(where / f"kind{i}")
            rows.append(measure(kind, steps, prompts, console))
    write_json(args.json, {"benchmark": "recovery", "quick": args.quick, "steps": steps,
                           "prompts_per_step": prompts, "cpus": os.cpu_count(), "kinds": rows}, console)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
