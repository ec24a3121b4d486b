"""Crash and resume: a run killed (SIGKILL), interrupted (Ctrl-C) or dying between writing a
checkpoint and flushing its metrics continues with `--resume` into the same MLflow run,
every step logged exactly once, with the numbers of a run that was never interrupted.

Every graph here carries surplus groups (run.carry_surplus), so the carry table has to
survive the checkpoint too. Seed 0 carries 2 groups out of step 2 (the crash test checks).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dapo_flow.graph.compiler import compile_graph
from dapo_flow.graph.plan import Cluster
from dapo_flow.runtime import checkpoint, execute
from dapo_flow.tracking import Tracker, read_run, runs_dir, search_runs

pytestmark = pytest.mark.slow

CLUSTER = Cluster(cpus=2)
STEPS = 8
EXPERIMENT = "runtime-tests"  # the small graph's tracking.experiment
DAPO_FLOW = str(Path(sys.executable).with_name("dapo-flow"))
# seconds to wait for a checkpoint / a run; generous: CI boxes are shared and 2-core
WAIT_S = 150


def _deterministic(history: dict) -> dict:
    """Metric histories without wall-clock ones (time/*, perf/*, generation speed)."""
    return {k: v for k, v in history.items()
            if not k.startswith(("time/", "perf/")) and k not in ("gen/seconds", "gen/tokens_per_s")}


def _graph(small_graph, where: Path) -> Path:
    return small_graph(where, name="crash", steps=STEPS, ckpt=2, carry=True)


def _uri(where: Path) -> str:
    return f"sqlite:///{where / 'dapo-flow-runs' / 'mlflow.db'}"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS")}
    return {**env, "RAY_AUTH_MODE": "disabled", "COLUMNS": "200"}


def _start(path: Path, executor: str, log: Path, *flags: str) -> subprocess.Popen:
    # its own session: after a SIGKILL of the driver, its process group is ours to clean up
    return subprocess.Popen([DAPO_FLOW, "run", str(path), "--executor", executor, *flags],
                            cwd=path.parent, env=_env(), stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for_checkpoint(proc: subprocess.Popen, root: Path, step: int, log: Path,
                         other_runs: tuple[Path, ...] = ()) -> Path:
    """The run folder of ``proc``'s run once it has checkpoint ``step`` (``other_runs``: the
    folders of runs before it)."""
    deadline = time.monotonic() + WAIT_S

    def found() -> list[Path]:
        return [p.parent for p in root.glob(f"checkpoints/*/*/step_{step:06d}")
                if p.parent not in other_runs and (p / checkpoint.MANIFEST_FILE).is_file()]

    while not found():
        if proc.poll() is not None:
            pytest.fail(f"the run ended (rc {proc.returncode}) before checkpoint {step}:\n"
                        f"{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no checkpoint {step} after {WAIT_S} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.05)
    return found()[0]


def _kill_group(proc: subprocess.Popen) -> None:
    """What the dead driver left behind (an embedded Ray's agents), by its process group."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _assert_each_step_once(history: dict) -> None:
    for key in ("batch/reward_mean", "actor/pg_loss"):
        assert [s for s, _ in history[key]] == list(range(1, STEPS + 1)), key


@pytest.fixture(scope="module")
def reference(tmp_path_factory, small_graph, tiny_adder_path) -> dict:
    """Deterministic metric histories of the crash graph run straight through (local)."""
    where = tmp_path_factory.mktemp("reference")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(where)
        mp.delenv("MLFLOW_TRACKING_URI", raising=False)
        summary = execute(compile_graph(_graph(small_graph, where), CLUSTER), executor="local")
        history = read_run(summary["tracking_uri"], summary["run_id"])["history"]
    _assert_each_step_once(history)
    return _deterministic(history)


def _resume_cli(path: Path, executor: str) -> subprocess.CompletedProcess:
    r = subprocess.run([DAPO_FLOW, "run", str(path), "--executor", executor, "--resume"],
                       cwd=path.parent, env=_env(), capture_output=True, text=True, timeout=WAIT_S)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def _sigkill_after(proc: subprocess.Popen, root: Path, step: int, log: Path,
                   other_runs: tuple[Path, ...] = ()) -> Path:
    """SIGKILL (a crash: no handler runs, nothing is flushed) once checkpoint ``step`` is
    on disk; returns the latest checkpoint then, checked to be before the last step."""
    try:
        ckpt_root = _wait_for_checkpoint(proc, root, step, log, other_runs)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(30) == -signal.SIGKILL
    finally:
        proc.kill()
        _kill_group(proc)
    latest = checkpoint.latest(ckpt_root)
    assert step <= int(latest.name.removeprefix("step_")) < STEPS, latest
    return latest


def _assert_same_finished_run(where: Path, run_id: str, reference: dict) -> None:
    runs = search_runs(_uri(where), EXPERIMENT)
    assert [run["run_id"] for run in runs] == [run_id]  # resumed into it, no second run
    run = read_run(_uri(where), run_id)
    assert run["status"] == "FINISHED"
    _assert_each_step_once(run["history"])
    assert [s for s, _ in run["history"]["val/acc"]] == [0, 2, 4, 6, 8]
    assert _deterministic(run["history"]) == reference


@pytest.mark.timeout(3 * WAIT_S)
def test_ctrl_c_then_sigkill_then_resume_local(workdir, small_graph, reference):
    path = _graph(small_graph, workdir)
    runs_root = workdir / "dapo-flow-runs"

    # Ctrl-C after checkpoint 2: exit 2, a message naming --resume, the MLflow run KILLED
    log = workdir / "interrupted.log"
    proc = _start(path, "local", log)
    try:
        ckpt_root = _wait_for_checkpoint(proc, runs_root, 2, log)
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(WAIT_S)
    finally:
        proc.kill()
    out = log.read_text()
    assert rc == 2, out[-3000:]
    assert "interrupted" in out and "dapo-flow run GRAPH --resume" in out and "Traceback" not in out
    [interrupted] = search_runs(_uri(workdir), EXPERIMENT)
    assert interrupted["status"] == "KILLED"
    assert checkpoint.latest(ckpt_root).name == "step_000002"

    # `--resume`, then a crash (SIGKILL) after checkpoint 4
    log = workdir / "killed.log"
    latest = _sigkill_after(_start(path, "local", log, "--resume"), runs_root, 4, log)
    assert "resuming from" in log.read_text()

    # `--resume` to the end, in-process
    summary = execute(compile_graph(path, CLUSTER), executor="local", resume=True)
    assert summary["run_id"] == interrupted["run_id"] == checkpoint.load(latest)[0].mlflow_run_id
    _assert_same_finished_run(workdir, interrupted["run_id"], reference)


@pytest.mark.timeout(3 * WAIT_S)
def test_sigkill_then_resume_on_ray(workdir, small_graph, reference):
    path = _graph(small_graph, workdir)
    log = workdir / "killed.log"
    latest = _sigkill_after(_start(path, "ray", log), workdir / "dapo-flow-runs", 4, log)
    run_id = checkpoint.load(latest)[0].mlflow_run_id
    r = _resume_cli(path, "ray")
    assert latest.name in r.stdout.replace("\n", "")  # "resuming from .../step_N"
    # the same numbers as the uninterrupted local run: Ray and local agree, resumed or not
    _assert_same_finished_run(workdir, run_id, reference)


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file()}


@pytest.mark.timeout(3 * WAIT_S)
def test_resume_continues_the_killed_run_not_the_finished_one(workdir, small_graph, capsys):
    """Run A finishes; run B of the same graph is SIGKILLed after its first checkpoint:
    `--resume` continues B into B's MLflow run (every step once, A's numbers: same graph, same
    seed) and leaves A's checkpoints alone; once both finished, `--resume` is a clear exit 2."""
    from dapo_flow import cli

    path = _graph(small_graph, workdir)
    a = execute(compile_graph(path, CLUSTER), executor="local")
    [a_folder] = workdir.glob(f"dapo-flow-runs/checkpoints/*/{a['run_id']}")
    a_files = _files(a_folder)
    reference = _deterministic(read_run(_uri(workdir), a["run_id"])["history"])

    log = workdir / "b.log"
    latest = _sigkill_after(_start(path, "local", log), workdir / "dapo-flow-runs", 2, log, (a_folder,))
    b_id = latest.parent.name
    assert b_id != a["run_id"] and checkpoint.load_driver(latest).mlflow_run_id == b_id
    r = _resume_cli(path, "local")
    assert f"of run {b_id}" in r.stdout.replace("\n", "")
    runs = {run["run_id"]: run["status"] for run in search_runs(_uri(workdir), EXPERIMENT)}
    assert runs == {a["run_id"]: "FINISHED", b_id: "FINISHED"}  # B resumed into, no third run
    b = read_run(_uri(workdir), b_id)
    _assert_each_step_once(b["history"])
    assert _deterministic(b["history"]) == reference
    assert _files(a_folder) == a_files  # A's checkpoints untouched
    assert _deterministic(read_run(_uri(workdir), a["run_id"])["history"]) == reference

    assert cli.main(["run", str(path), "--executor", "local", "--resume"]) == 2
    err = capsys.readouterr().err.replace("\n", " ")
    assert "nothing to resume: no unfinished run of graph 'crash'" in err and "Traceback" not in err
    assert a["run_id"] in err and b_id in err and "run without --resume" in err


class _Crash(BaseException):
    """Stands for the process dying (OOM kill, preemption) at a chosen point."""


def test_crash_between_checkpoint_and_metric_flush_resumes_carry_and_metrics(
        workdir, small_graph, reference, monkeypatch):
    """The run dies right after checkpoint 2 is on disk, before its metrics (steps 0-2's, one
    write) reach MLflow: the resume logs exactly those, restores the carried-over groups and
    the op states, and ends with the numbers of the uninterrupted run."""
    path = _graph(small_graph, workdir)
    _crash_when_flushing(path, 1, monkeypatch)
    [ckpt] = runs_dir().glob("checkpoints/crash-*/*/step_000002")
    carry = checkpoint.load_carry(ckpt)
    assert carry is not None and len(set(carry.column("prompt_id").to_pylist())) >= 1  # 2 at seed 0
    assert checkpoint.latest(ckpt.parent) == ckpt

    summary = execute(compile_graph(path, CLUSTER), executor="local", resume=True)
    _assert_same_finished_run(workdir, summary["run_id"], reference)


def test_resume_of_a_finished_run_with_a_lost_final_flush(workdir, small_graph, monkeypatch):
    """Killed after the last checkpoint but before its flush: resume only logs and finishes."""
    path = small_graph(workdir, name="short", steps=2, ckpt=2)
    _crash_when_flushing(path, 2, monkeypatch)
    summary = execute(compile_graph(path, CLUSTER), executor="local", resume=True)
    run = read_run(summary["tracking_uri"], summary["run_id"])
    assert run["status"] == "FINISHED"
    assert [s for s, _ in run["history"]["batch/reward_mean"]] == [1, 2]


def _crash_when_flushing(path, crash_step: int, monkeypatch) -> None:
    """Run ``path`` locally and die when the metrics of ``crash_step`` reach MLflow."""
    flush = Tracker.log_steps

    def dying_flush(self, entries):
        entries = list(entries)
        if any(step == crash_step for step, _ in entries):
            raise _Crash()
        flush(self, entries)

    monkeypatch.setattr(Tracker, "log_steps", dying_flush)
    with pytest.raises(_Crash):
        execute(compile_graph(path, CLUSTER), executor="local")
    monkeypatch.setattr(Tracker, "log_steps", flush)
